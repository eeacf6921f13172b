"""Expert parallel over gloo on the CPU: two and three ranks, each holding a share of every layer's
experts, give the single-process engine's logits and greedy tokens (fp32), resident and with a
bounded bank per rank; a rank that dies ends the group with a clear error; bad device lists are
refused before any process starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import moestream
from moestream.errors import DistributedError, InputError

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 0, 0, 0, 0]])
MASK = (IDS != 0).long()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


# One family per kind of MoE block and of cache a rank holds (each rank runs the whole model but its
# share of every layer's experts): plain softmax top-k (qwen3_moe); a gated shared expert (qwen2_moe);
# sigmoid grouped routing, shared experts, dense first layers and a latent cache (deepseek_v3);
# recurrent layers (qwen3_next); biases, clamped SwiGLU, sinks and sliding windows (gpt_oss); a dense
# MLP beside the experts (gemma4). The other families reuse these blocks.
EP_ARCHS = ["qwen3_moe", "qwen2_moe", "deepseek_v3", "qwen3_next", "gpt_oss", "gemma4"]


def check_two_ranks_equal_one_process(engine, folder) -> None:
    single = moestream.load(folder, device="cpu", dtype="float32")
    want_tokens = single.generate(PROMPTS, max_tokens=12, ignore_eos=True)
    want_logits = single.logits(IDS, MASK)
    assert engine.bank.num_experts == (single.config.num_experts + 1) // 2   # rank 0's share
    assert rel(engine.logits(IDS, MASK)[MASK.bool()], want_logits[MASK.bool()]) <= 1e-5
    assert engine.generate(PROMPTS, max_tokens=12, ignore_eos=True) == want_tokens


@pytest.mark.parametrize("arch", [arch for arch in EP_ARCHS if arch != "qwen3_moe"])   # qwen3_moe: TestOneGroup
def test_two_ranks_equal_one_process(tiny_checkpoints, arch):
    folder = tiny_checkpoints[arch][0]
    with moestream.load(folder, devices=["cpu", "cpu"], dtype="float32", rank_timeout_s=60) as engine:
        check_two_ranks_equal_one_process(engine, folder)


@pytest.fixture(scope="class")
def group(tiny_qwen3):
    """TestOneGroup's resident two-rank group (class scope: closed when a worker leaves the class)."""
    with moestream.load(tiny_qwen3, devices=["cpu", "cpu"], dtype="float32", rank_timeout_s=60) as engine:
        yield engine


class TestOneGroup:
    """Tests of a resident two-rank group of tiny_qwen3 share one: each group costs a follower
    process's start. One expert-parallel engine per process, so the group lives in this class alone
    (a worker closes it before it runs any other test). The benchmark routings come last (pytest runs
    a class's tests in their order): a routing swapped in stays on every rank."""

    def test_two_ranks_equal_one_process(self, group, tiny_qwen3):
        check_two_ranks_equal_one_process(group, tiny_qwen3)

    def test_each_rank_reports_its_all_reduces(self, group):
        """Every rank ran one all-reduce per MoE layer per model call, of the tokens' fp32 partial rows;
        resetting the statistics on rank 0 resets every rank's."""
        group.reset_stats()   # the calls of the class's other tests
        assert all(r["collective"]["calls"] == 0 and r["tokens"] == 0 for r in group.stats()["ranks"])
        group.generate(PROMPTS, max_tokens=5, ignore_eos=True)
        stats = group.stats()
        moe_layers, H = len(stats["layers"]), group.config.hidden_size
        for rank in stats["ranks"]:
            c = rank["collective"]
            assert rank["device"] == "cpu" and c["graph_calls"] == 0 and c["seconds"] > 0
            assert c["calls"] == stats["ranks"][0]["collective"]["calls"] and c["calls"] % moe_layers == 0
            assert c["bytes"] == stats["tokens"] * H * 4 * moe_layers
        assert "collective" not in stats   # the totals add up banks; the all-reduces are per rank
        group.reset_stats()
        assert all(r["collective"]["calls"] == 0 and r["tokens"] == 0 for r in group.stats()["ranks"])

    # A benchmark's routing is swapped in on every rank (the followers take rank 0's draws or replay):
    # two CPU ranks under it give the one-process engine's tokens under the same routing, bit for bit,
    # and a reset starts every rank's draws again. A routing swapped in replaces the one before it.
    @pytest.mark.parametrize("kind", ["uniform", "trace"])
    def test_benchmark_routings_reach_every_rank(self, group, tiny_qwen3, kind):
        from moestream.bench import TraceRouting, UniformRouting, use_routing
        from moestream.warmstart.trace import RoutingTrace

        def routing_for(engine):
            if kind == "uniform":
                routing = UniformRouting(engine.config.top_k, engine.device)
                routing.seed = 1234
                return routing
            E, k = engine.config.num_experts, engine.config.top_k
            ids = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(t))[:k] for t in range(40)])
            trace = RoutingTrace(name="t", num_experts=E, top_k=k, layers=[0], ids=ids[:, None, :].numpy())
            return TraceRouting.for_engine(trace, engine)

        prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
        single, engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32"), group
        use_routing(single, routing_for(single))
        want = single.generate(prompts, max_tokens=8, ignore_eos=True)
        use_routing(engine, routing_for(engine))
        assert engine.generate(prompts, max_tokens=8, ignore_eos=True) == want
        engine.runner.reset_routing()
        single.runner.reset_routing()
        assert engine.generate(prompts, max_tokens=8, ignore_eos=True) == single.generate(prompts, max_tokens=8,
                                                                                          ignore_eos=True)


