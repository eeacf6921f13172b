"""The scheduler-shaped runtime: sequences join and leave a running batch, rows stay compact, readers stay apart."""

import pytest
import torch

import moestream
from moestream.cli import DEMO_MODEL
from moestream.runtime.blocks import BlockManager
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


# ---- chunked, cancellable prefill ------------------------------------------------------------

LONG = torch.randint(2, 160, (45,), generator=torch.Generator().manual_seed(11)).tolist()


def test_a_long_prompt_alone_prefills_one_chunk_per_step_as_a_running_sequence(tiny_qwen3):
    """Nothing else decodes, yet the prompt goes in one chunk per step: the step returns between
    chunks with the sequence counted as running and the next request counted as waiting (what a
    server's gauges read), and the tokens are the one-chunk prefill's."""
    one_shot = moestream.load(tiny_qwen3, device="cpu", dtype="float32")          # prefill_chunk 512
    want = one_shot.generate(LONG, max_tokens=6, ignore_eos=True)
    assert one_shot.counters.prefill_chunks == 1                                  # a prompt that fits is one chunk
    engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32", prefill_chunk=8, max_batch=1)
    seq = engine.add_request(LONG, SamplingParams(max_tokens=6, ignore_eos=True))
    queued = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=3, ignore_eos=True))
    steps = 0
    while not seq.sampled:
        engine.step()
        steps += 1
        assert engine.counters.prefill_chunks == steps and seq.prefilled == min(8 * steps, len(LONG))
        assert engine.scheduler.running == [seq] and list(engine.scheduler.waiting) == [queued]
    assert steps == -(-len(LONG) // 8) and engine.counters.prefill_tokens == len(LONG)
    while not engine.scheduler.idle:
        engine.step()
    assert seq.tokens == want and queued.finish_reason == "length"


@pytest.mark.parametrize("how", ["cancel", "reader"])
def test_cancelling_a_long_prompt_between_chunks_stops_its_prefill_and_frees_the_engine(tiny_qwen3, how):
    """`cancel`, or the reader marking its sequence cancelled (a server's handler, from another
    thread): no further chunk of it is computed and the request queued behind it runs at once."""
    engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32", prefill_chunk=8, max_batch=1)
    want = engine.generate(PROMPTS[0], max_tokens=5, ignore_eos=True)
    engine.reset_stats()
    long = engine.add_request(LONG, SamplingParams(max_tokens=4, ignore_eos=True))
    after = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=5, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.counters.prefill_chunks == 2 and long.prefilled == 16
    if how == "cancel":
        engine.cancel(long)
    else:
        long.finish("cancelled")
    engine.step()
    assert engine.scheduler.running == [after] and after.sampled == 1
    assert engine.counters.prefill_chunks == 3 and engine.counters.prefill_tokens == 16 + len(PROMPTS[0])
    while not engine.scheduler.idle:
        engine.step()
    assert after.tokens == want and long.finish_reason == "cancelled" and not long.sampled
    assert engine.counters.prefill_chunks == 3


def test_a_prompt_cancelled_while_its_step_runs_gets_no_more_chunks(tiny_qwen3):
    """Two short prompts share one step's budget, each its own forward; the second is cancelled by
    its reader while the first one's chunk runs: its chunk is skipped, the first one samples."""
    engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32", pack_prompts=False)
    first = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=3, ignore_eos=True))
    second = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=3, ignore_eos=True))
    prefill = engine.runner.prefill

    def cancelling(row, ids, start=0):
        second.finish("cancelled")
        return prefill(row, ids, start)
    engine.runner.prefill = cancelling
    engine.step()
    assert engine.counters.prefill_chunks == 1 and first.sampled == 1 and not second.sampled
    engine.runner.prefill = prefill
    engine.step()
    assert engine.scheduler.running == [first]


def test_a_prompt_cancelled_while_its_packed_step_runs_gets_no_token(tiny_qwen3):
    """Packed, both chunks are one forward: the one cancelled while it runs samples nothing and leaves."""
    engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32")
    first = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=3, ignore_eos=True))
    second = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=3, ignore_eos=True))
    packed = engine.runner.prefill_packed

    def cancelling(parts):
        second.finish("cancelled")
        return packed(parts)
    engine.runner.prefill_packed = cancelling
    engine.step()
    assert engine.counters.prefill_forwards == 1 and first.sampled == 1 and not second.sampled
    assert second.tokens == [] and second.finish_reason == "cancelled"
    engine.step()
    assert engine.scheduler.running == [first]


# ---- the plan alone (no model) ---------------------------------------------------------------

def seq_of(n: int, max_tokens: int = 4) -> Sequence:
    return Sequence(list(range(2, 2 + n)), SamplingParams(max_tokens=max_tokens, ignore_eos=True), max_len=64)


