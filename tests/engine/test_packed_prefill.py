"""Prompts admitted in one step run as one forward: each attends in its own cache row, each layer's
experts run once over all their tokens. The tokens are those of each prompt run alone, and a bounded
bank copies each missing expert once for all of them."""

from __future__ import annotations

import pytest

import moestream

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [3, 4, 5, 6, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48]]


# A plain MoE layer with a paged cache and with rows, recurrent layers, a latent cache, sinks and
# sliding windows (rows: their only layout), and Gemma 4, whose layers run their experts inside
# themselves (one forward per prompt).
@pytest.mark.parametrize("arch, kv_layout", [("qwen3_moe", "paged"), ("qwen3_moe", "rows"), ("qwen3_next", "auto"),
                                             ("deepseek_v3", "auto"), ("gpt_oss", "auto"), ("gemma4", "auto")])
def test_prompts_of_one_step_run_as_one_forward_with_the_tokens_of_each_alone(tiny_checkpoints, arch, kv_layout):
    engine = moestream.load(tiny_checkpoints[arch][0], device="cpu", dtype="float32", kv_layout=kv_layout)
    alone = [engine.generate(p, max_tokens=8, ignore_eos=True) for p in PROMPTS]
    engine.reset_stats()
    together = engine.generate(PROMPTS, max_tokens=8, ignore_eos=True)
    assert together == alone
    counters = engine.counters
    assert counters.prefill_chunks == len(PROMPTS)
    assert counters.prefill_forwards == (len(PROMPTS) if arch == "gemma4" else 1)


def test_a_bounded_bank_copies_a_steps_missing_experts_once_for_all_its_prompts(tiny_qwen3):
    def run(pack: bool) -> tuple[list, int]:
        engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32", capacity=3, pack_prompts=pack)
        tokens = engine.generate(PROMPTS, max_tokens=1, ignore_eos=True)   # the prompts alone
        return tokens, engine.stats()["bytes_copied"]

    (packed, packed_bytes), (one_each, one_each_bytes) = run(True), run(False)
    assert packed == one_each
    assert 0 < packed_bytes < one_each_bytes / 2   # 4 prompts: each layer's experts copied once, not 4 times


def test_a_step_packs_more_prompt_tokens_than_one_context_holds(tiny_qwen3):
    """A server's chunk may pass one sequence's context (auto plans for its rows): four 40-token prompts
    in contexts of 64 run as one 160-token forward, with the tokens of each alone."""
    prompts = [[3 + (7 * i + j) % 150 for j in range(40)] for i in range(4)]
    engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32", capacity=3, max_context=64, kv_rows=4,
                            max_batch=4)
    assert engine.runner.prefill_chunk > 4 * 40
    alone = [engine.generate(p, max_tokens=6, ignore_eos=True) for p in prompts]
    engine.reset_stats()
    assert engine.generate(prompts, max_tokens=6, ignore_eos=True) == alone
    assert engine.counters.prefill_forwards == 1 and engine.counters.prefill_chunks == 4


def test_a_prompt_longer_than_a_steps_budget_is_packed_chunk_by_chunk(tiny_qwen3):
    """With a 6-token budget, a step packs what fits whole (chunks are never cut to fill a step)."""
    engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32", prefill_chunk=6)
    alone = [engine.generate(p, max_tokens=4, ignore_eos=True) for p in PROMPTS]
    engine.reset_stats()
    assert engine.generate(PROMPTS, max_tokens=4, ignore_eos=True) == alone
    assert engine.counters.prefill_forwards < engine.counters.prefill_chunks


@pytest.mark.parametrize("arch, capacity", [("qwen3_moe", 3), ("qwen3_moe", None), ("qwen3_next", 3), ("deepseek_v3", 3),
                                            ("gpt_oss", 3)])