def test_two_overlapped_ranks_equal_one_process_and_publish_no_tensors(tiny_qwen3):
    """With overlap on, rank 0 publishes and launches each decode step before it reads the last one's
    tokens (the followers get them by a broadcast inside the step), and the tokens stay the one-process
    engine's, greedy and sampled, while sequences end at different lengths and leave the batch. A
    published decode call carries only host values (nothing whose reading would wait for the device)."""
    from moestream.runtime.sampling import SamplingParams

    requests = [(PROMPTS[0], SamplingParams(max_tokens=11, ignore_eos=True)),
                (PROMPTS[1], SamplingParams(max_tokens=5, ignore_eos=True)),
                ([3, 4, 5, 6], SamplingParams(max_tokens=8, temperature=0.9, seed=7, ignore_eos=True))]

    def run_all(engine):
        seqs = [engine.add_request(p, params) for p, params in requests]
        while not engine.scheduler.idle:
            engine.step()
        return [(s.tokens, s.finish_reason) for s in seqs]

    single = moestream.load(tiny_qwen3, device="cpu", dtype="float32")
    want, scores = run_all(single), single.teacher_forced(PROMPTS[1], [9, 4, 7, 2])
    with moestream.load(tiny_qwen3, devices=["cpu", "cpu"], dtype="float32", overlap="on",
                        rank_timeout_s=60) as engine:
        assert engine.overlapping
        # Teacher forcing decodes from positions on the device: the call still carries host values.
        assert torch.allclose(engine.teacher_forced(PROMPTS[1], [9, 4, 7, 2]), scores, atol=1e-5)
        published, publish = [], engine.group.publish

        def recording(op, *args):
            published.append((op, args, engine._inflight is not None))   # a step in flight, unread
            publish(op, *args)
        engine.group.publish = recording
        assert run_all(engine) == want
    decodes = [(args, ahead) for op, args, ahead in published if op == "decode"]
    assert len(decodes) == max(p.max_tokens for _, p in requests) - 1
    for (batch, positions, kv_len), _ in decodes:
        assert type(batch) is int and type(kv_len) is int and all(type(p) is int for p in positions)
        assert len(positions) == batch and kv_len == max(positions) + 1
    # Every step but a batch's first was launched before the step in flight was read.
    batches = [args[0] for args, _ in decodes]
    assert [ahead for _, ahead in decodes] == [i > 0 and batches[i - 1] == b for i, b in enumerate(batches)]
    assert batches == [3] * 4 + [2] * 3 + [1] * 3
    assert not any(isinstance(a, torch.Tensor) for _, args, _ in published for a in args)


