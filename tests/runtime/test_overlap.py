"""Overlapped decode: the next step is launched from the device's sampled tokens before the host reads
them. Whatever ends a sequence, joins or leaves the batch, every token equals the synchronous engine's
(fp32 on the CPU with `overlap="on"`; on a GPU `auto` turns it on wherever whole-step graphs run)."""

import pytest
import torch

import moestream
from moestream.errors import InputError, NumericsError
from moestream.runtime.sampling import SamplingParams

PROMPTS = [torch.randint(2, 160, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 17, 9, 30, 3)]


def load(folder, overlap, **kw):
    return moestream.load(folder, device="cpu", dtype="float32", overlap=overlap, max_context=128, **kw)


def run_all(engine, requests):
    """Queue (prompt, SamplingParams) pairs and step until every one ends; the sequences."""
    seqs = [engine.add_request(p, params) for p, params in requests]
    while not engine.scheduler.idle:
        engine.step()
    return seqs


def outcome(seqs):
    return [(s.tokens, s.sampled, s.finish_reason) for s in seqs]


@pytest.fixture(scope="module")
def engines(tiny_qwen3):
    return load(tiny_qwen3, "off"), load(tiny_qwen3, "on")


def test_auto_overlaps_only_where_a_step_reads_nothing_back_on_a_gpu(tiny_qwen3, engines):
    off, on = engines
    assert on.overlapping and not off.overlapping
    assert not load(tiny_qwen3, "auto").overlapping                     # the CPU: nothing to overlap with
    with pytest.raises(InputError, match="overlap 'sometimes' is unknown"):
        load(tiny_qwen3, "sometimes")


def test_steps_run_one_ahead_and_none_is_wasted_on_a_length_end(engines):
    """Each decode call after the first is launched before the previous token is read, and a sequence
    that ends by length gets no step beyond its last token."""
    off, on = engines
    for engine, ahead in ((off, 0), (on, 1)):
        seq = engine.new_sequence(PROMPTS[1], SamplingParams(max_tokens=9, ignore_eos=True))
        seen = []
        decode = engine.runner.decode

        def counting(*a, seen=seen, seq=seq, decode=decode, **k):
            seen.append(seq.sampled)
            return decode(*a, **k)
        engine.runner.decode = counting
        try:
            engine.add_sequence(seq)
            while not engine.scheduler.idle:
                engine.step()
        finally:
            del engine.runner.decode
        assert len(seen) == 8                                           # tokens 2..9, nothing more
        assert seen == [1] + [k + 1 - ahead for k in range(1, 8)]       # tokens read when each step launched
        assert engine._inflight is None


@pytest.mark.parametrize("layout", ["paged", "rows"])
def test_a_churning_batch_gives_the_synchronous_tokens(tiny_qwen3, layout):
    """Sequences of different lengths, more than the batch holds (they wait, join, leave; rows move),
    greedy and seeded sampling with filters side by side."""
    requests = [(p, SamplingParams(max_tokens=4 + 3 * i, ignore_eos=True, temperature=0.9 * (i % 2),
                                   top_k=20 * (i % 2), top_p=0.9, seed=i)) for i, p in enumerate(PROMPTS)]
    got = {}
    for overlap in ("off", "on"):
        engine = load(tiny_qwen3, overlap, kv_layout=layout, max_batch=3, kv_block_size=8)
        got[overlap] = outcome(run_all(engine, requests))
        assert engine.scheduler.idle and engine._inflight is None
    assert got["on"] == got["off"]
    assert all(reason == "length" for _, _, reason in got["on"])


def test_an_eos_ends_the_sequence_and_the_step_launched_after_it_is_dropped(engines):
    off, on = engines
    free = off.generate(PROMPTS[3], max_tokens=12, ignore_eos=True)
    eos = next(t for i, t in enumerate(free) if i >= 3 and t not in free[:i])   # first seen at step >= 4
    for engine in engines:
        engine.eos_ids = {eos}
    try:
        other = SamplingParams(max_tokens=14, ignore_eos=True, temperature=1.0, seed=5)
        requests = [(PROMPTS[3], SamplingParams(max_tokens=12)), (PROMPTS[0], other)]
        want, got = outcome(run_all(off, requests)), outcome(run_all(on, requests))
    finally:
        off.eos_ids = on.eos_ids = {1}
    assert got == want
    assert want[0][2] == "eos" and want[0][0] == free[:free.index(eos)]
    assert want[1][2] == "length"                                       # the other one decoded on, the same
    assert on.scheduler.idle and on._inflight is None