def test_at_a_bank_decodes_ride_in_a_steps_packed_prompt_forward_with_the_tokens_of_each_alone(
        tiny_checkpoints, arch, capacity):
    """A prompt arriving while others decode: at a bounded bank the step's decode tokens are parts of one
    token in the prompt's packed forward (which has just streamed the experts they need); fully resident
    they keep their decode step. Either way each sequence's tokens are its own alone."""
    from moestream.runtime.sampling import SamplingParams

    engine = moestream.load(tiny_checkpoints[arch][0], device="cpu", dtype="float32", capacity=capacity, prefill_chunk=8)
    alone = [engine.generate(p, max_tokens=6, ignore_eos=True) for p in PROMPTS]
    engine.reset_stats()
    seqs = [engine.add_request(PROMPTS[0], SamplingParams(max_tokens=6, ignore_eos=True))]
    engine.step()
    engine.step()                                              # the first one decodes now
    seqs += [engine.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True)) for p in PROMPTS[1:]]
    while not engine.scheduler.idle:
        engine.step()
    assert [s.tokens for s in seqs] == alone
    assert (engine.counters.decodes_packed > 0) == (capacity is not None)


@pytest.mark.parametrize("flag, packs", [([], True), (["--pack-prompts", "off"], False)])
def test_the_cli_packs_prompts_unless_told_not_to(tiny_qwen3, flag, packs):
    from moestream.cli.common import load_engine
    from moestream.cli.main import build_parser

    args = build_parser().parse_args(["run", str(tiny_qwen3), "--device", "cpu", "-p", "x", *flag])
    engine, _ = load_engine(args)
    engine.generate(PROMPTS, max_tokens=1, ignore_eos=True)
    assert engine.counters.prefill_forwards == (1 if packs else len(PROMPTS))


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch, capacity, policy", [("qwen3_moe", None, None), ("qwen3_moe", 3, "fetch"),
                                                    ("qwen3_moe", 3, "hybrid"), ("qwen3_next", 3, "fetch"),
                                                    ("gpt_oss", None, None)])
def test_packed_prompts_on_the_gpu_give_the_tokens_of_each_alone(tiny_checkpoints, arch, capacity, policy):
    """The device's kernels (paged decode attention, grouped MoE, a bounded bank's staging or hybrid
    misses) on a packed step: fp32, so a different call shape cannot flip a token by rounding."""
    kwargs = {"capacity": capacity, "miss_policy": policy} if capacity else {}
    engine = moestream.load(tiny_checkpoints[arch][0], device="cuda", dtype="float32", **kwargs)
    alone = [engine.generate(p, max_tokens=8, ignore_eos=True) for p in PROMPTS]
    engine.reset_stats()
    assert engine.generate(PROMPTS, max_tokens=8, ignore_eos=True) == alone
    assert engine.counters.prefill_forwards == 1


def test_a_packed_forward_is_handed_only_the_new_ids_of_each_part(tiny_qwen3):
    """A chunk's part carries its own ids and a riding decode's its one token: never the context before them
    (host work per step stays the step's tokens, however long the contexts)."""
    from moestream.runtime.sampling import SamplingParams

    engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32", capacity=3, prefill_chunk=8)
    seen: list[list[tuple[int, int]]] = []
    packed = engine.runner.prefill_packed

    def recording(parts):
        seen.append([(len(ids), start) for _, ids, start in parts])
        return packed(parts)
    engine.runner.prefill_packed = recording
    first = engine.add_request(PROMPTS[3], SamplingParams(max_tokens=6, ignore_eos=True))
    engine.step()   # 8 of its 9 prompt tokens (one forward, alone: no packing)
    engine.step()   # the last one; it samples
    engine.step()   # it decodes
    later = [engine.add_request(p, SamplingParams(max_tokens=4, ignore_eos=True)) for p in PROMPTS[:2]]
    while not engine.scheduler.idle:
        engine.step()
    assert engine.counters.decodes_packed > 0
    riding = [parts for parts in seen if len(parts) > 2]
    assert riding and all(n >= 1 for parts in seen for n, _ in parts)
    for parts in seen:
        assert sum(n for n, _ in parts) <= 8   # a step's tokens: chunks and riders, nothing before them
    decode_parts = [part for parts in riding for part in parts if part[1] >= len(PROMPTS[3])]
    assert decode_parts and all(n == 1 for n, _ in decode_parts)
    assert first.sampled == 6 and all(s.sampled == 4 for s in later)
