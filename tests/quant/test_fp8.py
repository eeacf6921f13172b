"""FP8 e4m3 weights: the plain-torch dequantization against transformers' own and against the
definition element by element; config.json's FP8 entries read or refused in one sentence."""

import pytest
import torch

from moestream.errors import CheckpointError
from moestream.quant.fp8 import Fp8Spec, dequantize_fp8, fp8_quantization, parse_fp8, quantize_fp8

BLOCK, CHANNEL, TENSOR = Fp8Spec(4, 8), Fp8Spec(1, None, "weight_scale"), Fp8Spec(None, None, "weight_scale")


def _random_fp8(n, k, spec, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(*spec.scale_shape(n, k), generator=g) + 0.01
    return q, scale


@pytest.mark.parametrize("spec", [BLOCK, CHANNEL, TENSOR], ids=lambda s: s.name)
@pytest.mark.parametrize("shape", [(12, 24), (10, 21)])   # blocks that divide, and ragged last blocks
def test_dequantize_follows_the_definition(spec, shape):
    n, k = shape
    q, scale = _random_fp8(n, k, spec)
    bn, bk = spec.block(n, k)
    want = torch.empty(n, k)
    for i in range(n):
        for j in range(k):
            want[i, j] = float(q[i, j].float()) * float(scale[i // bn, j // bk])
    assert torch.equal(dequantize_fp8(q, scale, spec), want)
    assert torch.equal(dequantize_fp8(q.view(torch.uint8), scale, spec), want)   # the bank's bytes
    stacked = dequantize_fp8(torch.stack([q, q]), torch.stack([scale, 2 * scale]), spec)   # (S, N, K) slots
    assert torch.equal(stacked[0], want) and torch.equal(stacked[1], 2 * want)


def test_dequantize_matches_transformers_fine_grained_fp8():
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    for (n, k), spec, block in (((256, 384), Fp8Spec(128, 128), [128, 128]), ((200, 300), Fp8Spec(128, 128), [128, 128]),
                                ((64, 96), TENSOR, None)):
        q, scale = _random_fp8(n, k, spec, seed=n)
        theirs = fp8._dequantize_fp8_weight(q, scale if block else scale.reshape(()), block, torch.float32)
        assert torch.equal(dequantize_fp8(q, scale, spec), theirs), (n, k, spec)


def test_dequantize_matches_transformers_grid_dequantizer():
    """transformers' load-time dequantizer, which derives the block from the scale grid (divisible shapes)."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    dequantizer = fp8.Fp8Dequantize.__new__(fp8.Fp8Dequantize)
    for spec in (BLOCK, CHANNEL, TENSOR):
        q, scale = _random_fp8(16, 32, spec, seed=3)
        theirs = dequantizer._dequantize_one(q, scale, output_dtype=torch.float32)
        assert torch.equal(dequantize_fp8(q, scale, spec), theirs), spec.name


@pytest.mark.parametrize("spec", [BLOCK, CHANNEL, TENSOR], ids=lambda s: s.name)
def test_quantize_round_trips_within_fp8_precision(spec):
    w = torch.randn(20, 36, generator=torch.Generator().manual_seed(1))
    q, scale = quantize_fp8(w, spec)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and scale.shape == spec.scale_shape(20, 36)
    back = dequantize_fp8(q, scale, spec)
    assert ((back - w).abs() <= w.abs() * 2 ** -3 + 1e-2 * w.abs().max()).all()   # 3 mantissa bits


def test_names_parse_back_to_their_specs():
    for spec in (BLOCK, CHANNEL, TENSOR, Fp8Spec(128, 128)):
        assert parse_fp8(spec.name).name == spec.name
    assert parse_fp8("int4-g64") is None and parse_fp8("fp8-b0x128") is None


def _ct(weights, acts=None, fmt="float-quantized"):
    group = {"weights": {"type": "float", "num_bits": 8, **weights}, "targets": ["Linear"]}
    if acts is not None:
        group["input_activations"] = acts
    return {"quantization_config": {"quant_method": "compressed-tensors", "format": fmt,
                                    "config_groups": {"group_0": group}, "ignore": ["lm_head"]}}


def test_config_entries_name_their_layout():
    assert fp8_quantization({}) is None
    assert fp8_quantization({"quantization_config": {"quant_method": "gptq", "bits": 4}}) is None
    deepseek = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert fp8_quantization({"quantization_config": deepseek}) == Fp8Spec(128, 128)
    assert fp8_quantization({"quantization_config": {"quant_method": "fp8"}}).name == "fp8-tensor"
    assert fp8_quantization(_ct({"strategy": "channel"}, {"dynamic": True, "strategy": "token"})) == CHANNEL
    assert fp8_quantization(_ct({"strategy": "tensor"})) == TENSOR
    assert fp8_quantization(_ct({"strategy": "block", "block_structure": [128, 128]})).name == "fp8-b128x128"
    assert fp8_quantization(_ct({"strategy": "group"}, fmt="pack-quantized")) is None   # not FP8: another reader's


@pytest.mark.parametrize("raw, match", [
    ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}}, "static activation scales"),
    (_ct({"strategy": "tensor"}, {"dynamic": False, "strategy": "tensor"}), "static activation scales"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}}, "e4m3"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}}, "two positive integers"),
    (_ct({"strategy": "group", "group_size": 128}), "strategy 'group'"),
])
def test_config_entries_refused_in_one_sentence(raw, match):
    with pytest.raises(CheckpointError, match=match) as err:
        fp8_quantization(raw)
    assert str(err.value).count(". ") == 0 and str(err.value).endswith(".")