def test_three_ranks_with_a_bounded_bank_per_rank_stay_exact(tiny_qwen3):
    single = moestream.load(tiny_qwen3, device="cpu", dtype="float32")
    want = single.generate(PROMPTS, max_tokens=12, ignore_eos=True)
    top_k = single.config.top_k
    with moestream.load(tiny_qwen3, devices=["cpu"] * 3, dtype="float32", capacity=top_k,
                        rank_timeout_s=60) as engine:
        local = engine.bank.num_experts
        assert engine.bank.capacity == min(top_k, local) < single.config.num_experts
        assert engine.generate(PROMPTS, max_tokens=12, ignore_eos=True) == want
        stats = engine.stats()
        assert len(stats["ranks"]) == 3 and stats["misses"] == sum(r["misses"] for r in stats["ranks"]) > 0
        # Every routed pair was looked up by exactly the rank that owns its expert.
        assert stats["hits"] + stats["misses"] == stats["tokens"] * single.config.top_k * len(stats["layers"])
        assert stats["hits"] + stats["misses"] == sum(r["hits"] + r["misses"] for r in stats["ranks"])


def test_hybrid_ranks_compute_their_own_misses_on_their_own_cores(tiny_qwen3):
    """--miss-policy hybrid on every rank: each computes the misses among its own experts from its
    pinned host tier on the CPU, its kernel team on its share of the host's cores, and the tokens
    stay the single process's."""
    from moestream.kernels import cpu_moe

    single = moestream.load(tiny_qwen3, device="cpu", dtype="float32")
    want = single.generate(PROMPTS, max_tokens=12, ignore_eos=True)
    with moestream.load(tiny_qwen3, devices=["cpu", "cpu"], dtype="float32", capacity=1, miss_policy="hybrid",
                        host_tier="pinned", rank_timeout_s=60) as engine:
        assert engine.generate(PROMPTS, max_tokens=12, ignore_eos=True) == want
        ranks = engine.stats()["ranks"]
        assert all(r["cpu_served"] > 0 for r in ranks)
        assert cpu_moe.usable_cpus() == cpu_moe.cpu_share(sorted(os.sched_getaffinity(0)), 0, 2)


@pytest.fixture(scope="class")
def bounded(tiny_qwen3, tmp_path_factory):
    """TestBoundedGroup's one-process engine and two-rank group with a bank of top-k slots per rank,
    its experts placed by a profile (class scope, as `group`)."""
    from moestream.warmstart.profile import Profile

    single = moestream.load(tiny_qwen3, device="cpu", dtype="float32")
    config, E = single.config, single.config.num_experts
    moe = [i for i, m in enumerate(config.moe_layers) if m]
    hot = [float((e * 7) % E) for e in range(E)]
    profile = Profile(config.arch, config.num_layers, E, config.top_k, "tiny", 100,
                      {layer: [h / sum(hot) for h in hot] for layer in moe})
    path = tmp_path_factory.mktemp("profile") / "p.json"
    profile.save(path)
    with moestream.load(tiny_qwen3, devices=["cpu", "cpu"], dtype="float32", capacity=config.top_k,
                        profile=str(path), rank_timeout_s=60) as engine:
        yield single, engine


class TestBoundedGroup:
    """Two ranks, each with a bank of top-k slots, their experts placed by a profile's balanced split
    rather than round-robin. Both tests read the same group: each group costs a follower process's start."""

    def test_two_ranks_placed_by_a_profile_equal_one_process(self, bounded):
        single, engine = bounded
        want = single.generate(PROMPTS, max_tokens=10, ignore_eos=True)
        assert engine.generate(PROMPTS, max_tokens=10, ignore_eos=True) == want

    def test_bounded_ranks_decode_in_segments_that_fetch_only_their_own_experts(self, bounded):
        """One sequence: decode runs as segments split at each router (eager on the CPU; captured over
        NCCL), each rank making resident only the routed experts it holds, as its bank numbers them;
        the tokens stay the one-process engine's."""
        from moestream.runtime.cuda_graphs import SegmentedDecode

        single, engine = bounded
        want = single.generate(PROMPTS[0], max_tokens=12, ignore_eos=True)
        top_k, layers = single.config.top_k, sum(single.config.moe_layers)
        engine.reset_stats()   # the class's other calls
        assert engine.generate(PROMPTS[0], max_tokens=12, ignore_eos=True) == want
        assert isinstance(engine.runner._graphs.get(1), SegmentedDecode)
        stats = engine.stats()
        assert all(r["misses"] > 0 for r in stats["ranks"])
        assert stats["hits"] + stats["misses"] == stats["tokens"] * top_k * layers   # each pair by its owner once


