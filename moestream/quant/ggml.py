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
offset, so it maps exactly onto our affine format in groups of 32: q = the stored code (Q8_0: q +
128, bias −128·d), scale = d (or d·sc), bias = −8·d, m, −dmin·m. In the five types whose scale and
offset are an fp16 d (and m) or a power of two times d, both are exact in fp16, so they are held in
fp16 (Q4_0: 5 bits a weight, not the 6 of fp32); the K-quants' d·sc and dmin·m need fp32. Those
products of an fp16 and an integer below 2^6 are exact in fp32, and q·scale + bias rounds once, as
ggml's own dequantization does. 4-bit codes go to int4-g32; Q8_0's and the 5-bit types' codes to
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

from moestream.errors import CheckpointError
from moestream.quant.packing import pack
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
# the types whose scales and offsets are exact in fp16 (d and m are fp16; −8·d, −16·d, −128·d too)
FP16_EXACT = {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"}
GROUP = 32
Q6K_RUN = 1 << 16   # Q6_K blocks dequantized at once (16.8M values)


def spec_of(type_name: str) -> QuantSpec | None:
    """The affine spec a ggml type is held in (exact, or requantized for Q6_K); None: floats and MXFP4
    (not affine: `to_mxfp4`)."""
    entry = EXACT.get(type_name) or REQUANTIZED.get(type_name)
    if not entry:
        return None
    return QuantSpec("int", entry[2], GROUP, torch.float16 if type_name in FP16_EXACT else torch.float32)


def common_spec(type_names) -> QuantSpec:
    """The spec that holds tensors of several exact types at once (a layer's experts, a linear put
    together from parts): the widest codes (4-bit codes are 8-bit codes too) and fp16 scales only
    where every type's are exact in fp16."""
    specs = [spec_of(t) for t in type_names]
    fp16 = all(s.scale_dtype == torch.float16 for s in specs)
    return QuantSpec("int", max(s.bits for s in specs), GROUP, torch.float16 if fp16 else torch.float32)


def in_spec(codes: Tensor, scales: Tensor, biases: Tensor, spec: QuantSpec, type_name: str,
            packed: bool = False) -> QuantizedTensor:
    """Codes (`packed`: already in our packing) and fp32 scales and biases (`to_codes`) stored as
    `spec` holds them. An fp16
    offset of −8·d or −128·d overflows only where d is past 8,188 or 511, which no weight's block
    scale reaches; such a tensor is refused rather than changed."""
    scales, biases = scales.to(spec.scale_dtype), biases.to(spec.scale_dtype)
    if spec.scale_dtype == torch.float16 and not (torch.isfinite(scales).all() and torch.isfinite(biases).all()):
        raise CheckpointError(f"a {type_name} tensor's block scale times its code offset exceeds fp16's range "
                              "(|d| above 511 for Q8_0, 8,188 for Q4_0); convert that tensor to a float type.")
    return QuantizedTensor(codes if packed else pack(codes, spec.bits), scales.contiguous(), biases.contiguous(),
                           spec)


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
        qs, d, bias = _q4_blocks(blocks, type_name)
        return _nibbles32(qs).reshape(n, -1), d, bias
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


def to_affine(blocks: Tensor, type_name: str, spec: QuantSpec | None = None) -> QuantizedTensor:
    """The exact affine form (groups of 32; scales and biases in fp16 or fp32: `spec_of`, or the
    `spec` of a layer holding several types) of a row-blocked tensor. Q4_0 and Q4_1 kept at 4 bits
    have their nibbles moved byte to byte (`_q4_bytes`), not unpacked and packed again."""
    spec = spec or spec_of(type_name)
    if type_name in ("Q4_0", "Q4_1") and spec.bits == 4:
        qs, d, bias = _q4_blocks(blocks, type_name)
        return in_spec(_q4_bytes(qs).reshape(blocks.shape[0], -1), d, bias, spec, type_name, packed=True)
    return in_spec(*to_codes(blocks, type_name), spec, type_name)


def _q4_blocks(blocks: Tensor, type_name: str) -> tuple[Tensor, Tensor, Tensor]:
    """Q4_0 / Q4_1 rows → their nibble bytes (N, blocks, 16), scales d and offsets (−8·d, or m) (N, blocks) fp32."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, EXACT[type_name][1])
    d = _f16(b[..., 0:2].reshape(n, -1, 1, 2)).reshape(n, -1)
    if type_name == "Q4_0":
        return b[..., 2:18], d, -8.0 * d
    return b[..., 4:20], d, _f16(b[..., 2:4].reshape(n, -1, 1, 2)).reshape(n, -1)


def _q4_bytes(qs: Tensor) -> Tensor:
    """(..., 16) ggml nibbles (value j in byte j's low nibble, value 16 + j in its high one) → our
    packing of the same 32 values (values 2i and 2i + 1 in byte i, low nibble first)."""
    w = qs.contiguous().view(torch.int16)   # bytes 2i and 2i + 1 as one little-endian 16-bit word (masks
    low = (w & 0x0F) | ((w >> 4) & 0xF0)     # drop an arithmetic shift's sign bits)
    high = ((w >> 4) & 0x0F) | ((w >> 8) & 0xF0)
    return torch.cat([low, high], dim=-1).to(torch.uint8)


def dequantize_blocks(blocks: Tensor, type_name: str, k: int) -> Tensor:
    """(N, K) fp32 weight of any readable quantized type: exact types through the affine form,
    MXFP4 through its own (our references), Q6_K through `_q6k_values`."""
    if type_name in EXACT:
        q = to_affine(blocks, type_name)
        return dequantize(q.qweight, q.scales, q.biases, q.spec)
    if type_name == "MXFP4":
        return dequantize_mxfp4(*to_mxfp4(blocks))
    if type_name == "Q6_K":   # in runs of blocks, so an LM head's temporaries stay ~0.2 GB
        flat = blocks.reshape(-1, 210)
        out = torch.empty(flat.shape[0], 256)
        for start in range(0, flat.shape[0], Q6K_RUN):
            out[start:start + Q6K_RUN] = _q6k_values(flat[start:start + Q6K_RUN])
        return out.reshape(blocks.shape[0], k)
    import gguf

    out = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[type_name])
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(blocks.shape[0], k)


def _q6k_values(b: Tensor) -> Tensor:
    """(n, 210) Q6_K blocks → (n, 256) fp32, in the operations and order of gguf's own dequantization
    (so bit for bit its values), as whole-tensor torch ops: a GGUF's Q6_K LM head (151,936 × 2,048 in
    Qwen3's Q4_K_M and Q4_0 files) dequantizes on every core in a fraction of numpy's seconds. Per
    block: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 sub-block scales, an fp16 d; value
    = (d · scale) · (q − 32)."""
    n = b.shape[0]
    ql, qh, scales, d = b[:, :128], b[:, 128:192], b[:, 192:208], b[:, 208:210]
    d = d.contiguous().view(torch.float16).float() * scales.contiguous().view(torch.int8).float()   # (n, 16)
    low = (ql.reshape(n, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (qh.reshape(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)) & 0x03
    q = (low.reshape(n, 8, 32) | (high.reshape(n, 8, 32) << 4)).to(torch.int8) - 32
    return (d.reshape(n, 16, 1) * q.reshape(n, 16, 16).float()).reshape(n, 256)


def requantize(blocks: Tensor, type_name: str, k: int) -> tuple[QuantizedTensor, float]:
    """Q6_K → int8-g32 (fp32 scales): the parts and the relative error (max |Δw| / max |w|)."""
    w = dequantize_blocks(blocks, type_name, k)
    q = quantize(w, spec_of(type_name))
    back = dequantize(q.qweight, q.scales, q.biases, q.spec)
    return q, float((back - w).abs().max() / w.abs().max().clamp_min(1e-30))
