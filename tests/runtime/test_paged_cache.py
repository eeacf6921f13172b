"""The paged KV cache: blocks from one pool, shared by sequences with a common prefix, reused across
turns, and handed back by preemption when the pool runs dry; every token equals the rows layout's
(greedy, fp32 on the CPU)."""

import pytest
import torch

from engine_probes import prefilled_tokens

import moestream
from moestream.engine.plan import plan_load
from moestream.errors import BudgetError, InputError
from moestream.runtime.blocks import BlockManager
from moestream.runtime.sampling import SamplingParams
from moestream.runtime.sequence import Sequence

FIRST = torch.randint(2, 160, (40,), generator=torch.Generator().manual_seed(1)).tolist()
BLOCK = 8


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def run(engine, prompt, max_tokens=8):
    seq = engine.add_request(prompt, params(max_tokens))
    while not seq.finished:
        engine.step()
    return seq


def run_together(engine, prompts, max_tokens):
    seqs = [engine.add_request(p, params(m)) for p, m in zip(prompts, max_tokens)]
    while not all(s.finished for s in seqs):
        engine.step()
    return seqs


def load(folder, **kw):
    return moestream.load(folder, device="cpu", dtype="float32", prefill_chunk=16, max_context=96, **kw)


@pytest.fixture(scope="module")
def engines(tiny_qwen3):
    paged = load(tiny_qwen3, kv_layout="paged", kv_block_size=BLOCK, prefix_cache_memory="4MiB", max_batch=4)
    rows = load(tiny_qwen3, kv_layout="rows", max_batch=4)
    return paged, rows


# ---- the block manager alone ---------------------------------------------------------------

def seq_of(ids):
    return Sequence(list(ids), params(4))


def held(seq, n):
    """The sequence holds its first n positions."""
    seq.prefilled = n
    return seq


def test_blocks_are_counted_shared_and_evicted_oldest_first():
    m = BlockManager(num_blocks=7, block_size=4)
    assert m.capacity == 6 and m.available == 6
    a = seq_of(range(10, 22))
    assert m.match(a, a.prompt) == [] and m.ensure(a, 12) == [1, 2, 3]   # block 0 is never handed out
    m.seal(held(a, 12))
    assert m.used == 3
    b = seq_of(list(range(10, 22)) + [99])
    assert m.match(b, b.prompt) == [1, 2, 3]                             # shared, not copied
    assert m.refs[1] == 2 and m.used == 3
    assert m.ensure(b, 13) == [4]
    m.release(a)
    assert m.used == 4                                                    # b still holds the shared ones
    m.release(b)
    assert m.used == 0 and len(m.cached) == 3 and m.available == 6       # keyed blocks stay, evictable
    c = seq_of(range(50, 74))
    assert m.ensure(c, 24) is not None and m.stats.evicted == 3           # room taken from the cache
    assert m.ensure(seq_of([1]), 4) is None                               # nothing left: refused, nothing taken
    assert m.used == 6
    d = seq_of(list(range(10, 22)) + [7])
    assert m.match(d, d.prompt) == []                                     # its prefix was evicted


def test_a_diverging_block_and_everything_after_it_is_not_shared():
    m = BlockManager(num_blocks=9, block_size=4)
    a = seq_of(range(16))
    m.ensure(a, 16)
    m.seal(held(a, 16))
    b = seq_of([0, 1, 2, 3, 4, 5, 6, 99] + list(range(8, 17)))             # block 1 differs, blocks 2-3 equal
    assert len(m.match(b, b.prompt)) == 1
    whole = seq_of(range(16))
    assert len(m.match(whole, whole.prompt)) == 3                         # the last token always runs
    m.clear()
    assert all(m.refs[blk] for blk in m.key_of)                           # only blocks in use stay keyed


def test_without_prefix_caching_nothing_is_kept():
    m = BlockManager(num_blocks=5, block_size=4, prefix_caching=False)
    a = seq_of(range(8))
    m.ensure(a, 8)
    m.seal(held(a, 8))
    m.release(a)
    assert not m.cached and len(m.free) == 4 and m.match(seq_of(range(9)), list(range(9))) == []


# ---- the engine ----------------------------------------------------------------------------

def test_paged_tokens_equal_the_rows_layout(engines):
    paged, rows = engines
    prompts = [FIRST, FIRST[:13], FIRST[5:36], [3, 4]]
    lengths = [30, 21, 9, 40]                                             # decode across many block boundaries
    got = [s.tokens for s in run_together(paged, prompts, lengths)]
    assert got == [s.tokens for s in run_together(rows, prompts, lengths)]
    assert paged.blocks.used == 0                                         # every block given back
    assert paged.plan.memory.paged and not rows.plan.memory.paged