def test_a_rank_that_dies_ends_the_group_with_a_clear_error(tiny_qwen3):
    engine = moestream.load(tiny_qwen3, devices=["cpu", "cpu"], dtype="float32", rank_timeout_s=10)
    try:
        engine.generate(PROMPTS[0], max_tokens=2, ignore_eos=True)
        engine.group.procs[0].kill()
        engine.group.procs[0].wait()
        # named before any collective waits on it (an NCCL collective would wait for the watchdog)
        with pytest.raises(DistributedError, match=r"stopped answering \(rank 1 exited with code -9\)"):
            engine.generate(PROMPTS[0], max_tokens=4, ignore_eos=True)
    finally:
        engine.close()


def test_a_follower_that_fails_a_call_is_named_with_its_error(tiny_qwen3):
    """A follower that fails where rank 0 did not (its device out of memory, say) ends, and rank 0's
    error says which rank and why."""
    engine = moestream.load(tiny_qwen3, devices=["cpu", "cpu"], dtype="float32", rank_timeout_s=10)
    try:
        engine.group.publish("no_such_call")
        engine.group.procs[0].wait(30)
        with pytest.raises(DistributedError, match=r"rank 1 exited with code 1: AttributeError: .*no_such_call"):
            engine.generate(PROMPTS[0], max_tokens=2, ignore_eos=True)
    finally:
        engine.close()


