"""The K-loop both fused-MoE GEMM kernels share: one row block of A against one expert's tile of B.

With GATED, B holds the gate rows and, N rows further, the up rows of gate_up; both are
accumulated in the same pass over K so the activation can be applied in the epilogue. B may be a
plain weight or a quantized one, dequantized tile by tile in registers (`load_b_tile`), so every
kernel serves every expert format.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TypeVar

import triton
import triton.language as tl


@triton.jit
def load_b_tile(b_base, s_base, z_base, code_ptr, offs_bn, k_idx, K, stride_bk, stride_bn, stride_sn,
                ROW_BYTES, k_mask, OUT_DTYPE: tl.constexpr, EVEN_K: tl.constexpr,
                BITS: tl.constexpr, GROUP: tl.constexpr, NF: tl.constexpr):
    """One [BLOCK_K, BLOCK_N] tile of B (rows offs_bn, columns k_idx) in OUT_DTYPE.

    BITS = 0: a plain weight. Otherwise a quantized one (moestream.quant's layout): value k of a
    row sits at bits [k·BITS, (k+1)·BITS) of the row's bytes (3-bit values may straddle two
    bytes); w = q·scale + bias (NF: codebook[q]·scale) with the scale of group k // GROUP,
    computed in fp32 and rounded once to OUT_DTYPE (the reference's dequantize-then-cast).
    """
    if BITS == 0:
        ptrs = b_base + offs_bn[None, :] * stride_bn + k_idx[:, None] * stride_bk
        if EVEN_K:
            return tl.load(ptrs)
        return tl.load(ptrs, mask=k_mask[:, None], other=0.0)
    bit = k_idx * BITS
    byte = bit // 8
    row = b_base + offs_bn[None, :] * stride_bn
    mask = k_mask[:, None]
    lo = tl.load(row + byte[:, None], mask=mask, other=0).to(tl.int32)
    if BITS == 3:   # a value may continue into the next byte
        hi = tl.load(row + byte[:, None] + 1, mask=mask & ((byte + 1) < ROW_BYTES)[:, None], other=0).to(tl.int32)
        lo = lo | (hi << 8)
    q = (lo >> (bit % 8)[:, None]) & ((1 << BITS) - 1)
    g = (k_idx // GROUP)[:, None]
    scale = tl.load(s_base + offs_bn[None, :] * stride_sn + g, mask=mask, other=0.0).to(tl.float32)
    if NF:
        w = tl.load(code_ptr + q) * scale
    else:
        bias = tl.load(z_base + offs_bn[None, :] * stride_sn + g, mask=mask, other=0.0).to(tl.float32)
        w = q.to(tl.float32) * scale + bias
    return w.to(OUT_DTYPE)


@triton.jit
def gated_dot(a_ptrs, b_base, s_base, z_base, code_ptr, offs_bn, row_mask, offs_k, K, N,
              stride_ak, stride_bk, stride_bn, stride_sn, ROW_BYTES,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              GATED: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
              BITS: tl.constexpr, GROUP: tl.constexpr, NF: tl.constexpr):
    """fp32 (acc, acc_up) of A[rows] @ B^T over all of K (acc_up is acc's twin, unused without GATED).

    B is one expert's weight: rows `offs_bn` (and, GATED, the up rows N further) of the tensor at
    `b_base`, plain (BITS = 0) or quantized (see load_b_tile; s_base / z_base point at the same
    expert's scales / biases)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, tl.cdiv(K, BLOCK_K)):
        k_idx = kk * BLOCK_K + offs_k
        k_mask = k_idx < K
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_mask[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = load_b_tile(b_base, s_base, z_base, code_ptr, offs_bn, k_idx, K, stride_bk, stride_bn, stride_sn,
                        ROW_BYTES, k_mask, a.dtype, EVEN_K, BITS, GROUP, NF)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if GATED:
            b_up = load_b_tile(b_base, s_base, z_base, code_ptr, offs_bn + N, k_idx, K, stride_bk, stride_bn,
                               stride_sn, ROW_BYTES, k_mask, a.dtype, EVEN_K, BITS, GROUP, NF)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
    return acc, acc_up


Tile = TypeVar("Tile")   # a dataclass with block_n, block_k and num_stages fields


def fit_tile(tile: Tile, block_m: int, n: int, k: int, elt_bytes: int, gated: bool, smem_budget: int) -> Tile:
    """Shrink a tile to the problem and to shared memory.

    tl.dot needs every tile dimension >= 16; small or odd shapes get the smallest power of two
    that covers them. fp32 inputs double the pipeline's shared memory, so stages (then BLOCK_K)
    are reduced until it fits.
    """
    block_n = min(tile.block_n, max(16, triton.next_power_of_2(n)))
    block_k = min(tile.block_k, max(16, triton.next_power_of_2(k)))
    stages = tile.num_stages
    b_tiles = 2 if gated else 1

    def smem(st: int, bk: int) -> int:
        return st * (block_m + b_tiles * block_n) * bk * elt_bytes

    while smem(stages, block_k) > smem_budget and stages > 2:
        stages -= 1
    while smem(stages, block_k) > smem_budget and block_k > 32:
        block_k //= 2
    return replace(tile, block_n=block_n, block_k=block_k, num_stages=stages)
