"""y = x @ Wᵀ (+ b) for one row x: the batch-1 projections of a decode step, in Triton.

At batch 1 every projection of a layer (q/k/v, o, the router, the LM head) is a matrix-vector
product: memory-bound, its time the weight's bytes over the bandwidth it reaches. cuBLAS picks a
GEMM or GEMV kernel built for throughput, which on the 10-20 MB matrices of a decoder layer
spends much of its short life ramping up and draining. This kernel is built for the one job:
each program owns BLOCK_N output columns and streams their rows of W (contiguous along K, as
nn.Linear stores them) in wide loads, multiplying by x in fp32. Small BLOCK_N spreads even a
2,048-column matrix over hundreds of programs, so every SM has loads in flight from the first
microsecond.

Accumulation is fp32 per (column, k-lane), reduced once at the end; the bias (when given) is
added in fp32 before the one rounding to the output dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, release_consumer, wait_for_producer


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def default_config(N: int, K: int) -> GemvConfig:
    """The tile for an (N, K) weight. Swept on an H100 over Qwen3-30B-A3B's projections (q/k/v
    5120×2048, o 2048×4096, router 128×2048, LM head 151936×2048; `benchmarks/gemv_kernel.py`):
    four columns per program and 512-wide K steps were best or within 2% of best for every one;
    eight warps helped the narrow (N ≤ 2048) matrices, whose few programs each need more loads
    in flight."""
    block_k = min(512, triton.next_power_of_2(K))
    return GemvConfig(block_n=4, block_k=block_k, num_warps=8 if N <= 2048 else 4, num_stages=3)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, N, K, stride_wn,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    # Columns past N wrap around (their store is masked): the weight loads stay unmasked along N.
    rows = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_k
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    wait_for_producer(USE_PDL)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs)
            x = tl.load(x_ptrs)
        else:
            km = (k0 + offs_k) < K
            w = tl.load(w_ptrs, mask=km[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=km, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    release_consumer(USE_PDL)
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows).to(tl.float32)
    tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=offs_n < N)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None) -> torch.Tensor:
    """x (..., K) holding one row, weight (N, K) with unit stride along K → (..., N)."""
    K = x.shape[-1]
    N = weight.shape[0]
    x1 = x.reshape(K)
    if x1.stride(0) != 1:
        x1 = x1.contiguous()
    cfg = config or default_config(N, K)
    out = torch.empty(x.shape[:-1] + (N,), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(N, cfg.block_n),)](
        x1, weight, bias if bias is not None else weight, out, N, K, weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=K % cfg.block_k == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(x))
    return out
