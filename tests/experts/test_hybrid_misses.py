"""Hybrid misses: a share of a decode step's missing experts is computed on the CPU from host RAM
while the others are copied, and the tokens stay those of the fully resident model (fp32). On this
CPU-only machine "device" and "CPU" are both the CPU, but every step goes through the split: the
CPU's rows are computed from the host tier and added to the bank's, decode through the segmented
path and short prompts through the fetcher. A streamed prompt's misses shared with the CPU
(`prompt_cpu_misses`, either policy) are computed in a thread of their own while the rest stream
through the staging buffers."""

import pytest

import moestream
from moestream.errors import InputError

PROMPTS = [[5, 6, 7, 8, 9], [12, 13, 14, 15, 16, 17, 18]]


@pytest.fixture(scope="module")
def resident(tiny_qwen3):
    engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32")
    return engine, engine.generate(PROMPTS, max_tokens=16, ignore_eos=True)


@pytest.mark.parametrize("share", [0.5, 1.0])
def test_hybrid_misses_give_the_resident_tokens(tiny_qwen3, resident, share):
    engine, want = resident
    k = engine.config.top_k
    hybrid = moestream.load(tiny_qwen3, device="cpu", dtype="float32", capacity=k, host_tier="pinned",
                            cpu_misses=share, discovery=False)
    assert hybrid.bank.hybrid
    assert hybrid.generate(PROMPTS, max_tokens=16, ignore_eos=True) == want          # batched decode
    assert [hybrid.generate(p, max_tokens=16, ignore_eos=True) for p in PROMPTS] == want   # alone
    stats = hybrid.stats()
    assert stats["cpu_served"] > 0 and stats["misses"] >= stats["cpu_served"]


def test_without_hybrid_nothing_is_served_on_the_cpu(tiny_qwen3, resident):
    engine, want = resident
    plain = moestream.load(tiny_qwen3, device="cpu", dtype="float32", capacity=engine.config.top_k,
                           host_tier="pinned", discovery=False)
    assert not plain.bank.hybrid
    assert plain.generate(PROMPTS, max_tokens=16, ignore_eos=True) == want
    assert plain.stats()["cpu_served"] == 0 and plain.stats()["misses"] > 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(cpu_misses=1.5), "from 0 to 1"),
    (dict(cpu_misses=0.5, miss_policy="skip"), "needs --miss-policy fetch"),
    (dict(cpu_misses=0.5, capacity=2), "host RAM"),                     # the disk tier holds nothing in RAM
    (dict(cpu_threads=2, miss_policy="fetch"), "give --cpu-misses or --miss-policy hybrid too"),
    (dict(cpu_misses=0.5, cpu_threads=0), "at least 1"),
])
def test_bad_hybrid_settings_are_refused(tiny_qwen3, kwargs, match):
    with pytest.raises(InputError, match=match):
        moestream.load(tiny_qwen3, device="cpu", dtype="float32", **kwargs)


def test_measured_costs_split_the_misses_where_the_predicted_time_is_least():
    from moestream.experts.fetch import MissCosts

    costs = MissCosts(copy_s=1.0, cpu_expert_s=0.4, cpu_token_s=0.2, cpu_call_s=0.1)
    tokens = {10: 1, 11: 1, 12: 3, 13: 1, 14: 2}
    # Fewest tokens first (10, 11, 13: 0.4 s each on the CPU; 14: 0.6; 12: 0.8): giving the CPU four
    # takes max(0.1 + 1.8, 1 copy) = 1.9 s, the least (three: max(1.3, 2.0); all five: 2.7).
    order = sorted(tokens, key=lambda e: (tokens[e], e))
    assert costs.split(order, tokens) == [10, 11, 13, 14]
    assert costs.cpu_s(3) == pytest.approx(0.8)   # the weights once, two more tokens
    slow = MissCosts(copy_s=1.0, cpu_expert_s=5.0, cpu_token_s=0.0, cpu_call_s=0.0)
    assert slow.split([1, 2], {1: 1, 2: 1}) == []   # slow CPU: copy all
    free = MissCosts(copy_s=1.0, cpu_expert_s=0.0, cpu_token_s=0.0, cpu_call_s=0.0)
    assert free.split([3, 1, 2], {1: 1, 2: 1, 3: 1}) == [3, 1, 2]   # free CPU: all, in the order given
    # Paths that slow each other down when run together: all on the faster one rather than a split.
    even = dict(copy_s=1.0, cpu_expert_s=0.9, cpu_token_s=0.0, cpu_call_s=0.0)
    six = {e: 1 for e in range(6)}
    assert len(MissCosts(**even).split(list(six), six)) == 3
    assert len(MissCosts(**even, contention=2.0).split(list(six), six)) == 6