def test_a_stop_string_ends_the_stream_alike():
    from moestream.cli import DEMO_MODEL

    texts = {}
    for overlap in ("off", "on"):
        engine = load(DEMO_MODEL, overlap)
        free = engine.generate("def fibonacci(n):", max_tokens=24)
        stop = free[len(free) // 2:len(free) // 2 + 3]
        texts[overlap] = (engine.generate("def fibonacci(n):", max_tokens=24, stop=stop), stop)
        assert engine.scheduler.idle and engine._inflight is None
    assert texts["on"] == texts["off"]
    assert texts["on"][1] not in texts["on"][0]


def test_a_late_request_a_cancelled_reader_and_scoring_after_it(tiny_qwen3, engines):
    off, on = engines
    want_first = off.generate(PROMPTS[3], max_tokens=15, ignore_eos=True)
    want_late = off.generate(PROMPTS[1], max_tokens=9, ignore_eos=True)
    first = on.add_request(PROMPTS[3], SamplingParams(max_tokens=15, ignore_eos=True))
    for _ in range(5):
        on.step()
    assert on._inflight is not None                                     # a step is in flight
    late = on.add_request(PROMPTS[1], SamplingParams(max_tokens=9, ignore_eos=True))
    on.step()
    assert late.sampled == 1                                            # it joined at once: nothing ran ahead of it
    stream = on.stream_tokens(PROMPTS[2], max_tokens=40, ignore_eos=True)
    assert [next(stream), next(stream)]
    stream.close()                                                      # reads the step in flight, frees its row
    while not on.scheduler.idle:
        on.step()
    assert first.tokens == want_first and late.tokens == want_late
    context, targets = PROMPTS[0], want_late[:4]
    assert torch.allclose(on.teacher_forced(context, targets), off.teacher_forced(context, targets))


def test_a_broken_step_ends_only_its_sequence_and_the_engine_goes_on(engines):
    _, on = engines
    norm = on.model.model.norm
    saved = norm.weight.data.clone()
    seq = on.add_request(PROMPTS[0], SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(4):
        on.step()
    try:
        norm.weight.data.fill_(float("nan"))
        with pytest.raises(NumericsError, match="NaN or infinite"):
            for _ in range(3):
                on.step()
    finally:
        norm.weight.data.copy_(saved)
    assert seq.finish_reason == "error" and on.scheduler.idle and on._inflight is None
    assert on.generate(PROMPTS[1], max_tokens=5, ignore_eos=True) == engines[0].generate(PROMPTS[1], max_tokens=5,
                                                                                       ignore_eos=True)


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_the_hybrid_bank_decodes_overlapped_alike(tiny_qwen3, engines, overlap):
    off, _ = engines
    want = [off.generate(p, max_tokens=12, ignore_eos=True) for p in PROMPTS[:2]]
    engine = load(tiny_qwen3, overlap, miss_policy="hybrid", host_tier="pinned", capacity=2, discovery=False,
                  cpu_misses=0.5)
    try:
        assert [engine.generate(p, max_tokens=12, ignore_eos=True) for p in PROMPTS[:2]] == want
        assert engine.generate(PROMPTS[:2], max_tokens=12, ignore_eos=True) == want
    finally:
        engine.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_overlapped_graphs_give_the_synchronous_tokens(tiny_qwen3):
    kw = {"device": "cuda", "dtype": "float32", "max_context": 128}
    sync = moestream.load(tiny_qwen3, overlap="off", **kw)
    auto = moestream.load(tiny_qwen3, **kw)
    assert auto.overlapping and not sync.overlapping
    requests = [(p, SamplingParams(max_tokens=6 + 2 * i, ignore_eos=i != 1, temperature=0.8 * (i % 2), seed=i))
                for i, p in enumerate(PROMPTS)]
    assert outcome(run_all(auto, requests)) == outcome(run_all(sync, requests))
