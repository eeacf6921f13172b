"""The scheduler-shaped runtime: sequences join and leave a running batch, rows stay compact, readers stay apart."""

import pytest
import torch

import moestream
from moestream.cli import DEMO_MODEL
from moestream.runtime.sampling import SamplingParams
from moestream.runtime.scheduler import Scheduler
from moestream.runtime.sequence import Sequence, Status

PROMPTS = [torch.randint(2, 160, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 17, 9, 30, 3)]


@pytest.fixture(scope="module")
def alone(tiny_qwen3):
    """Each prompt generated on its own: what any batching must reproduce (greedy, fp32)."""
    engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32")
    return [engine.generate(p, max_tokens=6 + 3 * i, ignore_eos=True) for i, p in enumerate(PROMPTS)]


def test_more_prompts_than_the_batch_holds_wait_their_turn(tiny_qwen3, alone):
    engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32", max_batch=2)
    seqs = [engine.add_request(p, SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True)) for i, p in enumerate(PROMPTS)]
    most_running = 0
    while not engine.scheduler.idle:
        engine.step()
        running = engine.scheduler.running
        most_running = max(most_running, len(running))
        assert [s.row for s in running] == list(range(len(running)))   # rows stay compact
    assert most_running == 2
    assert [s.tokens for s in seqs] == alone
    assert all(s.status is Status.FINISHED and s.finish_reason == "length" and s.row is None for s in seqs)


def test_a_batch_of_different_lengths_equals_each_alone(tiny_qwen3, alone):
    engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32", capacity=3)   # through the bounded bank too
    seqs = [engine.add_request(p, SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True)) for i, p in enumerate(PROMPTS)]
    while not engine.scheduler.idle:
        engine.step()
    assert [s.tokens for s in seqs] == alone


def test_a_sequence_joins_a_running_batch(tiny_qwen3, alone):
    engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32")
    first = engine.add_request(PROMPTS[3], SamplingParams(max_tokens=6 + 9, ignore_eos=True))
    for _ in range(4):
        engine.step()
    late = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=6 + 3, ignore_eos=True))
    engine.step()
    assert late.sampled == 1 and first.sampled == 5 and engine.runner.cache.rows >= 2
    while not engine.scheduler.idle:
        engine.step()
    assert first.tokens == alone[3] and late.tokens == alone[1]


def test_interleaved_streams_on_one_engine_stay_independent():
    engine = moestream.load(DEMO_MODEL, device="cpu", dtype="float32")
    prompts = ["def fibonacci(n):", "import os\n\nclass Config:"]
    expected = [engine.generate(p, max_tokens=20, ignore_eos=True) for p in prompts]
    a, b = (engine.stream(p, max_tokens=20, ignore_eos=True) for p in prompts)
    texts = ["", ""]
    for pieces in zip(a, b):
        for i, piece in enumerate(pieces):
            texts[i] += piece
    texts[0] += "".join(a)
    texts[1] += "".join(b)
    assert texts == expected


def test_a_reader_that_stops_early_frees_its_row(tiny_qwen3):
    engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32")
    stream = engine.stream_tokens(PROMPTS[0], max_tokens=50, ignore_eos=True)
    next(stream)
    next(stream)
    stream.close()
    engine.step()
    assert engine.scheduler.idle


def test_retire_moves_rows_up_in_a_safe_order():
    sched = Scheduler(max_batch=8)
    seqs = [Sequence([1, 2, 3], SamplingParams(), max_len=64) for _ in range(5)]
    for s in seqs:
        sched.add(s)
    assert sched.admit() == seqs
    for s in seqs:
        s.prefilled = 3                                   # the prompts are in their rows
    seqs[0].finish("stop")
    seqs[2].finish("stop")
    moves = sched.retire()
    assert moves == [(1, 0, 3), (3, 1, 3), (4, 2, 3)]   # every destination is free when it is written
    assert [s.row for s in sched.running] == [0, 1, 2] and seqs[0].row is None


def test_a_long_prompt_prefills_in_chunks_while_others_keep_decoding(tiny_qwen3):
    engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32", prefill_chunk=8)
    long_prompt = torch.randint(2, 160, (45,), generator=torch.Generator().manual_seed(3)).tolist()
    want_long = engine.generate(long_prompt, max_tokens=4, ignore_eos=True)
    want_short = engine.generate(PROMPTS[0], max_tokens=12, ignore_eos=True)
    short = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=12, ignore_eos=True))
    engine.step()                                     # the short one is decoding now
    long = engine.add_request(long_prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    steps_to_first_token = 0
    while not long.sampled:
        before = short.sampled
        engine.step()
        steps_to_first_token += 1
        assert short.sampled == before + 1 or short.finished   # a token every step, prefill or not
        assert long.prefilled <= len(long_prompt)
    assert steps_to_first_token == -(-len(long_prompt) // 8)   # one chunk of 8 prompt tokens per step
    while not engine.scheduler.idle:
        engine.step()
    assert long.tokens == want_long and short.tokens == want_short