def test_a_second_turn_reuses_whole_blocks_and_equals_a_cold_run(engines):
    paged, rows = engines
    first = run(paged, FIRST)
    second_prompt = FIRST + first.tokens + [7, 8, 9, 10, 11]
    counts = prefilled_tokens(paged)
    second = run(paged, second_prompt, max_tokens=10)
    paged.runner.forward = type(paged.runner).forward.__get__(paged.runner)
    held_before = len(FIRST) + len(first.tokens) - 1                      # the reply's last token was never fed back
    assert second.cached_tokens >= held_before // BLOCK * BLOCK           # (more where an earlier run went on alike)
    assert second.cached_tokens % BLOCK == 0
    assert sum(counts) == len(second_prompt) - second.cached_tokens
    assert second.tokens == run(rows, second_prompt, max_tokens=10).tokens
    stats = paged.prefix_cache_stats()
    assert stats["hits"] >= 1 and stats["reused_tokens"] >= second.cached_tokens and stats["blocks_used"] == 0


def test_concurrent_sequences_point_at_the_same_prefix_blocks(engines):
    paged, rows = engines
    run(paged, FIRST)
    prompts = [FIRST + [20 + i] * (i + 1) for i in range(3)]
    seqs = [paged.add_request(p, params(6)) for p in prompts]
    shared = None
    while not all(s.finished for s in seqs):
        paged.step()
        live = [s.blocks for s in seqs if not s.finished and len(s.blocks) >= len(FIRST) // BLOCK]
        if len(live) == 3:
            shared = {tuple(b[:len(FIRST) // BLOCK]) for b in live}
    assert shared is not None and len(shared) == 1                       # one copy of the prefix, three readers
    assert all(s.cached_tokens == len(FIRST) // BLOCK * BLOCK for s in seqs)
    assert [s.tokens for s in seqs] == [run(rows, p, max_tokens=6).tokens for p in prompts]


def test_a_full_pool_preempts_the_newest_and_every_answer_stays_exact(tiny_qwen3, engines):
    _, rows = engines
    block_bytes = plan_load(moestream.EngineConfig.from_kwargs(
        tiny_qwen3, device="cpu", dtype="float32", max_context=96, kv_layout="paged",
        kv_block_size=BLOCK)).memory.kv_bytes // (96 // BLOCK + 1)
    # Room for 14 blocks: one context (12) and a little; three sequences of up to 70 positions need 27.
    small = load(tiny_qwen3, kv_layout="paged", kv_block_size=BLOCK, kv_cache_memory=14 * block_bytes,
                 prefix_cache_memory="1MiB", max_batch=3)
    assert small.blocks.capacity == 14
    prompts = [FIRST[:20], FIRST[10:35], FIRST[3:21]]
    lengths = [50, 40, 45]
    got = run_together(small, prompts, lengths)
    assert small.counters.preemptions                                     # the pool really ran dry
    assert [s.tokens for s in got] == [s.tokens for s in run_together(rows, prompts, lengths)]
    assert [len(s.tokens) for s in got] == lengths
    assert small.blocks.used == 0 and small.scheduler.idle


def test_a_bounded_bank_decodes_the_same_through_a_paged_cache(tiny_qwen3, engines):
    _, rows = engines
    bounded = load(tiny_qwen3, kv_layout="paged", kv_block_size=BLOCK, capacity=3, max_batch=2)
    prompts = [FIRST[:17], FIRST[4:30]]
    assert ([s.tokens for s in run_together(bounded, prompts, [12, 9])]
            == [s.tokens for s in run_together(rows, prompts, [12, 9])])


# ---- the plan and its options --------------------------------------------------------------

def plan(folder, **kw):
    return plan_load(moestream.EngineConfig.from_kwargs(folder, device="cpu", dtype="float32", max_context=96, **kw))


def test_auto_pages_every_model_whose_layers_all_keep_full_kv(tiny_checkpoints, tiny_qwen3):
    assert plan(tiny_qwen3).memory.paged and plan(tiny_qwen3, kv_rows=4).memory.paged
    assert not plan(tiny_qwen3, kv_layout="rows").memory.paged
    for arch in ("gpt_oss", "qwen3_next", "deepseek_v3", "gemma4"):   # rings, recurrent states, latents stay rows
        assert not plan(tiny_checkpoints[arch][0], kv_rows=4).memory.paged, arch
    assert plan(tiny_checkpoints["mixtral"][0]).memory.paged
    rows = plan(tiny_qwen3, kv_rows=4, kv_layout="rows").memory
    paged = plan(tiny_qwen3, kv_rows=4).memory
    assert paged.kv_blocks == 4 * 96 // 16 + 1 and "paged" in paged.explain()
    assert abs(paged.kv_bytes - rows.kv_bytes) <= rows.kv_bytes // 4      # the same memory, no scratch row
    with_prefix = plan(tiny_qwen3, kv_rows=4, prefix_cache_memory=paged.kv_bytes).memory
    assert with_prefix.kv_blocks == 2 * paged.kv_blocks and with_prefix.prefix_cache_bytes == 0   # one pool


def test_bad_kv_options_are_refused_clearly(tiny_checkpoints, tiny_qwen3):
    with pytest.raises(InputError, match="kv-layout paged is not available"):
        plan(tiny_checkpoints["gpt_oss"][0], kv_layout="paged")
    with pytest.raises(BudgetError, match="fewer than one context"):
        plan(tiny_qwen3, kv_layout="paged", kv_cache_memory="1KiB")
    with pytest.raises(InputError, match="kv_layout"):
        plan(tiny_qwen3, kv_layout="pages")
    with pytest.raises(InputError, match="kv_block_size"):
        plan(tiny_qwen3, kv_block_size=0)
    with pytest.raises(InputError, match="kv_cache_memory"):
        plan(tiny_qwen3, kv_cache_memory=0)


# ---- on a GPU: the flash-decoding kernel inside CUDA graphs ----------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.parametrize("capacity", [None, 3])
def test_gpu_paged_decode_equals_the_rows_layout(tiny_qwen3, capacity):
    """fp32, padded batches through whole-step graphs (resident) or graph segments (a fetch bank),
    a second turn through the prefix cache, and preemption in a pool of 1.5 contexts."""
    from moestream.kernels import fused_moe_available

    kw = dict(device="cuda", dtype="float32", max_context=160, max_batch=4, kv_rows=4, capacity=capacity,
              miss_policy="fetch")
    rows = moestream.load(tiny_qwen3, kv_layout="rows", **kw)
    paged = moestream.load(tiny_qwen3, kv_layout="paged", kv_block_size=16, prefix_cache_memory="1MiB", **kw)
    prompts = [FIRST, FIRST[:7], FIRST[3:33]]
    want = rows.generate(prompts, max_tokens=40, ignore_eos=True)
    assert paged.generate(prompts, max_tokens=40, ignore_eos=True) == want
    second = FIRST + want[0] + [5, 6, 7]
    assert paged.generate(second, max_tokens=20, ignore_eos=True) == rows.generate(second, max_tokens=20,
                                                                                    ignore_eos=True)
    assert paged.prefix_cache_stats()["reused_tokens"] >= 64
    if fused_moe_available() and capacity is None:
        assert paged.runner._graphs, "decode ran eagerly"
    small = moestream.load(tiny_qwen3, kv_layout="paged", kv_block_size=16,
                           kv_cache_memory=paged.blocks.block_bytes * 16, **kw)
    assert small.generate(prompts, max_tokens=60, ignore_eos=True) == rows.generate(prompts, max_tokens=60,
                                                                                     ignore_eos=True)


def test_check_prints_the_paged_plan_and_the_cli_refuses_bad_kv_options_in_one_line(tiny_checkpoints, tiny_qwen3,
                                                                                     capsys):
    from moestream.cli import main

    assert main(["check", str(tiny_qwen3), "--device", "cpu", "--max-context", "96"]) == 0
    assert "paged: 6 blocks × 16 positions" in capsys.readouterr().out
    for argv, match in ((["check", str(tiny_qwen3), "--device", "cpu", "--kv-cache-memory", "1KiB"], "fewer than one context"),
                        (["run", str(tiny_checkpoints["gpt_oss"][0]), "--device", "cpu", "--kv-layout", "paged", "-p", "5"],
                         "not available here")):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and match in err and "Traceback" not in err, err


def test_a_stream_of_arrivals_cancels_and_shared_prefixes_in_a_small_pool_stays_exact(tiny_qwen3, engines):
    """Seeded churn: requests arrive between steps, some share a prefix with earlier ones, some are
    cancelled (running or waiting after a preemption), the pool of 14 blocks preempts; every answer
    that finishes equals the rows layout's, and every block comes back."""
    import random

    paged, rows = engines
    small = load(tiny_qwen3, kv_layout="paged", kv_block_size=BLOCK, kv_cache_memory=14 * paged.blocks.block_bytes,
                 prefix_cache_memory="1MiB", max_batch=4)
    rng = random.Random(3)
    shared = FIRST[:24]
    live, done, cancelled = [], [], []
    for step in range(160):
        if step < 100 and rng.random() < 0.3:
            head = shared if rng.random() < 0.5 else [rng.randrange(2, 160) for _ in range(rng.randrange(3, 20))]
            prompt = head + [rng.randrange(2, 160) for _ in range(rng.randrange(1, 12))]
            live.append(small.add_request(prompt, params(rng.randrange(5, 30))))
        if live and rng.random() < 0.05:
            victim = live.pop(rng.randrange(len(live)))
            small.cancel(victim)
            cancelled.append(victim)
        small.step()
        done += [s for s in live if s.finished]
        live = [s for s in live if not s.finished]
    while live:
        small.step()
        done += [s for s in live if s.finished]
        live = [s for s in live if not s.finished]
    assert len(done) > 10 and cancelled and small.counters.preemptions
    for seq in done:
        want = run(rows, seq.prompt, max_tokens=seq.params.max_tokens).tokens
        assert seq.tokens == want, seq.prompt
    assert small.blocks.used == 0 and small.scheduler.idle
    assert small.prefix_cache_stats()["hits"] > 0
