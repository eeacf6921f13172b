"""The hybrid miss policy: every decode call's misses served at once by a CPU worker thread (from
host RAM) and by the device reading host memory in place, with no host work inside the step. On
this CPU-only machine "device" and "CPU" are both the CPU, but every step goes through the split
and the worker's mailboxes; the tokens stay those of the fully resident model (fp32)."""

import pytest
import torch

import moestream
from moestream.errors import BudgetError, InputError

PROMPTS = [[5, 6, 7, 8, 9], [12, 13, 14, 15, 16, 17, 18]]


@pytest.fixture(scope="module")
def resident(tiny_qwen3):
    engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32")
    return engine, engine.generate(PROMPTS, max_tokens=16, ignore_eos=True)


def _hybrid(folder, device="cpu", **kw):
    kw.setdefault("capacity", 2)
    return moestream.load(folder, device=device, dtype="float32", miss_policy="hybrid", host_tier="pinned",
                          discovery=False, **kw)


@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_hybrid_policy_gives_the_resident_tokens(tiny_qwen3, resident, share):
    _, want = resident
    engine = _hybrid(tiny_qwen3, cpu_misses=share)
    try:
        assert engine.bank.graph_safe                                       # no read-back inside a step
        assert [engine.generate(p, max_tokens=16, ignore_eos=True) for p in PROMPTS] == want   # one stream
        assert engine.generate(PROMPTS, max_tokens=16, ignore_eos=True) == want               # a batch of two
        stats = engine.stats()
        assert stats["misses"] > 0 and stats["hits"] > 0
        # Every step splits its misses as asked: one-stream steps by the tables, batched ones by expert.
        assert (stats["cpu_served"] > 0) == (share > 0.0)
        assert (stats["host_read"] > 0) == (share < 1.0)
        assert stats["cpu_served"] + stats["host_read"] == stats["misses"] - _prompt_misses(engine)
        assert (stats["cpu_bytes"] > 0) == (share > 0.0) and (stats["host_read_bytes"] > 0) == (share < 1.0)
    finally:
        engine.close()


def _prompt_misses(engine) -> int:
    """Prompts longer than the mailboxes go through the fetch policy (none here: every call fits)."""
    return 0


def test_the_split_is_the_same_rule_for_every_side(tiny_qwen3):
    """The one-token map sends every expert outside the bank to the host stack (S + e), and take[m] is
    the CPU's rounded share of m misses."""
    engine = _hybrid(tiny_qwen3, cpu_misses=0.5)
    try:
        engine.generate(PROMPTS[0], max_tokens=2)
        hybrid = engine.bank.hybrid_misses
        hybrid.sync_maps()                                                  # what the next step starts with
        E, S, k = engine.config.num_experts, engine.bank.capacity, engine.config.top_k
        assert hybrid.take_host.tolist() == [round(0.5 * m) for m in range(k + 1)]
        for layer, box in hybrid.mailboxes.items():
            ls = engine.bank.slots[layer]
            one_map = hybrid.one_token_maps[layer].tolist()
            assert one_map[:E] == [ls.where.get(e, S + e) for e in range(E)] and one_map[E] == -1
            # a batch's map: the bank's slots as they are, every other expert either the CPU's or read in place
            batch_map = hybrid.batch_maps[layer].tolist()
            outside = [e for e in range(E) if e not in ls.where]
            assert [batch_map[e] for e in ls.where] == list(ls.where.values()) and batch_map[E] == -1
            assert all(batch_map[e] in (-1, S + e) for e in outside)
            assert sum(batch_map[e] == -1 for e in outside) == int(0.5 * len(outside))
    finally:
        engine.close()