def test_a_prompts_experts_cost_the_cpu_more_past_the_kernels_tile():
    """Up to four tokens share one pass over an expert's rows; more cost `cpu_wide_token_s` each, so
    the split of a prompt's misses gives the CPU only the experts few of its tokens routed to."""
    from moestream.experts.fetch import MissCosts

    costs = MissCosts(copy_s=1.0, cpu_expert_s=0.4, cpu_token_s=0.01, cpu_call_s=0.0, cpu_wide_token_s=0.05)
    assert costs.cpu_s(4) == pytest.approx(0.43) and costs.cpu_s(20) == pytest.approx(0.43 + 16 * 0.05)
    tokens = {1: 2, 2: 30, 3: 30, 4: 3}
    # the two light experts on the CPU (0.41 + 0.42 against 2 copies), the heavy ones (1.76 s each) copied
    assert costs.split(sorted(tokens, key=tokens.get), tokens) == [1, 4]
    flat = MissCosts(copy_s=1.0, cpu_expert_s=0.4, cpu_token_s=0.01, cpu_call_s=0.0)
    assert flat.cpu_s(20) == pytest.approx(0.4 + 19 * 0.01)   # no wide figure: one rate throughout


def test_auto_split_gives_the_resident_tokens(tiny_qwen3, resident):
    engine, want = resident
    auto = moestream.load(tiny_qwen3, device="cpu", dtype="float32", capacity=engine.config.top_k,
                          host_tier="pinned", cpu_misses="auto", discovery=False)
    assert auto.bank.fetcher.costs is None   # measured when the first decode step needs them
    assert auto.generate(PROMPTS, max_tokens=16, ignore_eos=True) == want
    costs = auto.bank.fetcher.costs
    assert costs is not None and costs.copy_s > 0 and costs.cpu_expert_s > 0


def test_the_cpu_cost_follows_the_calls_it_serves(tiny_qwen3):
    from moestream.experts.fetch import MissCosts

    fetcher = moestream.load(tiny_qwen3, device="cpu", dtype="float32", capacity=2, host_tier="pinned",
                             cpu_misses="auto", discovery=False).bank.fetcher
    fetcher.costs = MissCosts(copy_s=1.0, cpu_expert_s=1.0, cpu_token_s=0.1, cpu_call_s=0.0)
    for _ in range(50):   # the CPU turned out 10x faster than measured: 2 experts, 3 pairs, 0.3 s
        fetcher._observe_cpu(experts=2, pairs=3, seconds=0.3)
    assert fetcher.costs.cpu_expert_s == pytest.approx(0.1, rel=0.01)
    assert fetcher.costs.copy_s == 1.0


def test_the_cli_flag_takes_a_share_or_auto(tiny_qwen3):
    from moestream.cli import main

    assert main(["run", str(tiny_qwen3), "--device", "cpu", "--capacity", "2", "--host-tier", "pinned",
                 "--cpu-misses", "auto", "-p", "5 6 7", "--max-tokens", "3"]) == 0
    with pytest.raises(SystemExit) as bad:
        main(["run", str(tiny_qwen3), "--cpu-misses", "2", "-p", "5"])
    assert bad.value.code == 1


def test_cpu_threads_set_the_threads_the_cpu_misses_run_on(tiny_qwen3, resident):
    import torch

    engine, want = resident
    before = torch.get_num_threads()
    try:
        hybrid = moestream.load(tiny_qwen3, device="cpu", dtype="float32", capacity=engine.config.top_k,
                                host_tier="pinned", cpu_misses=1.0, cpu_threads=1, discovery=False)
        assert torch.get_num_threads() == 1
        assert hybrid.generate(PROMPTS, max_tokens=16, ignore_eos=True) == want
        assert hybrid.stats()["cpu_served"] > 0
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("share", [1.0, 0.5])
def test_hybrid_misses_on_the_gpu_give_the_resident_tokens(tiny_qwen3, share):
    """On CUDA the CPU's rows come from the C kernel over the pinned tier and join the decode graph
    segments; at the smallest bank (top-k slots) with every miss on the CPU, most routed experts of a
    step miss, and the tokens stay the fully resident GPU engine's (fp32)."""
    resident = moestream.load(tiny_qwen3, device="cuda", dtype="float32")
    want = resident.generate(PROMPTS, max_tokens=16, ignore_eos=True)
    k = resident.config.top_k
    hybrid = moestream.load(tiny_qwen3, device="cuda", dtype="float32", capacity=k, host_tier="pinned",
                            cpu_misses=share, discovery=False, miss_policy="fetch")
    assert hybrid.generate(PROMPTS, max_tokens=16, ignore_eos=True) == want
    assert [hybrid.generate(p, max_tokens=16, ignore_eos=True) for p in PROMPTS] == want
    stats = hybrid.stats()
    assert stats["cpu_served"] > 0 and stats["cpu_bytes"] > 0


