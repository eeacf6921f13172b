"""MXFP4's plain-torch reference (quant/mxfp4.py) against its definition and against transformers'
own dequantization of gpt-oss's packed experts."""

from __future__ import annotations

import pytest
import torch

from moestream.errors import InputError
from moestream.quant.mxfp4 import FP4_VALUES, dequantize_mxfp4, quantize_mxfp4


def test_codes_nibbles_and_scales_follow_the_definition():
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x93          # value 0: code 3 (1.5), value 1: code 9 (-0.5)
    blocks[0, 0, 15] = 0x7F         # value 30: code 15 (-6), value 31: code 7 (6)
    out = dequantize_mxfp4(blocks, torch.tensor([[130]], dtype=torch.uint8))   # 2^3
    assert out.shape == (1, 32)
    assert out[0, :2].tolist() == [12.0, -4.0]
    assert out[0, 30:].tolist() == [-48.0, 48.0]
    assert out[0, 2:30].abs().sum() == 0
    every = torch.arange(256, dtype=torch.uint8).reshape(16, 16)   # every byte, scale 2^0
    values = dequantize_mxfp4(every.reshape(8, 2, 16), torch.full((8, 2), 127, dtype=torch.uint8)).reshape(-1)
    lo, hi = (every.reshape(-1) & 15).long(), (every.reshape(-1) >> 4).long()
    table = torch.tensor(FP4_VALUES)
    assert torch.equal(values[0::2], table[lo]) and torch.equal(values[1::2], table[hi])


def test_matches_transformers_dequantization():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=g)   # (E, N, K/32, 16)
    scales = torch.randint(110, 140, (3, 10, 4), dtype=torch.uint8, generator=g)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)          # (E, K, N)
    ours = dequantize_mxfp4(blocks, scales)                                            # (E, N, K)
    assert torch.equal(ours, theirs.transpose(1, 2))


def test_quantize_is_exact_on_representable_weights_and_close_otherwise():
    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (6, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(120, 130, (6, 2), dtype=torch.uint8, generator=g)
    w = dequantize_mxfp4(blocks, scales)
    again = dequantize_mxfp4(*quantize_mxfp4(w))
    assert torch.equal(again, w)
    x = torch.randn(16, 64, generator=g)
    err = (dequantize_mxfp4(*quantize_mxfp4(x)) - x).norm() / x.norm()
    assert err < 0.15
    with pytest.raises(InputError, match="multiple of 32"):
        quantize_mxfp4(torch.zeros(4, 48))