@pytest.mark.parametrize("share", [0.0, 0.3, 0.5, 0.75, 1.0])
def test_a_batch_map_gives_the_cpu_its_share_of_the_experts_outside_the_bank_spread_over_the_ids(share):
    from moestream.experts.hybrid import batch_split

    S, E = 4, 40
    one_map = torch.tensor([S + e for e in range(E)] + [-1], dtype=torch.int32)
    one_map[[3, 17, 20, 31]] = torch.tensor([0, 1, 2, 3], dtype=torch.int32)   # the bank's four
    out = batch_split(one_map, S, share)
    outside = [e for e in range(E) if one_map[e] >= S]
    cpu = [e for e in outside if out[e] == -1]
    assert out[[3, 17, 20, 31]].tolist() == [0, 1, 2, 3] and out[E] == -1
    assert all(out[e] == S + e for e in outside if e not in cpu)
    assert len(cpu) == int(share * len(outside))
    if 0 < share < 1:   # spread: each half of the ids holds about its part of the CPU's experts
        low = sum(e < E // 2 for e in cpu)
        assert abs(low - len(cpu) / 2) <= 2


def test_promotions_turn_to_one_probe_at_a_time_where_they_do_not_pay():
    """A promoted expert used once in its next 16 tokens (routing without locality) leaves a refresh
    one promotion, and none while that one is watched; one used on most tokens keeps every refresh its
    `PROMOTE_MOST`, and probes that pay again turn the gauge eager again."""
    import numpy as np

    from moestream.experts.hybrid import PROMOTE_MOST, PromotionGauge

    def watch(gauge, expert, uses_in_16):
        gauge.promoted([expert])
        for part in (uses_in_16 - uses_in_16 // 2, uses_in_16 // 2):   # two periods of 8 tokens
            counts = np.zeros(16, dtype=np.int64)
            counts[expert] = part
            assert gauge.most(PROMOTE_MOST) in (0, PROMOTE_MOST)       # nothing new while a probe is out
            gauge.observe(counts, 8)
        assert expert not in gauge.watched                              # watched for 16 tokens only

    for uses_in_16, pays in ((0, False), (1, False), (12, True)):
        gauge = PromotionGauge(follow=16)
        assert gauge.most(PROMOTE_MOST) == PROMOTE_MOST                 # eager to start
        for expert in range(12):
            watch(gauge, expert, uses_in_16)
        assert gauge.pays is pays, uses_in_16
        assert gauge.most(PROMOTE_MOST) == (PROMOTE_MOST if pays else 1)
        if not pays:
            gauge.promoted([3])
            assert gauge.most(PROMOTE_MOST) == 0
            for expert in range(12):                                    # the routing turns repetitive
                watch(gauge, expert, 12)
            assert gauge.most(PROMOTE_MOST) == PROMOTE_MOST


def test_a_prompt_routed_like_chance_starts_the_gauge_probing():
    """Uses spread as k distinct uniform draws a token spread them (dispersion near 1) start the gauge
    probing; clustered uses start it eager; too few uses leave it as it was."""
    import numpy as np

    from moestream.experts.hybrid import PROMOTE_MOST, PromotionGauge

    rng = np.random.default_rng(0)
    for tokens in (16, 64, 512):
        uniform = np.bincount(np.concatenate([rng.choice(128, 8, replace=False) for _ in range(tokens)]), minlength=128)
        clustered = np.bincount(np.concatenate([rng.choice(24, 8, replace=False) for _ in range(tokens)]), minlength=128)
        gauge = PromotionGauge()
        gauge.start(uniform)
        assert not gauge.pays and gauge.most(PROMOTE_MOST) == 1, tokens
        gauge.start(clustered)
        assert gauge.pays and gauge.most(PROMOTE_MOST) == PROMOTE_MOST, tokens
    few = np.zeros(128, dtype=np.int64)
    few[:40] = 1                                                        # 5 tokens' worth: mean under one
    gauge = PromotionGauge()
    gauge.start(uniform)
    gauge.start(few)
    assert not gauge.pays                                               # unchanged


class _Clustered:
    """Benchmark routing that sends every token to experts 0 and 1: as clustered as routing gets."""

    prediction_accuracy = None

    def __call__(self, layer, logits):
        ids = torch.tensor([0, 1]).expand(logits.shape[0], 2)
        weights = logits.float().softmax(-1).gather(-1, ids)
        return weights / weights.sum(-1, keepdim=True), ids


@pytest.mark.parametrize("routing", ["clustered", "uniform"])
def test_each_prompt_starts_the_gauges_from_its_own_routing(tiny_qwen3, routing):
    """After a prompt (staged through the fetch policy, which records its uses) the first decode step
    starts every layer's gauge from it: eager where the prompt's routing clusters, probing where it is
    uniform."""
    from moestream.bench.routing import UniformRouting, use_routing

    torch.manual_seed(0)
    engine = _hybrid(tiny_qwen3)
    try:
        use_routing(engine, _Clustered() if routing == "clustered" else UniformRouting(2, "cpu"))
        gauges = engine.bank.hybrid_misses.gauges
        for gauge in gauges.values():
            gauge.value = 1.0 if routing == "clustered" else gauge.USEFUL   # the other way round first
        prompt = torch.randint(2, 160, (60,), generator=torch.Generator().manual_seed(0)).tolist()
        engine.generate(prompt, max_tokens=3, ignore_eos=True, temperature=1.0, seed=0)
        assert [gauge.pays for gauge in gauges.values()] == [routing == "clustered"] * len(gauges)
    finally:
        engine.close()


def test_the_split_moves_toward_the_side_that_waits_less():
    from moestream.experts.hybrid import SplitBalance

    target = SplitBalance.TARGET_WAIT
    for wait, direction in ((3 * target, -1), (0.0, 1), (target, 0)):       # the device's wait, share of a call
        balance = SplitBalance(0.6, adaptive=True, top_k=8, least_calls=32)
        assert not balance.observe(16, 16, round(16_000 * wait), 16_000)    # too few calls to judge
        moved = balance.observe(16, 16, round(16_000 * wait), 16_000)
        assert moved == (direction != 0)
        assert (balance.share > 0.6) - (balance.share < 0.6) == direction, wait
        assert balance.wait_share == pytest.approx(wait)
    far, near = (SplitBalance(0.6, adaptive=True, top_k=8, least_calls=1) for _ in range(2))
    far.observe(10, 10, 500, 1000)                                          # waited half the call: a whole step
    near.observe(10, 10, round(1000 * target * 1.5), 1000)                  # just past the target: half a step
    assert far.share == pytest.approx(0.6 - SplitBalance.STEP)
    assert near.share == pytest.approx(0.6 - SplitBalance.STEP / 2)
    for top_k in (2, 8):
        for wait, side in ((900, 1), (0, top_k - 1)):                      # the device always / never waits
            balance = SplitBalance(0.6, adaptive=True, top_k=top_k, least_calls=1)
            for _ in range(40):
                balance.observe(10, 10 if wait else 0, wait, 1000)
            assert balance.takes(top_k)[top_k] == side                      # each side keeps one of k misses
    fixed = SplitBalance(0.6, adaptive=False, top_k=4, least_calls=1)
    assert not fixed.observe(100, 100, 50_000, 60_000) and fixed.share == 0.6   # a share the user set stays
    assert fixed.takes(4) == [0, 1, 1, 2, 2]


def test_the_balance_reports_how_long_the_device_waited_per_split_call():
    from moestream.experts.hybrid import SplitBalance

    for adaptive in (True, False):
        balance = SplitBalance(0.6, adaptive=adaptive, top_k=8, least_calls=32)
        assert balance.wait_us_per_call is None and balance.wait_share is None
        balance.observe(16, 8, 900, 8000)
        assert balance.wait_us_per_call is None                             # a window is 32 calls
        balance.observe(16, 8, 700, 8000)
        assert balance.wait_us_per_call == 50.0 and balance.wait_share == 0.1
        assert balance.span_us_per_call == 500.0                           # post to answer, per call
        balance.observe(40, 0, 0, 4000)
        assert balance.wait_us_per_call == 0.0 and balance.wait_share == 0.0 and balance.span_us_per_call == 100.0


@pytest.mark.parametrize("answer_late", [True, False])
def test_a_moving_split_keeps_both_sides_on_the_same_table(tiny_qwen3, resident, answer_late, monkeypatch):
    """With the default share ("auto") the split follows how long the device waited; the worker and
    the kernels read the same table after every move, so the tokens stay the resident model's."""
    import time

    from moestream.experts.hybrid import batch_split
    from moestream.kernels import cpu_moe

    _, want = resident
    wait_answer = cpu_moe.wait_answer

    def waiting(header, seq, timeout_s=30.0):   # late: the answer comes 2 ms after the device asks for it
        time.sleep(0.002)
        return wait_answer(header, seq, timeout_s)

    monkeypatch.setattr(cpu_moe, "answered", lambda header, seq: not answer_late)
    if answer_late:
        monkeypatch.setattr(cpu_moe, "wait_answer", waiting)
    engine = _hybrid(tiny_qwen3)
    try:
        hybrid = engine.bank.hybrid_misses
        hybrid.balance.least_calls = hybrid.batch_balance.least_calls = 4
        start, batch_start = hybrid.cpu_share, hybrid.batch_cpu_share
        assert [engine.generate(p, max_tokens=16, ignore_eos=True) for p in PROMPTS] == want
        assert engine.generate(PROMPTS, max_tokens=16, ignore_eos=True) == want      # batches: their own share
        assert (hybrid.cpu_share < start) if answer_late else (hybrid.cpu_share > start)
        assert (hybrid.batch_cpu_share < batch_start) if answer_late else (hybrid.batch_cpu_share > batch_start)
        takes, cuts = hybrid.balance.split(engine.config.top_k, engine.bank.store.shape.intermediate, hybrid.quantum)
        assert hybrid.split_host.tolist()[:2] == [takes, cuts]
        assert torch.equal(hybrid.split.cpu(), hybrid.split_host)
        assert all(read.cpu_take is hybrid.take and read.cpu_cut is hybrid.cut for read in hybrid.host_reads.values())
        hybrid.sync_maps()
        S = engine.bank.capacity
        for layer, batch_map in hybrid.batch_maps.items():   # rebuilt at the share the balance moved to
            assert torch.equal(batch_map.cpu(), batch_split(hybrid.one_token_maps[layer].cpu(), S, hybrid.batch_cpu_share))
    finally:
        engine.close()


def test_a_batch_share_fixed_for_a_comparison_holds_and_gives_way_back(tiny_qwen3, resident):
    """`fix_batch_share` pins the batch split (its maps rebuilt at that share, the tokens the resident
    model's), and None hands it back to the balance; a share outside 0..1 is refused."""
    from moestream.experts.hybrid import batch_split

    _, want = resident
    engine = _hybrid(tiny_qwen3)
    try:
        hybrid = engine.bank.hybrid_misses
        hybrid.batch_balance.least_calls = 1
        hybrid.fix_batch_share(0.25)
        assert engine.generate(PROMPTS, max_tokens=16, ignore_eos=True) == want
        assert hybrid.batch_cpu_share == 0.25 and not hybrid.batch_balance.adaptive
        hybrid.sync_maps()
        S = engine.bank.capacity
        for layer, batch_map in hybrid.batch_maps.items():
            assert torch.equal(batch_map.cpu(), batch_split(hybrid.one_token_maps[layer].cpu(), S, 0.25))
        hybrid.fix_batch_share(None)
        assert hybrid.batch_balance.adaptive
        with pytest.raises(InputError, match="0..1"):
            hybrid.fix_batch_share(1.5)
    finally:
        engine.close()


def test_one_miss_is_shared_by_both_sides(tiny_qwen3, resident, monkeypatch):
    """At a share of one half a call with one miss gives the CPU the expert's first half of its
    intermediate rows and the device the rest (the post tells the worker the cut); the tokens stay
    the resident model's, and the device's bytes count only its rows of a shared expert."""
    from moestream.kernels import handoff

    _, want = resident
    cuts = []
    post = handoff.post

    def spy(h, *args, **kwargs):
        post(h, *args, **kwargs)
        cuts.append(int(h.box.post[3]))

    monkeypatch.setattr(handoff, "post", spy)
    engine = _hybrid(tiny_qwen3, cpu_misses=0.5)
    try:
        hybrid = engine.bank.hybrid_misses
        I = engine.bank.store.shape.intermediate
        assert hybrid.quantum and hybrid.split_host[1].tolist()[1] == I // 2     # one miss: half and half
        assert [engine.generate(p, max_tokens=16, ignore_eos=True) for p in PROMPTS] == want
        assert I // 2 in cuts                                               # calls shared an expert
        stats = engine.stats()
        nbytes = engine.bank.formats[0].nbytes(engine.bank.store.shape)
        assert 0 < stats["host_read_bytes"] < stats["host_read"] * nbytes
    finally:
        engine.close()


def test_each_post_names_the_pairs_outside_the_bank_by_the_map_it_was_given(tiny_qwen3, resident, monkeypatch):
    """The worker keeps no view of the bank: a post writes -1 for every pair the map it serves puts
    on the device and the expert id for the others, so the bank can change behind any step. On the
    device: a slot; in a batch's map (no split tables) also an expert the device reads in place (S + e)."""
    from moestream.kernels import handoff

    _, want = resident
    checked = []
    post = handoff.post

    def spy(h, hidden, ids, weights, source_map, num_slots, *args, **kwargs):
        post(h, hidden, ids, weights, source_map, num_slots, *args, **kwargs)
        flat = ids.reshape(-1).tolist()
        src = [int(source_map[e]) if e >= 0 else -1 for e in flat]
        tables = (args[1] if len(args) > 1 else kwargs.get("cpu_take")) is not None
        on_device = [0 <= s < num_slots if tables else s >= 0 for s in src]
        assert h.box.ids[:len(flat)].tolist() == [-1 if d else e for e, d in zip(flat, on_device)]
        checked.append(any(0 <= s < num_slots for s in src) and any(s < 0 or s >= num_slots for s in src))

    monkeypatch.setattr(handoff, "post", spy)
    engine = _hybrid(tiny_qwen3, cpu_misses=0.5)
    try:
        engine.bank.hybrid_misses.refresh_every = 4
        assert [engine.generate(p, max_tokens=16, ignore_eos=True) for p in PROMPTS] == want
        assert any(checked)                                                  # posts with hits and misses both
    finally:
        engine.close()


def test_split_outside_leaves_the_first_misses_to_the_cpu():
    from moestream.kernels.moe_reference import split_outside

    ids = torch.tensor([[0, 9, 1, 8, 7], [9, 9, 0, 1, 2]])           # slots 0..3; 4 and past: outside
    take = torch.tensor([0, 1, 1, 2, 2, 3], dtype=torch.int32)
    assert split_outside(ids, 4, take).tolist() == [[0, -1, 1, -1, 7], [-1, 9, 0, 1, 2]]
    assert torch.equal(split_outside(ids, 4, None), ids)


def test_maps_follow_the_bank_after_a_refresh(tiny_qwen3, resident):
    _, want = resident
    engine = _hybrid(tiny_qwen3, cpu_misses=0.5)
    try:
        engine.bank.hybrid_misses.refresh_every = 4
        assert [engine.generate(p, max_tokens=16, ignore_eos=True) for p in PROMPTS] == want
        assert engine.stats()["evictions"] > 0                              # the bank took missed experts in
        bank = engine.bank
        for layer in bank.slots:
            ls = bank.slots[layer]
            assert all(int(bank.hybrid_misses.one_token_maps[layer][e]) == s for e, s in ls.where.items())
    finally:
        engine.close()


class _InFlight:
    """A copy event that reports landed only at its `polls`-th query (a slow copy stream)."""

    def __init__(self, polls: int):
        self.polls = polls

    def query(self) -> bool:
        self.polls -= 1
        return self.polls <= 0


def test_promotions_land_while_decode_goes_on(tiny_qwen3, resident):
    """A refresh's copies are waited for by nobody: until they land, the victims and the newcomers
    are both misses (maps and worker agree), their slots are named by no map, and the tokens stay
    the resident model's; a prompt through the fetch policy lands every promotion first."""
    from moestream.experts.slots import LANDING

    _, want = resident
    engine = _hybrid(tiny_qwen3, cpu_misses=0.5)
    try:
        bank, hybrid = engine.bank, engine.bank.hybrid_misses
        hybrid.refresh_every = 4
        E, S = engine.config.num_experts, bank.capacity
        copy, sync_maps, fetch = bank.transfers.copy, hybrid.sync_maps, bank.fetcher.forward
        flights, in_flight_steps = [], []

        polls = [3]

        def slow_copy(layer, experts, dests, after=None):
            copied, _ = copy(layer, experts, dests)
            flights.append(_InFlight(polls[0]))
            return copied, flights[-1]

        def checked_sync_maps():
            sync_maps()
            for layer, landing in hybrid.landings.items():
                ls = bank.slots[layer]
                one_map = hybrid.one_token_maps[layer].tolist()
                assert all(ls.owner[s] == LANDING for s in landing.slots)
                assert not set(one_map[:E]) & set(landing.slots) and not set(ls.slot_map.tolist()) & set(landing.slots)
                for e in landing.experts:
                    assert e not in ls.where and one_map[e] == S + e
            in_flight_steps.append(bool(hybrid.landings))

        def prompt_through_fetch(*args):
            assert not hybrid.landings                                       # every promotion landed first
            return fetch(*args)

        bank.transfers.copy, hybrid.sync_maps, bank.fetcher.forward = slow_copy, checked_sync_maps, prompt_through_fetch
        assert [engine.generate(p, max_tokens=16, ignore_eos=True) for p in PROMPTS] == want
        assert flights and sum(in_flight_steps) >= 2                        # steps ran with copies in flight
        assert engine.stats()["evictions"] > 0
        polls[0] = 10**9                                                    # copies that land only when waited for
        layer = next(iter(bank.slots))
        newcomer = next(e for e in range(E) if e not in bank.slots[layer].where)
        hybrid._window[hybrid.layer_index[layer], :, newcomer] = 1000          # used and missed on every token
        hybrid.refresh()
        assert newcomer in hybrid.landings[layer].experts and bank.slots.is_filled()   # in flight: taken, not free
        assert engine.generate(PROMPTS[1], max_tokens=16, ignore_eos=True) == want[1]
        assert newcomer in hybrid.landings[layer].experts                   # it never landed by itself
        long_prompt = list(range(3, 3 + 20))                                # past the mailboxes: the fetch policy
        assert (engine.generate(long_prompt, max_tokens=12, ignore_eos=True)
                == resident[0].generate(long_prompt, max_tokens=12, ignore_eos=True))
        engine.bank.synchronize()
        assert not hybrid.landings and all(LANDING not in bank.slots[layer].owner for layer in bank.slots)
    finally:
        engine.close()


def test_hybrid_policy_takes_a_bank_smaller_than_top_k(tiny_qwen3, resident):
    """One slot per layer: nearly every pair misses, every one is served off the bank, and a prompt
    streams through staging; the fetch policy refuses that capacity."""
    _, want = resident
    engine = _hybrid(tiny_qwen3, capacity=1, cpu_misses=0.5)
    try:
        assert engine.memory_plan.capacity == 1
        assert [engine.generate(p, max_tokens=16, ignore_eos=True) for p in PROMPTS] == want
    finally:
        engine.close()
    with pytest.raises(BudgetError, match="--miss-policy hybrid"):
        moestream.load(tiny_qwen3, device="cpu", dtype="float32", capacity=1, discovery=False)


def test_padding_rows_of_a_captured_batch_get_no_cpu_work(tiny_qwen3):
    """A step replayed through a larger batch's graph pads its rows: the worker computes the live
    rows' misses only, and the live rows' outputs are those of a call without padding."""
    engine = _hybrid(tiny_qwen3, capacity=2, cpu_misses=1.0)
    try:
        bank, config = engine.bank, engine.config
        layer = next(iter(bank.slots))
        g = torch.Generator().manual_seed(3)
        hidden = torch.randn(3, config.hidden_size, generator=g)
        ids = torch.stack([torch.randperm(config.num_experts, generator=g)[:config.top_k] for _ in range(3)])
        weights = torch.rand(3, config.top_k, generator=g).softmax(-1)
        bank.begin_step(True)
        bank.sync_stats()
        full = bank.forward(layer, hidden, ids, weights)
        bank.sync_stats()
        before = bank.stats.layer(layer).cpu_served
        bank.begin_step(True, live_rows=2)
        padded = bank.forward(layer, hidden, ids, weights)
        bank.sync_stats()
        served_live = bank.stats.layer(layer).cpu_served - before
        assert torch.equal(padded[:2], full[:2])
        outside = sum(int(e) not in bank.slots[layer].where for e in ids[:2].reshape(-1))
        assert served_live == outside                                       # row 2's misses: nobody's
    finally:
        engine.close()


def test_a_closed_engine_says_so(tiny_qwen3):
    engine = _hybrid(tiny_qwen3)
    engine.generate(PROMPTS[0], max_tokens=2)
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate(PROMPTS[0], max_tokens=2)


def test_hybrid_policy_refuses_what_it_cannot_serve(tiny_qwen3):
    with pytest.raises(InputError, match="host-tier pinned"):
        moestream.load(tiny_qwen3, device="cpu", dtype="float32", miss_policy="hybrid", capacity=2, discovery=False)
    with pytest.raises(InputError, match="Leave --prefetch out"):
        moestream.load(tiny_qwen3, device="cpu", dtype="float32", miss_policy="hybrid", capacity=2, prefetch=True)


def test_auto_takes_fetch_where_hybrid_cannot_run(tiny_qwen3):
    """On the CPU (no device to read host memory in place) auto is the fetch policy."""
    engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32", capacity=2, host_tier="pinned", discovery=False)
    assert engine.bank.miss_policy == "fetch" and engine.bank.hybrid_misses is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_hybrid_policy_on_the_gpu_gives_the_resident_tokens(tiny_qwen3, share):
    """On CUDA decode steps are whole graphs: the device posts to the worker, reads its share from
    pinned memory in place and waits for the CPU's rows on the device. At two slots most routed
    experts of a step miss; the tokens stay the fully resident GPU engine's (fp32)."""
    resident = moestream.load(tiny_qwen3, device="cuda", dtype="float32")
    want = resident.generate(PROMPTS, max_tokens=16, ignore_eos=True)
    engine = _hybrid(tiny_qwen3, device="cuda", cpu_misses=share)
    try:
        assert [engine.generate(p, max_tokens=16, ignore_eos=True) for p in PROMPTS] == want
        assert engine.generate(PROMPTS, max_tokens=16, ignore_eos=True) == want
        stats = engine.stats()
        assert (stats["host_read"] > 0) == (share < 1.0) and (stats["cpu_served"] > 0) == (share > 0.0)
    finally:
        engine.close()


def test_stats_say_how_the_split_stands(tiny_qwen3, capsys):
    from moestream.cli import main as cli_main

    base = ["run", str(tiny_qwen3), "--device", "cpu", "--dtype", "float32", "--capacity", "2", "--miss-policy",
            "hybrid", "--host-tier", "pinned", "--no-discovery", "--stats", "-p", "5 6 7", "--max-tokens", "4"]
    assert cli_main(base) == 0
    assert "hybrid misses: the CPU takes 60% of a one-token call's misses (moved while decoding" in capsys.readouterr().err
    assert cli_main(base + ["--cpu-misses", "0.5"]) == 0
    err = capsys.readouterr().err
    assert "the CPU takes 50%" in err and "fixed by --cpu-misses" in err and "take[m] = [0, 0, 1]" in err


def test_a_refresh_reads_its_counters_behind_the_step_and_promotes_at_the_next(tiny_qwen3):
    """The refresh's counters are snapshotted without a wait when the window fills; the step after
    folds them and promotes. Statistics read in between still count every pair once."""
    engine = _hybrid(tiny_qwen3, capacity=2, cpu_misses=0.5)
    try:
        bank, config = engine.bank, engine.config
        hybrid = bank.hybrid_misses
        hybrid.refresh_every = 2
        g = torch.Generator().manual_seed(9)
        layers = list(bank.slots)

        def step():
            bank.begin_step(True)
            hidden = torch.randn(1, config.hidden_size, generator=g)
            ids = torch.stack([torch.randperm(config.num_experts, generator=g)[:config.top_k]])
            for layer in layers:
                bank.forward(layer, hidden, ids, torch.rand(1, config.top_k, generator=g).softmax(-1))
            bank.after_step(1)

        step()
        assert hybrid._snapshot is None
        step()                                                              # the window is full: snapshot
        assert hybrid._snapshot is not None and hybrid._snapshot.tokens == 2
        assert not hybrid._window.any()                                     # nothing folded yet
        step()                                                              # folded, then promoted
        assert hybrid._snapshot is None and hybrid._due_tokens == 0
        assert not hybrid._window.any()                                     # the window went to the promotions
        stats = engine.stats()
        assert stats["hits"] + stats["misses"] == 3 * config.top_k * len(layers)   # every pair counted once
    finally:
        engine.close()