def test_stats_print_the_split_costs_and_check_the_cpu_path(tiny_qwen3, capsys):
    from moestream.cli import main

    assert main(["run", str(tiny_qwen3), "--device", "cpu", "--capacity", "2", "--host-tier", "pinned",
                 "--cpu-misses", "auto", "--stats", "-p", "5 6 7", "--max-tokens", "4"]) == 0
    err = capsys.readouterr().err
    assert "hybrid misses split by: copy" in err and "contention" in err
    assert main(["check", str(tiny_qwen3), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "CPU experts" in out and "miss costs" not in out


@pytest.mark.parametrize("experts,name", [(None, "fp32"), ("int4", "int4-g64")])
def test_check_measures_the_miss_costs(tiny_qwen3, capsys, experts, name):
    """`check --measure-costs` times the split's inputs on random experts of the model's shape and
    format, without reading the checkpoint's weights."""
    from moestream.cli import main

    quant = ["--experts", experts] if experts else []
    assert main(["check", str(tiny_qwen3), "--device", "cpu", *quant, "--measure-costs"]) == 0
    out = capsys.readouterr().out
    assert f"miss costs        one {name} expert" in out
    assert "on the CPU" in out and "per further token" in out and "CPU call" in out


# ---- a streamed prompt's misses shared with the CPU ----

def _load_pinned(folder, capacity, **kw):
    return moestream.load(folder, device="cpu", dtype="float32", capacity=capacity, host_tier="pinned",
                          discovery=False, **kw)


@pytest.mark.parametrize("policy", ["fetch", "hybrid"])
@pytest.mark.parametrize("share", [0.5, 1.0, "auto"])
def test_a_prompts_misses_computed_on_the_cpu_give_the_resident_tokens(tiny_qwen3, resident, policy, share):
    engine, want = resident
    shared = _load_pinned(tiny_qwen3, engine.config.top_k, miss_policy=policy, prompt_cpu_misses=share)
    try:
        shared.generate(PROMPTS[1], max_tokens=1, ignore_eos=True)   # the prompt only: streamed (7 tokens > slots)
        first = shared.stats()
        if share != "auto":   # auto may find copying cheaper on this machine
            assert first["cpu_served"] > 0 and first["cpu_bytes"] > 0
        assert first["misses"] >= first["cpu_served"]
        assert [shared.generate(p, max_tokens=16, ignore_eos=True) for p in PROMPTS] == want
        assert shared.generate(PROMPTS, max_tokens=16, ignore_eos=True) == want
    finally:
        shared.close()


def test_without_it_a_prompt_streams_every_miss(tiny_qwen3, resident):
    engine, want = resident
    plain = _load_pinned(tiny_qwen3, engine.config.top_k, miss_policy="fetch")
    try:
        plain.generate(PROMPTS[1], max_tokens=1, ignore_eos=True)
        assert plain.stats()["cpu_served"] == 0 and plain.stats()["misses"] > 0
        assert not plain.bank.hybrid   # decode misses are copied: the prompts' share is theirs alone
    finally:
        plain.close()


@pytest.mark.parametrize("kw, words", [
    ({"prompt_cpu_misses": 1.5}, "from 0 to 1"),
    ({"prompt_cpu_misses": "half"}, "'auto'"),
    ({"prompt_cpu_misses": 0.5, "miss_policy": "skip"}, "fetch or hybrid"),
    ({"prompt_cpu_misses": 0.5, "miss_policy": "fetch", "host_tier": "disk"}, "--host-tier pinned"),
])
def test_bad_prompt_cpu_misses_are_refused_in_one_sentence(tiny_qwen3, kw, words):
    kw = {"host_tier": "pinned", **kw}
    with pytest.raises(InputError, match=words):
        moestream.load(tiny_qwen3, device="cpu", dtype="float32", capacity=2, discovery=False, **kw)
