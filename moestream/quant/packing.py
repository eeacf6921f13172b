"""The bit layout of packed values: every row is a little-endian bit stream of `bits`-bit values.

Value j of a row occupies bits [j·bits, (j+1)·bits) of the row's bytes read as one little-endian
integer. For 8, 4 and 2 bits that is 1, 2 or 4 values per byte, lowest first; for 3 bits, 8 values
in every 3 bytes. This is MLX's layout (its uint32 weight arrays are the same bytes), so MLX
checkpoints are read without repacking, and it is what the dequantizing kernels unpack.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def pack_geometry(bits: int) -> tuple[int, int]:
    """(values, bytes) of the smallest whole unit: lcm(bits, 8) bits."""
    unit = math.lcm(bits, 8)
    return unit // bits, unit // 8


def pack(q: Tensor, bits: int) -> Tensor:
    """uint8 values (..., K) in [0, 2^bits) → packed uint8 (..., K·bits/8)."""
    values, nbytes = pack_geometry(bits)
    *lead, k = q.shape
    if k % values:
        raise ValueError(f"{k} values do not fill whole {values}-value packs of {bits} bits")
    if bits == 8:
        return q.to(torch.uint8).contiguous()
    if 8 % bits == 0:   # 4 and 2 bits: whole values in each byte, in uint8 arithmetic
        v = q.to(torch.uint8).reshape(*lead, k // values, values)
        out = v[..., 0].clone()
        for i in range(1, values):
            out |= v[..., i] << (i * bits)
        return out
    units = q.reshape(*lead, k // values, values).to(torch.int64)
    shifts = torch.arange(values, dtype=torch.int64, device=q.device) * bits
    word = (units << shifts).sum(-1)                                             # (..., units)
    byte_shifts = torch.arange(nbytes, dtype=torch.int64, device=q.device) * 8
    out = (word[..., None] >> byte_shifts) & 0xFF                                 # (..., units, nbytes)
    return out.reshape(*lead, k // values * nbytes).to(torch.uint8)


def unpack(packed: Tensor, bits: int) -> Tensor:
    """Packed uint8 (..., K·bits/8) → uint8 values (..., K)."""
    values, nbytes = pack_geometry(bits)
    if bits == 8:
        return packed
    *lead, width = packed.shape
    if 8 % bits == 0:   # 4 and 2 bits: each byte's values by shifts and a mask, in uint8 (no int64 words)
        mask = (1 << bits) - 1
        return torch.stack([(packed >> shift) & mask for shift in range(0, 8, bits)], dim=-1).reshape(*lead, -1)
    units = packed.reshape(*lead, width // nbytes, nbytes).to(torch.int64)
    byte_shifts = torch.arange(nbytes, dtype=torch.int64, device=packed.device) * 8
    word = (units << byte_shifts).sum(-1)
    shifts = torch.arange(values, dtype=torch.int64, device=packed.device) * bits
    out = (word[..., None] >> shifts) & ((1 << bits) - 1)
    return out.reshape(*lead, width // nbytes * values).to(torch.uint8)
