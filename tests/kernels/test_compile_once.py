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



def test_decode_attention_at_longer_length_buckets_compiles_nothing():
    """A served decode whose context grows meets a new length bucket every doubling: the paged decode's split
    buffers and merge depend on the batch alone, so no bucket compiles a variant of its own (a 16,384-token
    agent turn compiled one merge variant per new bucket, mid-stream)."""
    from moestream.kernels.paged_attention_triton import paged_decode_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    heads, kv_heads, D, block_size = 32, 4, 128, 16
    for B in (1, 4):
        lengths = (256, 1024, 4096, 20000, 65536)
        max_blocks = -(-lengths[-1] // block_size)
        k_pool = torch.randn(max_blocks + 1, block_size, kv_heads, D, generator=g, device="cuda").to(torch.bfloat16)
        v_pool = torch.randn_like(k_pool)
        tables = torch.arange(1, max_blocks + 1, device="cuda", dtype=torch.int32).repeat(B, 1)
        q = torch.randn(B, heads, D, generator=g, device="cuda").to(torch.bfloat16)
        paged_decode_attention(q, k_pool, v_pool, tables, torch.full((B,), lengths[0], device="cuda"), lengths[0])
        torch.cuda.synchronize()
        before = compiled_variants()
        for max_len in lengths[1:]:
            paged_decode_attention(q, k_pool, v_pool, tables, torch.full((B,), max_len - 3, device="cuda"), max_len)
        torch.cuda.synchronize()
        assert compiled_variants() == before, B


def with_longer_context(checkpoint, out, positions: int):
    """A copy of a tiny checkpoint whose config holds `positions` (the tiny configs hold 256)."""
    import json
    import shutil

    shutil.copytree(checkpoint, out)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = positions
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_a_warmed_up_server_with_int4_experts_compiles_nothing_for_a_long_first_prompt(tiny_quant, tmp_path):
    """`warm_up` runs a step of the longest chunk too: a first prompt of 3,500 tokens in chunks of 2,048 and
    1,452 takes the int4 experts' dequantized long path (long_prompts.py) at a bounded bank, then decodes
    at a length bucket past the warm-up's, and compiles nothing (it compiled that path's kernels, ~5 s of a
    6 s first turn on the 30B shape)."""
    import moestream

    checkpoint = with_longer_context(tiny_quant, tmp_path / "long", 8192)
    engine = moestream.load(checkpoint, device="cuda", dtype="bfloat16", experts="int4", capacity=3,
                            prefill_chunk=2048, max_context=4200, max_batch=2, kv_rows=2)
    engine.warm_up(4)
    vocab = engine.config.vocab_size
    torch.cuda.synchronize()
    before = compiled_variants()
    engine.generate([(13 * i + 5) % (vocab - 2) + 2 for i in range(3500)], max_tokens=4, ignore_eos=True)
    torch.cuda.synchronize()
    assert engine.counters.prefill_tokens >= 3500
    assert compiled_variants() == before


def test_a_warmed_up_engine_compiles_nothing_for_a_clients_sampled_requests(tiny_qwen3):
    """`warm_up` draws one sampled token at each top-k variant of the two-launch draw: requests at the top-k
    clients send (Qwen's 20, 40, 50, 64, with top-p and min-p) then compile nothing while they wait."""
    import moestream

    engine = moestream.load(tiny_qwen3, device="cuda", dtype="bfloat16", max_batch=2, kv_rows=2)
    engine.warm_up(4)
    vocab = engine.config.vocab_size
    torch.cuda.synchronize()
    before = compiled_variants()
    for k in (20, 40, 50, 64):
        engine.generate([(3 * i + k) % (vocab - 2) + 2 for i in range(9)], max_tokens=3, temperature=0.7, top_k=k,
                        top_p=0.9, min_p=0.05, seed=k, ignore_eos=True)
    torch.cuda.synchronize()
    assert compiled_variants() == before
