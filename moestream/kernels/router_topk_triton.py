"""A router's choice in one launch: softmax → top-k → renormalise, or top-k → softmax, in Triton.

The torch path (model/routers.py, the reference) is a cast, a softmax, a top-k, a sum and a
division: five launches per MoE layer at batch 1. One program per token keeps the row of E
logits in registers and takes the k largest by k rounds of max (k is small: 8 to 10), the lower
expert id first among equal values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, release_consumer, wait_for_producer


@triton.jit
def _router_topk_kernel(logits_ptr, weights_ptr, ids_ptr, E, stride, K: tl.constexpr, MODE: tl.constexpr,
                        RENORMALISE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                        USE_PDL: tl.constexpr):
    wait_for_producer(USE_PDL)
    release_consumer(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    valid = e < E
    z = tl.load(logits_ptr + row * stride + e, mask=valid, other=float("-inf")).to(tl.float32)
    if MODE == 0:
        p = tl.exp(z - tl.max(z, axis=0))
        vals = tl.where(valid, p / tl.sum(p, axis=0), -1.0)
    else:
        vals = z
    kk = tl.arange(0, BLOCK_K)
    top = tl.zeros((BLOCK_K,), dtype=tl.float32)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
    for j in tl.static_range(K):
        best = tl.max(vals, axis=0)
        idx = tl.minimum(tl.min(tl.where(vals == best, e, BLOCK_E), axis=0), E - 1)   # NaN rows stay in range
        top = tl.where(kk == j, best, top)
        ids = tl.where(kk == j, idx.to(tl.int64), ids)
        vals = tl.where(e == idx, float("-inf"), vals)
    chosen = kk < K
    if MODE == 1:
        q = tl.where(chosen, tl.exp(top - tl.max(tl.where(chosen, top, float("-inf")), axis=0)), 0.0)
        top = q / tl.sum(q, axis=0)
    elif RENORMALISE:
        top = top / tl.sum(tl.where(chosen, top, 0.0), axis=0)
    tl.store(weights_ptr + row * K + kk, top, mask=chosen)
    tl.store(ids_ptr + row * K + kk, ids, mask=chosen)


def _choice_buffers(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logits with unit stride along E, and the (T, k) fp32 weights and int64 ids to fill."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    T = logits.shape[0]
    return (logits, torch.empty((T, k), dtype=torch.float32, device=logits.device),
            torch.empty((T, k), dtype=torch.int64, device=logits.device))


def router_topk(logits: torch.Tensor, k: int, mode: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (T, k) fp32, ids (T, k) int64) from router logits (T, E) of any float dtype."""
    logits, weights, ids = _choice_buffers(logits, k)
    T, E = logits.shape
    if T:
        _router_topk_kernel[(T,)](logits, weights, ids, E, logits.stride(0), K=k, MODE=mode,
                                  RENORMALISE=renormalise, BLOCK_E=triton.next_power_of_2(E),
                                  BLOCK_K=triton.next_power_of_2(k), num_warps=4,
                                  **pdl_args(logits))
    return weights, ids


@triton.jit(do_not_specialize=["seed"])
def _uniform_topk_kernel(logits_ptr, weights_ptr, ids_ptr, draws_ptr, E, stride, seed, K: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """k distinct experts drawn uniformly (the k largest of E uniform numbers), weighted by the
    router's softmax at them, renormalised: the softmax over the chosen logits alone."""
    wait_for_producer(USE_PDL)
    release_consumer(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    draw = tl.atomic_add(draws_ptr, 1).to(tl.int64)   # a fresh stream per row and call, counted on the device
    e = tl.arange(0, BLOCK_E)
    valid = e < E
    u = tl.where(valid, tl.rand(seed, (draw * BLOCK_E + e).to(tl.int32)), -1.0)
    z = tl.load(logits_ptr + row * stride + e, mask=valid, other=float("-inf")).to(tl.float32)
    kk = tl.arange(0, BLOCK_K)
    top = tl.full((BLOCK_K,), float("-inf"), dtype=tl.float32)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
    for j in tl.static_range(K):
        best = tl.max(u, axis=0)
        idx = tl.min(tl.where(u == best, e, BLOCK_E), axis=0)
        top = tl.where(kk == j, tl.sum(tl.where(e == idx, z, 0.0), axis=0), top)
        ids = tl.where(kk == j, idx.to(tl.int64), ids)
        u = tl.where(e == idx, -1.0, u)
    chosen = kk < K
    q = tl.where(chosen, tl.exp(top - tl.max(top, axis=0)), 0.0)
    tl.store(weights_ptr + row * K + kk, q / tl.sum(q, axis=0), mask=chosen)
    tl.store(ids_ptr + row * K + kk, ids, mask=chosen)


def uniform_topk(logits: torch.Tensor, k: int, draws: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Benchmark routing in one launch: (weights (T, k) fp32, ids (T, k) int64), k distinct experts
    per row drawn uniformly and weighted by the router's own probabilities at them, renormalised.
    `draws` ((1,) int64 on the device) counts the rows drawn so far; each row takes the next random
    stream of `seed`, so captured graphs draw anew at every replay."""
    logits, weights, ids = _choice_buffers(logits, k)
    T, E = logits.shape
    if T:
        _uniform_topk_kernel[(T,)](logits, weights, ids, draws, E, logits.stride(0), seed, K=k,
                                   BLOCK_E=triton.next_power_of_2(E), BLOCK_K=triton.next_power_of_2(k),
                                   num_warps=4, **pdl_args(logits))
    return weights, ids
