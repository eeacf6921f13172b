"""Expert parallel over gloo on the CPU: two and three ranks, each holding a share of every layer's
experts, give the single-process engine's logits and greedy tokens (fp32), resident and with a
bounded bank per rank; a rank that dies ends the group with a clear error; bad device lists are
refused before any process starts."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import moestream
from moestream.errors import DistributedError, InputError
from tiny_models import ARCHS

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 0, 0, 0, 0]])
MASK = (IDS != 0).long()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("arch", ARCHS)
def test_two_ranks_equal_one_process(tiny_checkpoints, arch):
    folder = tiny_checkpoints[arch][0]
    single = moestream.load(folder, device="cpu", dtype="float32")
    want_tokens = single.generate(PROMPTS, max_tokens=12, ignore_eos=True)
    want_logits = single.logits(IDS, MASK)
    with moestream.load(folder, devices=["cpu", "cpu"], dtype="float32", rank_timeout_s=60) as engine:
        assert engine.bank.num_experts == (single.config.num_experts + 1) // 2   # rank 0's share
        assert rel(engine.logits(IDS, MASK)[MASK.bool()], want_logits[MASK.bool()]) <= 1e-5
        assert engine.generate(PROMPTS, max_tokens=12, ignore_eos=True) == want_tokens


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


def test_a_rank_that_dies_ends_the_group_with_a_clear_error(tiny_qwen3):
    engine = moestream.load(tiny_qwen3, devices=["cpu", "cpu"], dtype="float32", rank_timeout_s=10)
    try:
        engine.generate(PROMPTS[0], max_tokens=2, ignore_eos=True)
        engine.group.procs[0].kill()
        engine.group.procs[0].wait()
        with pytest.raises(DistributedError, match="stopped answering"):
            engine.generate(PROMPTS[0], max_tokens=4, ignore_eos=True)
    finally:
        engine.close()


@pytest.mark.parametrize("kwargs, match", [
    (dict(devices=["cpu"]), "at least two devices"),
    (dict(devices=["cpu", "cuda:0"]), "all be CUDA devices or all be cpu"),
    (dict(devices=["cuda:0", "cuda:0"]), "same GPU twice"),
    (dict(devices=["cpu", "cpu"], device="cpu"), "either device or devices"),
    (dict(devices=["cpu", "cpu"], prefix_cache_memory="1MiB"), "prefix cache is not supported"),
    (dict(devices=["cpu", "cpu"], miss_policy="skip"), "--miss-policy skip is not supported"),
])
def test_bad_device_lists_are_refused_before_anything_starts(tiny_qwen3, kwargs, match):
    with pytest.raises(InputError, match=match):
        moestream.load(tiny_qwen3, dtype="float32", **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without GPUs")
def test_gpus_that_do_not_exist_are_named(tiny_qwen3):
    with pytest.raises(InputError, match="does not exist"):
        moestream.load(tiny_qwen3, devices=["cuda:0", "cuda:1"])


def test_more_ranks_than_experts_is_refused(tiny_qwen3):
    E = moestream.load(tiny_qwen3, device="cpu").config.num_experts
    with pytest.raises(InputError, match="every rank needs at least one expert"):
        moestream.load(tiny_qwen3, devices=["cpu"] * (E + 1), dtype="float32")


def test_cli_runs_with_two_cpu_ranks(tiny_qwen3):
    r = subprocess.run([sys.executable, "-m", "moestream", "run", str(tiny_qwen3), "--devices", "cpu,cpu",
                        "-p", "5 6 7 8", "--max-tokens", "4"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    single = moestream.load(tiny_qwen3, device="cpu").generate([5, 6, 7, 8], max_tokens=4)
    assert r.stdout.split() == [str(t) for t in single]
    bad = subprocess.run([sys.executable, "-m", "moestream", "run", str(tiny_qwen3), "--devices", "all", "-p", "5"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and bad.stderr.strip().startswith("moestream: error:") and "Traceback" not in bad.stderr


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


def test_two_ranks_placed_by_a_profile_equal_one_process(tiny_qwen3, tmp_path):
    from moestream.warmstart.profile import Profile

    single = moestream.load(tiny_qwen3, device="cpu", dtype="float32")
    want = single.generate(PROMPTS, max_tokens=10, ignore_eos=True)
    config, E = single.config, single.config.num_experts
    moe = [i for i, m in enumerate(config.moe_layers) if m]
    hot = [float((e * 7) % E) for e in range(E)]
    profile = Profile(config.arch, config.num_layers, E, config.top_k, "tiny", 100,
                      {layer: [h / sum(hot) for h in hot] for layer in moe})
    profile.save(tmp_path / "p.json")
    with moestream.load(tiny_qwen3, devices=["cpu", "cpu"], dtype="float32", capacity=config.top_k,
                        profile=str(tmp_path / "p.json"), rank_timeout_s=60) as engine:
        assert engine.generate(PROMPTS, max_tokens=10, ignore_eos=True) == want


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
