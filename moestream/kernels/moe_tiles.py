"""The K-loop both fused-MoE GEMM kernels share: one row block of A against one expert's tile of B.

With GATED, B holds the gate rows and, N rows further, the up rows of gate_up; both are
accumulated in the same pass over K so the activation can be applied in the epilogue.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TypeVar

import triton
import triton.language as tl


@triton.jit
def gated_dot(a_ptrs, b_ptrs, row_mask, offs_k, K, N, stride_ak, stride_bk, stride_bn,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              GATED: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """fp32 (acc, acc_up) of A[rows] @ B^T over all of K (acc_up is acc's twin, unused without GATED)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up_ptrs = b_ptrs + N * stride_bn
    for kk in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_mask[:, None], other=0.0)
            b = tl.load(b_ptrs)
        else:
            k_mask = offs_k < K - kk * BLOCK_K
            a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if GATED:
            if EVEN_K:
                b_up = tl.load(up_ptrs)
            else:
                b_up = tl.load(up_ptrs, mask=k_mask[:, None], other=0.0)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
            up_ptrs += BLOCK_K * stride_bk
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
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