def execute(sched: Scheduler, plan) -> None:
    """What the engine does with a plan, on the host: chunks in, first tokens and decode tokens appended."""
    for chunk in plan.prefills:
        chunk.seq.prefilled = chunk.end
        if chunk.last:
            if chunk.seq.resuming:
                chunk.seq.resuming = False
            else:
                chunk.seq.append(7)
    for seq in plan.decodes:
        seq.append(7)
    sched.seal()
    sched.retire()


def spans(plan) -> list[tuple[int, int, int]]:
    return [(c.seq.id, c.start, c.end) for c in plan.prefills]


def test_the_plan_admits_up_to_the_batch_and_takes_whole_chunks_within_one_budget():
    sched = Scheduler(max_batch=3, prefill_chunk=8)
    a, b, c, d = seq_of(20), seq_of(5), seq_of(3), seq_of(2)
    for s in (a, b, c, d):
        sched.add(s)
    plan = sched.schedule()
    assert plan.admitted == [a, b, c] and plan.rows == 3 and list(sched.waiting) == [d]
    assert spans(plan) == [(a.id, 0, 8)] and not plan.decodes          # one chunk per step, oldest first
    execute(sched, plan)
    plan = sched.schedule()
    assert spans(plan) == [(a.id, 8, 16)]
    execute(sched, plan)
    plan = sched.schedule()
    # a's last 4 tokens; b's 5 would not fit the 4 left, and a prompt that fits a chunk is never cut
    assert spans(plan) == [(a.id, 16, 20)] and plan.prefills[0].last
    execute(sched, plan)
    plan = sched.schedule()
    assert spans(plan) == [(b.id, 0, 5), (c.id, 0, 3)] and plan.decodes == [a] and plan.prefill_tokens == 8
    execute(sched, plan)
    a.finish("cancelled")
    assert sched.retire() == [(1, 0, 5), (2, 1, 3)]                     # b and c move up
    plan = sched.schedule()
    assert plan.admitted == [d] and plan.decodes == [b, c] and spans(plan) == [(d.id, 0, 2)]
    assert [s.row for s in sched.running] == [0, 1, 2]


def test_a_step_whose_chunks_are_one_forward_cuts_the_next_prompt_to_fill_its_budget():
    """With `fill` (the engine packs a step's chunks into one forward) every step but the last takes a
    whole budget of prompt tokens, the chunks in row order: 4 prompts of 6 in budgets of 8 are 3 steps.
    Without it each prompt that fits a chunk goes whole: 4 steps, 2 tokens of each budget unused."""
    def steps(fill: bool) -> list[list[tuple[int, int, int]]]:
        sched = Scheduler(max_batch=4, prefill_chunk=8)
        seqs = [seq_of(6) for _ in range(4)]
        for s in seqs:
            sched.add(s)
        out = []
        while any(s.prefilling for s in sched.running) or sched.waiting:
            plan = sched.schedule(fill=fill)
            out.append([(seqs.index(c.seq), c.start, c.end) for c in plan.prefills])
            execute(sched, plan)
        return out

    assert steps(True) == [[(0, 0, 6), (1, 0, 2)], [(1, 2, 6), (2, 0, 4)], [(2, 4, 6), (3, 0, 6)]]
    assert steps(False) == [[(0, 0, 6)], [(1, 0, 6)], [(2, 0, 6)], [(3, 0, 6)]]


def test_decodes_riding_in_a_steps_forward_count_against_its_budget():
    """`ride`: the decoding sequences' tokens join the step's prompt forward, so that forward stays within
    `prefill_chunk` tokens: 2 decoding leave 6 of 8 for prompts; never less than one prompt token."""
    sched = Scheduler(max_batch=4, prefill_chunk=8)
    a, b = seq_of(3), seq_of(3)
    for s in (a, b):
        sched.add(s)
    execute(sched, sched.schedule(fill=True, ride=True))               # both prompts in, both decode now
    c = seq_of(20)
    sched.add(c)
    plan = sched.schedule(fill=True, ride=True)
    assert plan.decodes == [a, b] and spans(plan) == [(c.id, 0, 6)]
    assert plan.prefill_tokens + len(plan.decodes) == 8
    execute(sched, plan)
    sched = Scheduler(max_batch=12, prefill_chunk=8)
    seqs = [seq_of(1) for _ in range(9)]
    for s in seqs:
        sched.add(s)
    while any(s.prefilling for s in seqs):
        execute(sched, sched.schedule(fill=True, ride=True))
    late = seq_of(5)
    sched.add(late)
    assert spans(sched.schedule(fill=True, ride=True)) == [(late.id, 0, 1)]   # 9 decoding: one prompt token still


