"""ggml's block quantizations (GGUF tensors) mapped onto moestream's affine formats.

Each row of K values is stored as K/32 (or K/256) blocks, one after the other:

Q8_0  34 B / 32: d fp16, 32 int8 q.                w = d·q
Q4_0  18 B / 32: d fp16, 16 B of nibbles.          w = d·(q − 8)
Q4_1  20 B / 32: d fp16, m fp16, 16 B of nibbles.  w = d·q + m
Q5_0  22 B / 32: d fp16, 4 B of fifth bits, nibbles. w = d·(q − 16)
Q5_1  24 B / 32: d, m fp16, fifth bits, nibbles.   w = d·q + m
      (element j < 16 is byte j's low nibble, element 16 + j its high nibble; the fifth bit of
      element j is bit j of the little-endian 32-bit word)
Q4_K  144 B / 256: d, dmin fp16; 12 B holding eight 6-bit (sc, m) pairs; 128 B of nibbles (per
      64 values, 32 bytes: low nibbles the first 32, high nibbles the next 32).
                                                   w = d·sc_j·q − dmin·m_j (sub-block j of 32)
Q5_K  176 B / 256: as Q4_K plus 32 B of fifth bits (bit 2c / 2c+1 of byte l for chunk c).
Q6_K  210 B / 256: sixteen sub-blocks of 16 values with int8 scales: dequantized (see below).
MXFP4 17 B / 32: an e8m0 scale byte, 16 B of fp4 e2m1 nibbles: moestream's own MXFP4, reordered.

Every one of the first seven is, per group of 32 values, an integer code times one scale plus one
offset, so it maps exactly onto our affine format in groups of 32 with fp32 scales and biases:
q = the stored code (Q8_0: q + 128, bias −128·d), scale = d (or d·sc), bias = −8·d, m, −dmin·m.
Those products of an fp16 and an integer below 2^6 are exact in fp32, and q·scale + bias rounds
once, as ggml's own dequantization does. 4-bit codes go to int4-g32; Q8_0's and the 5-bit types' codes to
int8-g32 (5 bits in a byte: exact, 10 bits a weight against Q5_K's 5.5). Q6_K's two scales inside
every 32 values have no common integer grid within 8 bits, so it is not exact in any of ours:
`requantize_q6k` holds it as int8-g32 (error about a twentieth of Q6_K's own, measured per tensor
and printed once at load) or the caller dequantizes it. MXFP4 (llama.cpp's gpt-oss and `MXFP4_MOE`
quantizations) is not affine (fp4 values): its experts keep their codes and scales as moestream's
MXFP4 format holds them (`to_mxfp4`), anything else in it is dequantized.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from moestream.quant.gptq import pack_rows
from moestream.quant.mxfp4 import dequantize_mxfp4
from moestream.quant.spec import QuantSpec
from moestream.quant.tensor import QuantizedTensor, dequantize, quantize

FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# type → (values per block, bytes per block, bits of the affine codes holding it exactly)
EXACT = {"Q8_0": (32, 34, 8), "Q4_0": (32, 18, 4), "Q4_1": (32, 20, 4), "Q5_0": (32, 22, 8), "Q5_1": (32, 24, 8),
         "Q4_K": (256, 144, 4), "Q5_K": (256, 176, 8)}
REQUANTIZED = {"Q6_K": (256, 210, 8)}
# type → (values per block, bytes per block) of the types whose experts keep their codes in a format of ours
NATIVE = {"MXFP4": (32, 17)}   # an e8m0 scale byte, then 16 bytes of fp4 e2m1 codes: moestream's MXFP4
GROUP = 32


def spec_of(type_name: str) -> QuantSpec | None:
    """The affine spec a ggml type is held in (exact, or requantized for Q6_K); None: floats and MXFP4
    (not affine: `to_mxfp4`)."""
    entry = EXACT.get(type_name) or REQUANTIZED.get(type_name)
    return QuantSpec("int", entry[2], GROUP, torch.float32) if entry else None


def readable(type_name: str) -> bool:
    return type_name in FLOAT_TYPES or type_name in EXACT or type_name in REQUANTIZED or type_name in NATIVE


def to_mxfp4(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """(N, nblocks·17) MXFP4 rows → moestream's MXFP4 (quant/mxfp4.py): codes (N, K/2) and e8m0 scales
    (N, K/32), the same bytes reordered. ggml puts a block's scale first and value j in the low
    nibble of byte j, value j + 16 in its high nibble (its doubled e2m1 table times half the scale
    is the same product); ours holds values 2j and 2j + 1 in byte j."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, 17)
    codes = _nibbles32(b[..., 1:]).reshape(n, -1, 16, 2)
    return (codes[..., 0] | (codes[..., 1] << 4)).reshape(n, -1), b[..., 0].contiguous()


