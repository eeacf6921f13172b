"""Long prompts at a bounded bank stream their missing experts through two staging buffers: the next
layer's first groups are copied before its routing is known, and a run of consecutive experts is one
copy per tensor. On the CPU every copy is a plain read, but the same groups, stage maps and buffers
are used; the tokens stay those of the fully resident model (fp32)."""

import numpy as np
import pytest
import torch

import moestream
from moestream.engine import plan
from moestream.experts import fetch
from moestream.experts.fetch import Fetcher
from moestream.experts.host_tier import DiskHostTier, consecutive_runs

PROMPTS = [torch.randint(2, 160, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (13, 29)]


@pytest.fixture(scope="module")
def reference_tokens(tiny_qwen3):
    full = moestream.load(tiny_qwen3, device="cpu", dtype="float32")
    return [full.generate(p, max_tokens=8, ignore_eos=True) for p in PROMPTS]


@pytest.fixture
def small_staging(monkeypatch):
    """Two slots per staging buffer: a layer's missing experts take several groups, so two are copied ahead."""
    monkeypatch.setattr(plan, "staging_slots_for", lambda capacity, num_experts, top_k: 4)


def _spy_ahead(monkeypatch) -> list[int]:
    """Groups copied ahead that a staged layer used, one entry per such layer."""
    used: list[int] = []
    staged = Fetcher._staged

    def spy(self, *args):
        ahead = args[-1]   # `_staged`'s last argument: this layer's groups copied ahead, or None
        if ahead is not None:
            used.append(len(ahead.groups))
        return staged(self, *args)

    monkeypatch.setattr(Fetcher, "_staged", spy)
    return used


@pytest.mark.parametrize("share", [0.0, 0.9])   # 0: copy ahead after every staged layer, routed or not
@pytest.mark.parametrize("ahead", [True, False])
def test_prompts_copied_ahead_give_the_resident_tokens(tiny_qwen3, reference_tokens, small_staging, monkeypatch,
                                                       share, ahead):
    monkeypatch.setattr(fetch, "AHEAD_ROUTED_SHARE", share)
    used = _spy_ahead(monkeypatch)
    engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32", capacity=2, discovery=False)
    with fetch.copy_ahead.set(ahead):
        assert [engine.generate(p, max_tokens=8, ignore_eos=True) for p in PROMPTS] == reference_tokens
    if ahead and share == 0.0:
        assert used and max(used) == 2   # the layer after a staged one started from two groups copied ahead
    if not ahead:
        assert not used
    stats = engine.stats()
    assert stats["hits"] + stats["misses"] == stats["tokens"] * engine.config.top_k * sum(engine.config.moe_layers)


def test_copies_of_consecutive_experts_give_the_same_tokens(tiny_qwen3, reference_tokens, small_staging):
    engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32", capacity=2, host_tier="pinned",
                            discovery=False)
    for runs in (True, False):
        with fetch.staged_copy_runs.set(runs):
            assert [engine.generate(p, max_tokens=8, ignore_eos=True) for p in PROMPTS] == reference_tokens


def test_an_expert_copied_ahead_and_then_put_in_the_bank_is_computed_once(tiny_qwen3):
    """Only routed experts the bank still lacks map to a staging slot: one installed after it was copied
    ahead is computed from the bank alone, as every pair is computed by exactly one call."""
    full = moestream.load(tiny_qwen3, device="cpu", dtype="float32")
    engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32", capacity=2, discovery=False)
    fetcher, config = engine.bank.fetcher, engine.config
    layer = sorted(engine.bank.slots)[1]
    T, E, k = 12, config.num_experts, config.top_k
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(T, config.hidden_size, generator=g)
    expert_ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    expert_ids[:E // k] = torch.arange(E, dtype=torch.int32).reshape(-1, k)   # every expert routed
    weights = torch.rand(T, k, generator=g)
    fetcher._ahead = fetcher._copy_ahead(layer, 2)
    copied = fetcher._ahead.groups[0][0]
    fetcher.ensure_resident(layer, np.array([copied]))
    assert copied in engine.bank.slots[layer].where
    out = fetcher.forward(layer, hidden, expert_ids, weights)
    assert torch.equal(out, full.bank.dispatch(layer, hidden, expert_ids, weights))


def test_consecutive_runs():
    assert consecutive_runs([3, 4, 5, 9, 10, 12]) == [(0, 3, 3), (3, 9, 2), (5, 12, 1)]
    assert consecutive_runs([7]) == [(0, 7, 1)]
    assert consecutive_runs([]) == []


@pytest.mark.parametrize("tier", ["pinned", "disk"])
def test_copy_rows_puts_each_expert_in_its_row(tiny_qwen3, tier):
    engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32", capacity=2, host_tier=tier, discovery=False)
    bank = engine.bank
    layer = min(bank.slots)
    fmt, shape = bank.slots.formats[layer], bank.fetcher.shape
    experts = [1, 2, 3, 6, 7, 0]
    dest = fmt.empty(shape, len(experts))
    copied = bank.transfers.tier.copy_rows(layer, experts, dest)
    assert copied == len(experts) * fmt.nbytes(shape)
    for i, e in enumerate(experts):
        one = fmt.empty(shape)
        bank.transfers.tier.copy_into(layer, e, one)
        for name, t in dest.items():
            assert torch.equal(t[i], one[name])
    assert isinstance(bank.transfers.tier, DiskHostTier) == (tier == "disk")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tier", ["pinned", "disk"])
def test_staged_prompts_on_the_gpu_give_the_resident_tokens(tiny_qwen3, small_staging, monkeypatch, dtype, tier):
    """On CUDA the copies ahead run on the copy stream while the host reads the next layer's routing;
    the compute stream waits for them by event. Every staged layer starts from groups copied ahead,
    and the tokens are the fully resident GPU engine's, in bf16 too (each pair computed once)."""
    monkeypatch.setattr(fetch, "AHEAD_ROUTED_SHARE", 0.0)
    used = _spy_ahead(monkeypatch)
    want = moestream.load(tiny_qwen3, device="cuda", dtype=dtype).generate(PROMPTS, max_tokens=8, ignore_eos=True)
    engine = moestream.load(tiny_qwen3, device="cuda", dtype=dtype, capacity=2, host_tier=tier, discovery=False)
    assert engine.generate(PROMPTS, max_tokens=8, ignore_eos=True) == want
    assert used
