"""Router-only discovery: one read-back, frequencies that match real routing, a bank seeded from them."""

import numpy as np
import torch

import moestream
import moestream.warmstart.discovery as discovery_module
from moestream.model.routers import ObservedRouter

PROMPT = torch.randint(2, 160, (48,), generator=torch.Generator().manual_seed(7)).tolist()


def test_discovery_reads_back_once_and_seeds_the_bank(tiny_qwen3, monkeypatch):
    calls = []
    real = discovery_module.read_back
    monkeypatch.setattr(discovery_module, "read_back", lambda t: calls.append(1) or real(t))
    loaded = moestream.load(tiny_qwen3, device="cpu", dtype="float32", capacity=3, discovery=PROMPT)
    assert len(calls) == 1
    found = loaded.discovery
    assert found is not None and found.tokens == len(PROMPT) and found.seconds >= 0
    for layer, freqs in found.frequencies.items():
        assert np.isclose(freqs.sum(), loaded.config.top_k)   # every token routes to top_k experts
        top = set(np.argsort(-freqs, kind="stable")[:3].tolist())
        assert set(loaded.bank.layers[layer].owner) == top     # the bank starts with the most used


def test_discovery_frequencies_match_the_full_models_routing(tiny_qwen3):
    loaded = moestream.load(tiny_qwen3, device="cpu", dtype="float32", capacity=3, discovery=PROMPT)
    # the same prompt through the full model, watching the routers
    full = moestream.load(tiny_qwen3, device="cpu", dtype="float32")
    counts = {}
    for block in full.model.moe_blocks():
        block.swap_router(ObservedRouter(block.router, lambda ids, layer=block.layer:
                                         counts.setdefault(layer, []).append(ids.reshape(-1))))
    from moestream.model.context import no_cache_context
    from moestream.model.rotary import rotary_table

    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        full.model(ids, no_cache_context(rotary_table(full.config, len(PROMPT), ids.device), ids, None, torch.float32))
    first = min(counts)   # the first MoE layer sees identical inputs in both passes
    expected = np.bincount(torch.cat(counts[first]).numpy(), minlength=full.config.num_experts) / len(PROMPT)
    assert np.allclose(loaded.discovery.frequencies[first], expected)


def test_no_discovery_when_every_expert_fits(tiny_qwen3):
    loaded = moestream.load(tiny_qwen3, device="cpu", dtype="float32", discovery=PROMPT)
    assert loaded.discovery is None