def test_a_follower_whose_rank_0_is_killed_exits(tiny_qwen3, tmp_path):
    """Followers end with rank 0, however it ends (a killed rank 0 runs no clean-up): no orphan
    process holds a device or its memory."""
    script = tmp_path / "rank0.py"
    script.write_text(
        "import sys, time, moestream\n"
        f"engine = moestream.load({str(tiny_qwen3)!r}, devices=['cpu', 'cpu'], dtype='float32', rank_timeout_s=60)\n"
        "engine.generate([5, 6, 7], max_tokens=2, ignore_eos=True)\n"
        "print(engine.group.procs[0].pid, flush=True)\n"
        "time.sleep(600)\n")
    rank0 = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        follower = int(rank0.stdout.readline())
        os.kill(rank0.pid, signal.SIGKILL)
        rank0.wait()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and _alive(follower):
            time.sleep(0.1)
        assert not _alive(follower)
    finally:
        rank0.kill()


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not reaped by its gone parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("kwargs, match", [
    (dict(devices=["cpu"]), "at least two devices"),
    (dict(devices=["cpu", "cuda:0"]), "all be CUDA devices or all be cpu"),
    (dict(devices=["cuda:0", "cuda:0"]), "same GPU twice"),
    (dict(devices=["cpu", "cpu"], device="cpu"), "either device or devices"),
    (dict(devices=["cpu", "cpu"], prefix_cache_memory="1MiB"), "prefix cache is not supported"),
    (dict(devices=["cpu", "cpu"], miss_policy="skip"), "--miss-policy skip is not supported"),
    (dict(devices=["cpu", "cpu"], dist_backend="nccl"), "nccl needs CUDA devices"),
    (dict(devices=["cpu", "cpu"], dist_backend="mpi"), "dist_backend 'mpi' is unknown"),
])
def test_bad_device_lists_are_refused_before_anything_starts(tiny_qwen3, kwargs, match):
    with pytest.raises(InputError, match=match):
        moestream.load(tiny_qwen3, dtype="float32", **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without GPUs")
def test_gpus_that_do_not_exist_are_named(tiny_qwen3):
    with pytest.raises(InputError, match="does not exist"):
        moestream.load(tiny_qwen3, devices=["cuda:0", "cuda:1"])
    with pytest.raises(InputError, match="does not exist"):   # gloo lets ranks share a GPU; it must still exist
        moestream.load(tiny_qwen3, devices=["cuda:0", "cuda:0"], dist_backend="gloo")


def test_more_ranks_than_experts_is_refused(tiny_qwen3):
    E = moestream.load(tiny_qwen3, device="cpu").config.num_experts
    with pytest.raises(InputError, match="every rank needs at least one expert"):
        moestream.load(tiny_qwen3, devices=["cpu"] * (E + 1), dtype="float32")


def test_cli_runs_with_two_cpu_ranks(tiny_qwen3, capsys):
    from moestream.cli import main

    r = subprocess.run([sys.executable, "-m", "moestream", "run", str(tiny_qwen3), "--devices", "cpu,cpu",
                        "-p", "5 6 7 8", "--max-tokens", "4", "--stats"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    single = moestream.load(tiny_qwen3, device="cpu").generate([5, 6, 7, 8], max_tokens=4)
    assert r.stdout.split() == [str(t) for t in single]
    ranks = [line.split() for line in r.stderr.splitlines() if line.split()[:1] in (["0"], ["1"]) and "cpu" in line]
    assert len(ranks) == 2 and "all-reduces" in r.stderr   # --stats: a line per rank, its all-reduces counted
    assert ranks[0][6] == ranks[1][6] != "0"
    # main() in this process: a failure other than ours would escape it as an exception (a traceback)
    assert main(["run", str(tiny_qwen3), "--devices", "all", "-p", "5"]) == 1
    err = capsys.readouterr().err
    assert err.strip().startswith("moestream: error:") and "Traceback" not in err


def test_check_prints_one_plan_per_rank(tiny_qwen3, capsys):
    from moestream.cli import main

    assert main(["check", str(tiny_qwen3), "--devices", "cpu,cpu,cpu", "--capacity", "2"]) == 0
    out = capsys.readouterr().out
    E = moestream.load(tiny_qwen3, device="cpu").config.num_experts
    shares = [len(range(r, E, 3)) for r in range(3)]
    for rank, share in enumerate(shares):
        assert f"rank {rank}            cpu: {share} of the {E} experts of every layer" in out
    assert out.count("capacity          2/") == 3


def test_a_profile_spreads_hot_experts_over_the_ranks():
    from moestream.experts.sharded import Placement, balanced_owners

    freq = [0.0, 9.0, 0.0, 8.0, 0.0, 7.0, 0.0, 6.0]            # round-robin would give rank 1 every hot expert
    owners = balanced_owners(freq, 2)
    assert sorted(owners[0] + owners[1]) == list(range(8)) and len(owners[0]) == len(owners[1]) == 4
    loads = [sum(freq[e] for e in o) for o in owners]
    assert max(loads) - min(loads) <= 1.0
    p = Placement.balanced(1, 2, 8, {3: freq})
    assert p.experts(3) == owners[1] and p.experts(0) == [1, 3, 5, 7]   # layers without a profile: round-robin
    table = p.to_local(3, torch.device("cpu"))
    assert [int(table[e]) for e in owners[1]] == [0, 1, 2, 3] and int(table[owners[0][0]]) == -1
    assert p.local_pins({3: [owners[1][2], owners[0][0]]}) == {3: [2]}


def test_torchrun_launches_the_same_engine(tiny_qwen3):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                        str(port), "-m", "moestream", "run", str(tiny_qwen3), "--device", "cpu", "-p", "5 6 7 8",
                        "--max-tokens", "5"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    want = moestream.load(tiny_qwen3, device="cpu").generate([5, 6, 7, 8], max_tokens=5)
    assert r.stdout.split() == [str(t) for t in want]          # printed once, by rank 0


def test_the_checkpoint_digest_tells_different_checkpoints_apart(tiny_checkpoints):
    from moestream.runtime.distributed import checkpoint_digest

    a, b = tiny_checkpoints["qwen3_moe"][0], tiny_checkpoints["mixtral"][0]
    assert checkpoint_digest(a) == checkpoint_digest(a) != checkpoint_digest(b)


def test_collective_stats_count_and_time_each_reduce_on_the_host():
    from moestream.experts.collective import CollectiveStats

    stats = CollectiveStats(torch.device("cpu"), events=False)
    seen = []
    stats.run(3, seen.append, torch.ones(5, 16))
    stats.run(4, seen.append, torch.ones(2, 16, dtype=torch.float16))
    assert len(seen) == 2
    figures = stats.as_dict()
    assert figures["calls"] == 2 and figures["bytes"] == 5 * 16 * 4 + 2 * 16 * 2 and figures["seconds"] >= 0
    stats.reset()
    assert stats.as_dict() == {"calls": 0, "bytes": 0, "seconds": 0.0, "graph_calls": 0}


def test_metrics_show_each_ranks_bank_and_all_reduces():
    from moestream.serve.metrics import ServerMetrics

    rank = {"hit_rate": 0.5, "bytes_copied": 100, "device": "cuda:1",
            "collective": {"calls": 48, "bytes": 4096, "seconds": 0.25, "graph_calls": 0}}

    class Engine:
        def prefix_cache_stats(self):
            return None

        def stats(self):
            return {"hit_rate": 0.5, "bytes_copied": 200, "ranks": [dict(rank, device="cuda:0"), rank]}

    text = ServerMetrics(Engine()).render().decode()
    assert 'moestream_rank_allreduce_seconds{device="cuda:1",rank="1"} 0.25' in text
    assert 'moestream_rank_allreduce_calls{device="cuda:0",rank="0"} 48.0' in text
    assert 'moestream_rank_bank_hit_rate{device="cuda:1",rank="1"} 0.5' in text


def test_unequal_counts_place_every_expert_once():
    from moestream.experts.sharded import Placement, expert_counts, interleaved_owners

    for E, world in [(8, 2), (9, 3), (128, 4), (5, 2)]:
        equal = expert_counts(E, [1.0] * world)
        assert interleaved_owners(E, equal) == [list(range(r, E, world)) for r in range(world)]   # round-robin
    counts = expert_counts(128, [3.0, 1.0])
    assert counts == (96, 32)
    assert expert_counts(8, [5.0, 0.0]) == (7, 1)   # every rank holds at least one
    placements = [Placement(r, 2, 128, counts=counts) for r in range(2)]
    held = [p.experts(0) for p in placements]
    assert sorted(held[0] + held[1]) == list(range(128)) and [len(h) for h in held] == [96, 32]
    table = placements[1].to_local(0, torch.device("cpu"))
    assert [int(table[e]) for e in held[1]] == list(range(32)) and int(table[held[0][0]]) == -1
    balanced = [Placement.balanced(r, 2, 128, {0: [float(e % 7) for e in range(128)]}, counts) for r in range(2)]
    assert [b.count for b in balanced] == [96, 32] and sorted(balanced[0].experts(0) + balanced[1].experts(0)) == list(range(128))


def test_each_rank_budgets_its_own_devices_free_memory(tiny_qwen3):
    from moestream.engine import BankConfig, EngineConfig, RuntimeConfig
    from moestream.engine.ranks import rank_budget
    from moestream.runtime.distributed import rank_config

    def config(**bank):
        return EngineConfig(tiny_qwen3, RuntimeConfig(devices=["cpu"] * 3), BankConfig(**bank)).validate()

    free = {"cpu": 3 * 2**30}
    measured = [rank_budget(rank_config(config(), r), lambda d: free[d.type]) for r in range(3)]
    assert measured == [2**30] * 3                       # three ranks on one device split its free memory
    assert rank_budget(rank_config(config(gpu_memory="2GiB"), 1), lambda d: 1) == 2 * 2**30   # per device, as given
    assert rank_budget(rank_config(config(capacity=2), 1), lambda d: 1) is None


def test_heterogeneous_budgets_give_banks_in_proportion(tiny_qwen3):
    """A rank with five times the bank room owns (about) five times the experts, so both keep the
    same share of theirs resident; `check` prints each rank's plan."""
    from moestream.engine import EngineConfig, RuntimeConfig
    from moestream.engine.ranks import explain_ranks, plan_ranks

    cfg = EngineConfig(tiny_qwen3, RuntimeConfig(devices=["cpu", "cpu"])).validate()
    base = plan_ranks(cfg, budgets=[None, None])[0].plan.memory   # unbounded: equal shares, fully resident
    E = 2 * base.num_experts
    expert = sum(base.layer_slot_bytes)
    plans = plan_ranks(cfg, budgets=[base.fixed_bytes + 100 * expert, base.fixed_bytes + 20 * expert])
    assert [r.placement.count for r in plans] == [6, 2] and sum(r.placement.count for r in plans) == E
    assert [r.plan.memory.capacity for r in plans] == [6, 2]   # both hold all of theirs
    assert all(r.plan.memory.total_bytes <= r.budget for r in plans)
    text = explain_ranks(plans)
    assert f"rank 0            cpu: 6 of the {E} experts" in text and f"rank 1            cpu: 2 of the {E} experts" in text
    equal = plan_ranks(cfg, budgets=[base.fixed_bytes + 20 * expert] * 2)
    assert [r.placement.count for r in equal] == [E // 2, E // 2]
