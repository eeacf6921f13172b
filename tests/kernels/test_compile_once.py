"""A kernel compiles once per model shape, not once per token count (ARCHITECTURE.md, rules of the hot path, 9).

Triton compiles a variant of a kernel for each pattern of its integer arguments (divisible by 16 or
not, equal to 1 or not) unless they are `do_not_specialize`. A served step's token count changes with
every step (prompts cut to fill it, decodes riding in it, a staged group's experts), so a size that
follows it must not pick variants: the first step of each new pattern would stall for seconds while
the variant compiles. These tests run new token counts after a first one of the same tile row and
count the variants every moestream kernel has compiled.
"""

from __future__ import annotations

import pytest
import torch

from moestream.kernels import compiled_variants, fused_moe, fused_moe_available

pytestmark = pytest.mark.skipif(not fused_moe_available(), reason="needs a CUDA GPU and Triton")


def routed(T: int, k: int, slots: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden = torch.randn(T, 128, generator=generator, device="cuda").to(torch.bfloat16)
    slot_ids = torch.stack([torch.randperm(slots, generator=generator, device="cuda")[:k] for _ in range(T)]).to(torch.int32)
    slot_ids[0, 0] = -1   # an unrouted pair (another rank's expert, a CPU-served miss)
    weights = torch.softmax(torch.randn(T, k, generator=generator, device="cuda"), dim=-1)
    return hidden, slot_ids, weights


def test_the_grouped_path_compiles_nothing_for_a_new_token_count_of_its_tile_row():
    from moestream.kernels.fused_moe_triton import choose_path, grouped_by_slot_groups, select_config

    S, k, H, I = 64, 4, 128, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (torch.randn(S, 2 * I, H, generator=g, device="cuda") / 8).to(torch.bfloat16)
    down = (torch.randn(S, H, I, generator=g, device="cuda") / 8).to(torch.bfloat16)
    counts = [17, 18, 24, 31, 32, 33, 47, 48, 63, 64]   # T·k > the decode path's pairs, T·k / S <= 4: one tile row
    assert {choose_path(T, k) for T in counts} == {"grouped"}
    assert len({select_config(T, k, S) for T in counts}) == 1

    def call(T: int, group: int) -> None:
        hidden, slot_ids, weights = routed(T, k, S, g)
        fused_moe(hidden, gate_up, down, slot_ids, weights)
        # a layer's slots a group at a time (slot ranges [0, 16), [16, 32), ... or [0, 5), [5, 10), ...)
        grouped_by_slot_groups(hidden, slot_ids, weights, S, I, group,
                               lambda start, count: (gate_up[start:start + count], down[start:start + count]))

    call(counts[0], 16)
    torch.cuda.synchronize()
    before = compiled_variants()
    for T in counts[1:]:
        call(T, 5 if T % 2 else 16)
    torch.cuda.synchronize()
    assert compiled_variants() == before


def test_an_engine_at_a_bank_compiles_nothing_for_prompts_of_new_lengths(tiny_qwen3):
    """Prompts of one tile row through a bounded bank (each layer's missing experts staged in groups),
    packed two at a time and alone, each followed by decode steps."""
    import moestream

    engine = moestream.load(tiny_qwen3, device="cuda", dtype="bfloat16", capacity=3)
    vocab = engine.config.vocab_size

    def prompt(n: int, seed: int) -> list[int]:
        return [(seed * 31 + 7 * i) % (vocab - 2) + 2 for i in range(n)]

    engine.generate(prompt(40, 0), max_tokens=3, ignore_eos=True)   # 40 tokens · 2 of 8 experts: 10 rows a slot
    engine.generate([prompt(20, 1), prompt(21, 2)], max_tokens=3, ignore_eos=True)
    torch.cuda.synchronize()
    before = compiled_variants()
    for n in (33, 37, 41, 44, 47):
        engine.generate(prompt(n, n), max_tokens=3, ignore_eos=True)
    engine.generate([prompt(17, 3), prompt(19, 4)], max_tokens=3, ignore_eos=True)
    torch.cuda.synchronize()
    assert compiled_variants() == before


def test_a_warmed_up_server_compiles_nothing_for_its_first_prompts(tiny_qwen3):
    """`warm_up` (as `moestream serve` starts) runs a prompt of each tile row up to the step's budget: the
    first requests, whatever their lengths, find every grouped-path kernel compiled."""
    import moestream
    from moestream.kernels import prompt_tile_rows

    engine = moestream.load(tiny_qwen3, device="cuda", dtype="bfloat16", capacity=3, prefill_chunk=64,
                            max_batch=4, kv_rows=4)
    assert prompt_tile_rows(engine.config.top_k, engine.config.num_experts, 63) == [33, 49]   # two rows of 8 experts, k = 2
    engine.warm_up(4)
    vocab = engine.config.vocab_size
    torch.cuda.synchronize()
    before = compiled_variants()
    for n in (34, 40, 47, 50, 57, 63):
        engine.generate([(5 * n + 3 * i) % (vocab - 2) + 2 for i in range(n)], max_tokens=2, ignore_eos=True)
    engine.generate([[(7 * i) % (vocab - 2) + 2 for i in range(30)], [(11 * i) % (vocab - 2) + 2 for i in range(31)]],
                    max_tokens=1, ignore_eos=True)
    torch.cuda.synchronize()
    assert compiled_variants() == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_server_whose_step_packs_past_one_context_warms_those_tile_rows_too(tiny_qwen3):
    """A step of 64 prompt tokens over contexts of 40: `warm_up` packs prompts to reach the tile rows past
    one context, so two packed prompts of 61 tokens together compile nothing."""
    import moestream

    engine = moestream.load(tiny_qwen3, device="cuda", dtype="bfloat16", capacity=3, prefill_chunk=64,
                            max_context=40, max_batch=4, kv_rows=4)
    engine.warm_up(4)
    vocab = engine.config.vocab_size
    engine.reset_stats()
    torch.cuda.synchronize()
    before = compiled_variants()
    engine.generate([[(7 * i) % (vocab - 2) + 2 for i in range(30)], [(11 * i) % (vocab - 2) + 2 for i in range(31)]],
                    max_tokens=1, ignore_eos=True)
    torch.cuda.synchronize()
    assert engine.counters.prefill_forwards == 1   # 61 tokens past one context of 40, in one step
    assert compiled_variants() == before