def _f16(raw: Tensor) -> Tensor:
    """(..., 2) uint8 → (...) fp32 of the little-endian fp16 they hold."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles32(qs: Tensor) -> Tensor:
    """(..., 16) bytes → (..., 32) values: low nibbles first, then high nibbles."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def _k_scales(raw: Tensor) -> tuple[Tensor, Tensor]:
    """(..., 12) bytes → the eight 6-bit sub-block scales and mins (..., 8) of a Q4_K / Q5_K block."""
    s = raw.to(torch.int32)
    sc_lo, m_lo = s[..., 0:4] & 63, s[..., 4:8] & 63
    sc_hi = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    m_hi = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return torch.cat([sc_lo, sc_hi], -1).float(), torch.cat([m_lo, m_hi], -1).float()


def _k_codes(qs: Tensor) -> Tensor:
    """(..., 128) bytes → (..., 256) 4-bit codes of a K-quant super-block."""
    q = qs.reshape(*qs.shape[:-1], 4, 32)
    return torch.stack([q & 0xF, q >> 4], dim=-2).reshape(*qs.shape[:-1], 256)


def to_codes(blocks: Tensor, type_name: str) -> tuple[Tensor, Tensor, Tensor]:
    """(N, nblocks·bytes) uint8 rows of one type → codes (N, K) uint8, scales and biases (N, K/32)
    fp32 with w = codes·scale + bias exactly (the affine form, before packing)."""
    per, size, _ = EXACT[type_name]
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, size)
    if type_name == "Q8_0":
        d = _f16(b[..., 0:2].reshape(n, -1, 1, 2))
        codes = b[..., 2:] ^ 0x80                                  # int8 q + 128 as unsigned
        return codes.reshape(n, -1), d.reshape(n, -1), (-128.0 * d).reshape(n, -1)
    if type_name in ("Q4_0", "Q4_1"):
        d = _f16(b[..., 0:2].reshape(n, -1, 1, 2))
        start = 2 if type_name == "Q4_0" else 4
        codes = _nibbles32(b[..., start:start + 16])
        bias = -8.0 * d if type_name == "Q4_0" else _f16(b[..., 2:4].reshape(n, -1, 1, 2))
        return codes.reshape(n, -1), d.reshape(n, -1), bias.reshape(n, -1)
    if type_name in ("Q5_0", "Q5_1"):
        d = _f16(b[..., 0:2].reshape(n, -1, 1, 2))
        start = 2 if type_name == "Q5_0" else 4
        qh = b[..., start:start + 4].to(torch.int64)
        word = qh[..., 0] | (qh[..., 1] << 8) | (qh[..., 2] << 16) | (qh[..., 3] << 24)
        fifth = (word.unsqueeze(-1) >> torch.arange(32)) & 1
        codes = _nibbles32(b[..., start + 4:start + 20]) | (fifth.to(torch.uint8) << 4)
        bias = -16.0 * d if type_name == "Q5_0" else _f16(b[..., 2:4].reshape(n, -1, 1, 2))
        return codes.reshape(n, -1), d.reshape(n, -1), bias.reshape(n, -1)
    d = _f16(b[..., 0:2].reshape(n, -1, 1, 2))
    dmin = _f16(b[..., 2:4].reshape(n, -1, 1, 2))
    sc, m = _k_scales(b[..., 4:16])
    if type_name == "Q4_K":
        codes = _k_codes(b[..., 16:144])
    else:   # Q5_K: fifth bit of value l of chunk c (low half) is bit 2c of qh[l], of the high half bit 2c + 1
        qh = b[..., 16:48].to(torch.int32)
        high = torch.stack([(qh >> bit) & 1 for bit in range(8)], dim=-2)   # (n, nb, 8, 32): sub-block j's bits
        codes = _k_codes(b[..., 48:176]) | (high.reshape(n, -1, 256).to(torch.uint8) << 4)
    scale = (d * sc).reshape(n, -1)
    bias = (-(dmin * m)).reshape(n, -1)
    return codes.reshape(n, -1), scale, bias


def to_affine(blocks: Tensor, type_name: str) -> QuantizedTensor:
    """The exact affine form (groups of 32, fp32 scales and biases) of a row-blocked tensor."""
    spec = spec_of(type_name)
    codes, scale, bias = to_codes(blocks, type_name)
    return QuantizedTensor(pack_rows(codes, spec.bits), scale.contiguous(), bias.contiguous(), spec)


def dequantize_blocks(blocks: Tensor, type_name: str, k: int) -> Tensor:
    """(N, K) fp32 weight of any readable quantized type: exact types through the affine form and
    MXFP4 through its own (our references), Q6_K through gguf's own dequantization."""
    if type_name in EXACT:
        q = to_affine(blocks, type_name)
        return dequantize(q.qweight, q.scales, q.biases, q.spec)
    if type_name == "MXFP4":
        return dequantize_mxfp4(*to_mxfp4(blocks))
    import gguf

    out = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[type_name])
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(blocks.shape[0], k)


def requantize(blocks: Tensor, type_name: str, k: int) -> tuple[QuantizedTensor, float]:
    """Q6_K → int8-g32 (fp32 scales): the parts and the relative error (max |Δw| / max |w|)."""
    w = dequantize_blocks(blocks, type_name, k)
    q = quantize(w, spec_of(type_name))
    back = dequantize(q.qweight, q.scales, q.biases, q.spec)
    return q, float((back - w).abs().max() / w.abs().max().clamp_min(1e-30))