def test_packed_steps_cut_prompts_to_fill_them_and_keep_each_prompts_tokens(tiny_qwen3):
    engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32", prefill_chunk=8)
    prompts = [torch.randint(2, 160, (6,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(4)]
    alone = [engine.generate(p, max_tokens=4, ignore_eos=True) for p in prompts]
    engine.reset_stats()
    assert engine.generate(prompts, max_tokens=4, ignore_eos=True) == alone
    assert engine.counters.prefill_forwards == 3 and engine.counters.prefill_tokens == 24   # 8 + 8 + 8


def test_the_plan_reserves_decode_blocks_and_preempts_the_newest_when_the_pool_runs_dry():
    blocks = BlockManager(num_blocks=7, block_size=4)                    # 6 blocks; a whole sequence needs 5
    sched = Scheduler(max_batch=2, prefill_chunk=16, blocks=blocks)
    a, b = seq_of(7, max_tokens=10), seq_of(7, max_tokens=10)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert plan.admitted == [a, b] and spans(plan) == [(a.id, 0, 7), (b.id, 0, 7)]
    assert [(w.row, len(w.blocks), w.start) for w in plan.tables] == [(0, 2, 0), (1, 2, 0)]
    execute(sched, plan)
    preempted = None
    while preempted is None:
        plan = sched.schedule()
        assert all(len(s.blocks) * 4 >= s.length for s in plan.decodes)   # each decode token has its block
        for w in plan.tables:
            if w.blocks is not None:
                assert w.start + len(w.blocks) == len(sched.running[w.row].blocks)
        if plan.preempted:
            preempted = plan
        execute(sched, plan)
    assert preempted.preempted == [b] and preempted.decodes == [a]       # the newest gives its blocks back
    assert (1, None) in [(w.row, w.blocks) for w in preempted.tables]    # and its table row is cleared
    assert sched.running == [a] and list(sched.waiting) == [b] and b.resuming and b.blocks == []
    sampled = b.sampled
    while not sched.idle:
        plan = sched.schedule()
        for chunk in plan.prefills:
            assert chunk.seq is b and chunk.end == 7 + sampled - 1          # its context goes in again
        execute(sched, plan)
    assert a.sampled == b.sampled == 10 and blocks.used == 0


def test_a_prompt_waits_for_the_blocks_of_its_whole_prompt():
    blocks = BlockManager(num_blocks=6, block_size=4)                    # 5 blocks
    sched = Scheduler(max_batch=4, prefill_chunk=8, blocks=blocks)
    a, b = seq_of(11), seq_of(16)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    # b needs 5 blocks for its prompt and first token, and a's next token one more: it waits
    assert plan.admitted == [a] and list(sched.waiting) == [b]
    assert spans(plan) == [(a.id, 0, 8)] and len(a.blocks) == 2         # blocks as the chunks need them
    while not b.sampled:
        execute(sched, sched.schedule())
    assert a.finished                                                   # b ran once a's blocks came back


def test_the_plan_restores_a_rows_prefix_before_the_first_chunk():
    from moestream.runtime.prefix_cache import PrefixCache, PrefixEntry

    cache = PrefixCache(budget_bytes=1 << 20)
    seq = seq_of(20)
    cache.entries[0] = PrefixEntry(torch.tensor(seq.prompt[:12]), state=[], nbytes=0)
    sched = Scheduler(prefill_chunk=5, prefix_cache=cache)
    sched.add(seq)
    plan = sched.schedule()
    assert [(r.seq, r.key, r.length) for r in plan.restores] == [(seq, 0, 12)]
    assert spans(plan) == [(seq.id, 12, 17)] and seq.cached_tokens == 12


def test_a_step_run_ahead_gets_the_blocks_of_every_sequence_or_none():
    blocks = BlockManager(num_blocks=5, block_size=4)                    # 4 blocks
    sched = Scheduler(max_batch=2, prefill_chunk=16, blocks=blocks)
    a, b = seq_of(3, max_tokens=8), seq_of(3, max_tokens=8)
    sched.add(a)
    sched.add(b)
    execute(sched, sched.schedule())                                    # each holds 1 block, length 4
    assert sched.decodes_again([a, b]) and not sched.decodes_again([a])
    writes = sched.reserve_ahead([a, b])                                # position 4 of each: a second block
    assert [(w.row, w.start, len(w.blocks)) for w in writes] == [(0, 1, 1), (1, 1, 1)]
    for s in (a, b):
        for _ in range(4):
            s.append(7)                                                 # length 8: a third block each next
    assert blocks.available == 0 and sched.reserve_ahead([a, b]) is None
    assert len(a.blocks) == len(b.blocks) == 2                          # nothing taken
