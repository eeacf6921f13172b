"""The hybrid miss policy: every decode call's misses served at once by a CPU worker thread (from
host RAM) and by the device reading host memory in place, with no host work inside the step. On
this CPU-only machine "device" and "CPU" are both the CPU, but every step goes through the split
and the worker's mailboxes; the tokens stay those of the fully resident model (fp32)."""

import pytest
import torch

import moestream
from moestream.errors import InputError

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
        # One-stream steps split the misses as asked; batched steps leave them all to the CPU.
        assert stats["cpu_served"] > 0
        assert (stats["host_read"] > 0) == (share < 1.0)
        assert stats["cpu_served"] + stats["host_read"] == stats["misses"] - _prompt_misses(engine)
        assert stats["cpu_bytes"] > 0 and (stats["host_read_bytes"] > 0) == (share < 1.0)
    finally:
        engine.bank.close()


def _prompt_misses(engine) -> int:
    """Prompts longer than the mailboxes go through the fetch policy (none here: every call fits)."""
    return 0


def test_the_worker_computes_only_its_share(tiny_qwen3):
    engine = _hybrid(tiny_qwen3, cpu_misses=0.5)
    try:
        engine.generate(PROMPTS[0], max_tokens=2)                           # the maps follow the filled bank
        hybrid = engine.bank.hybrid_misses
        E = engine.config.num_experts
        for layer, box in hybrid.mailboxes.items():
            ls = engine.bank.slots[layer]
            one_map = hybrid.one_token_maps[layer]
            outside = [e for e in range(E) if e not in ls.where]
            on_cpu = [e for e in outside if box.serve_one[e]]
            read = [e for e in outside if int(one_map[e]) >= engine.bank.capacity]
            assert sorted(on_cpu + read) == outside and not set(on_cpu) & set(read)
            assert abs(len(on_cpu) - len(outside) / 2) <= 1                # the share, interleaved
            assert all(int(one_map[e]) == engine.bank.capacity + e for e in read)
            assert [int(box.serve_many[e]) for e in range(E)] == [int(e not in ls.where) for e in range(E)]
    finally:
        engine.bank.close()


def test_maps_follow_the_bank_after_a_refresh(tiny_qwen3, resident):
    _, want = resident
    engine = _hybrid(tiny_qwen3, cpu_misses=0.5)
    try:
        engine.bank.hybrid_misses.refresh_every = 4
        assert [engine.generate(p, max_tokens=16, ignore_eos=True) for p in PROMPTS] == want
        bank = engine.bank
        for layer in bank.slots:
            ls, box = bank.slots[layer], bank.hybrid_misses.mailboxes[layer]
            assert all(int(box.serve_many[e]) == 0 for e in ls.where)        # the worker never takes a resident one
            assert all(int(bank.hybrid_misses.one_token_maps[layer][e]) == s for e, s in ls.where.items())
    finally:
        engine.bank.close()


def test_hybrid_policy_refuses_what_it_cannot_serve(tiny_qwen3):
    with pytest.raises(InputError, match="host-tier pinned"):
        moestream.load(tiny_qwen3, device="cpu", dtype="float32", miss_policy="hybrid", capacity=2, discovery=False)


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
        assert (stats["host_read"] > 0) == (share < 1.0) and stats["cpu_served"] > 0
    finally:
        engine.bank.close()
