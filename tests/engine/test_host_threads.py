"""A CPU rank of an expert-parallel group on a host with other ranks runs torch on its share of the cores;
an engine on the CPU device runs the C kernel on every core torch computes on."""

from __future__ import annotations

import pytest
import torch

from moestream.engine.build import share_host_threads
from moestream.engine.config import BankConfig, EngineConfig, RuntimeConfig
from moestream.kernels import cpu_moe


@pytest.fixture
def eight_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_moe, "process_cpus", lambda: list(range(8)))
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    return calls


def config(share: tuple[int, int], cpu_threads: int | None = None) -> EngineConfig:
    return EngineConfig("model", runtime=RuntimeConfig(host_share=share), bank=BankConfig(cpu_threads=cpu_threads))


@pytest.mark.parametrize("share, threads", [((0, 2), 4), ((1, 2), 4), ((2, 3), 4), ((0, 3), 2)])
def test_each_cpu_rank_of_a_host_takes_its_share_of_the_cores(eight_cores, share, threads):
    assert share_host_threads(config(share), torch.device("cpu")) == threads
    assert eight_cores == [threads]


def test_a_lone_rank_a_gpu_rank_and_given_thread_counts_are_left_alone(eight_cores, monkeypatch):
    assert share_host_threads(config((0, 1)), torch.device("cpu")) is None
    assert share_host_threads(config((0, 2)), torch.device("cuda", 0)) is None
    assert share_host_threads(config((0, 2), cpu_threads=3), torch.device("cpu")) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert share_host_threads(config((0, 2)), torch.device("cpu")) is None
    assert eight_cores == []


@pytest.mark.skipif(cpu_moe.load() is None, reason=f"no C compiler here: {cpu_moe.unavailable_reason()}")
def test_a_cpu_engines_kernel_team_takes_every_core_torch_computes_on(tiny_quant, monkeypatch):
    """Its quantized experts and linears run on the C kernel, and no thread of a CPU engine drives a GPU, so
    the team is torch's thread count, not the hybrid policy's every core but one."""
    import moestream

    team = cpu_moe._threads
    monkeypatch.setattr(cpu_moe, "_threads", None)
    monkeypatch.setattr(cpu_moe, "_wanted", None)
    monkeypatch.setattr(cpu_moe, "process_cpus", lambda: list(range(6)))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 6)   # a 6-core machine, whatever this one is
    try:
        engine = moestream.load(tiny_quant, device="cpu", dtype="float32", experts="int4", attention="int8")
        engine.generate([3, 4, 5], max_tokens=2, ignore_eos=True)
        assert cpu_moe._threads == 6 != cpu_moe.default_threads(6)
    finally:   # this machine's team again, as the tests before left it
        monkeypatch.undo()
        if team is not None:
            cpu_moe.set_threads(team)
