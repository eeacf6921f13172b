"""Prepacked warm start through moestream.load: build and save once, load after, rebuild on mismatch or damage."""

import torch

import moestream

PROMPT = torch.randint(2, 160, (20,), generator=torch.Generator().manual_seed(11)).tolist()


def test_first_start_builds_and_saves_later_starts_load(tiny_qwen3, tmp_path):
    snap = tmp_path / "bank"
    cold = moestream.load(tiny_qwen3, device="cpu", dtype="float32", capacity=3, prepack=snap, warmup_tokens=6)
    assert not cold.prepack.loaded and (snap / "bank.json").exists() and cold.prepack_error is None
    warm = moestream.load(tiny_qwen3, device="cpu", dtype="float32", capacity=3, prepack=snap)
    assert warm.prepack.loaded
    for layer in cold.bank.layers:
        assert warm.bank.layers[layer].owner == cold.bank.layers[layer].owner
        assert torch.equal(warm.bank.layers[layer].tensors["gate_up"], cold.bank.layers[layer].tensors["gate_up"])
    assert warm.generate(PROMPT, max_tokens=12, ignore_eos=True) == cold.generate(PROMPT, max_tokens=12, ignore_eos=True)


def test_mismatch_or_damage_rebuilds_instead_of_failing(tiny_qwen3, tmp_path):
    snap = tmp_path / "bank"
    moestream.load(tiny_qwen3, device="cpu", dtype="float32", capacity=3, prepack=snap)
    other = moestream.load(tiny_qwen3, device="cpu", dtype="float32", capacity=4, prepack=snap)
    assert not other.prepack.loaded and "capacity" in other.prepack.reason
    tensors = next(snap.glob("bank-*.safetensors"))
    data = bytearray(tensors.read_bytes())
    data[-5] ^= 0xFF
    tensors.write_bytes(bytes(data))
    damaged = moestream.load(tiny_qwen3, device="cpu", dtype="float32", capacity=4, prepack=snap)
    assert not damaged.prepack.loaded
    again = moestream.load(tiny_qwen3, device="cpu", dtype="float32", capacity=4, prepack=snap)
    assert again.prepack.loaded   # the rebuild saved a good snapshot
