"""A top-k draw in two launches: the next token among a row's k best logits, after temperature,
min-p and top-p, from one uniform number per row (sampling.py's top-k path on CUDA).

The torch path takes ~20 small launches per draw (two top-k stages, a division, a softmax for each
filter, a cumulative sum, a multinomial draw, gathers): ~290 µs of device time on an H100 for a
151,936-token row, on the critical path of every sampled token. Here:

* candidates: grid (rows, chunks of 2048 logits); each program takes its chunk's k best, best
  first, by k rounds of a max over packed keys, and writes them.
* draw: grid (rows,); the k best of the row's candidates the same way, then temperature, min-p,
  top-p and the inverse of the cumulative distribution at the row's uniform number, in registers.

A key packs a logit and its index in one int64: the fp32 bits made order-preserving as a signed
int32 in the high half, the index's complement in the low half, so one max finds the largest logit
and, among equal ones, the smallest index. The spec is `sample_top_k_reference` in
runtime/sampling.py: the same tokens for the same uniform numbers, up to the rounding of the
cumulative sums at a boundary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .pdl import pdl_args, release_consumer, wait_for_producer

__all__ = ["CHUNK", "MAX_CANDIDATES", "sample_top_k", "takes_kernel", "top_k_variants"]

CHUNK = 2048              # logits per candidates program
MAX_CANDIDATES = 8192     # chunks × k the draw program holds in registers


def takes_kernel(vocab: int, k: int) -> bool:
    """Whether the two launches serve rows of `vocab` logits at top-k `k`."""
    return 1 <= k < vocab and triton.cdiv(vocab, CHUNK) * k <= MAX_CANDIDATES


@triton.jit
def _keys(x, idx):
    """fp32 values and int32 indices → int64 keys ordered by value, then by smaller index."""
    bits = x.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)            # signed order of the floats
    return (ordered.to(tl.int64) << 32) | (4294967295 - idx.to(tl.int64))


@triton.jit
def _unkey(key):
    """int64 keys → (fp32 values, int64 indices)."""
    ordered = (key >> 32).to(tl.int32)
    bits = ordered ^ ((ordered >> 31) & 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True), 4294967295 - (key & 4294967295)


# k and the sizes that follow it are not specialized (divisible by 16 or not): a variant per pattern of them
# would compile in a client's first request with a new top-k. The padded widths still follow k: warm-up
# compiles one draw of each (`top_k_variants`).
@triton.jit(do_not_specialize=["k", "stride_k"])
def _candidates_kernel(logits_ptr, keys_ptr, V, k, stride_l, stride_k, CHUNK_: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_producer(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    i = chunk * CHUNK_ + tl.arange(0, CHUNK_)
    x = tl.load(logits_ptr + row * stride_l + i, mask=i < V, other=float("-inf")).to(tl.float32)
    release_consumer(USE_PDL)
    none = tl.full((CHUNK_,), -9223372036854775807, tl.int64)   # below every logit's key
    keys = tl.where(i < V, _keys(x, i), none)
    for j in range(k):
        best = tl.max(keys, axis=0)
        tl.store(keys_ptr + row * stride_k + chunk * k + j, best)
        keys = tl.where(keys == best, none, keys)


@triton.jit(do_not_specialize=["n", "k", "stride_k"])
def _draw_kernel(keys_ptr, uniform_ptr, out_ptr, n, k, stride_k, temperature, top_p, min_p,
                 N_PAD: tl.constexpr, K_PAD: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_producer(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, N_PAD)
    none = -9223372036854775807   # below every logit's key
    keys = tl.load(keys_ptr + row * stride_k + c, mask=c < n, other=none)
    u = tl.load(uniform_ptr + row)
    release_consumer(USE_PDL)
    j = tl.arange(0, K_PAD)
    best = tl.full((K_PAD,), none, tl.int64)
    for r in range(k):
        top = tl.max(keys, axis=0)
        best = tl.where(j == r, top, best)
        keys = tl.where(keys == top, none, keys)
    values, ids = _unkey(best)
    live = j < k
    x = values / temperature
    p = tl.where(live, tl.exp(x - tl.max(tl.where(live, x, float("-inf")), axis=0)), 0.0)   # best first: p[0] = 1
    keep = live & (p >= min_p)                         # softmax(x) >= min_p · its max
    p = tl.where(keep, p, 0.0)
    probs = p / tl.sum(p, axis=0)
    keep = keep & ((tl.cumsum(probs, axis=0) - probs) < top_p)   # top-p over what min-p left
    w = tl.where(keep, p, 0.0)
    cdf = tl.cumsum(w, axis=0)
    pick = tl.sum((cdf <= u * tl.sum(w, axis=0)).to(tl.int32), axis=0)
    pick = tl.minimum(pick, tl.sum(keep.to(tl.int32), axis=0) - 1)   # kept tokens lead the sorted row
    tl.store(out_ptr + row, tl.sum(tl.where(j == pick, ids, 0), axis=0))


def _padded(vocab: int, k: int) -> tuple[int, int]:
    """The draw's padded widths (N_PAD, K_PAD) at top-k k: its compiled variant."""
    return max(16, triton.next_power_of_2(triton.cdiv(vocab, CHUNK) * k)), max(16, triton.next_power_of_2(k))


def top_k_variants(vocab: int) -> list[int]:
    """The least top-k of each variant the two launches compile for rows of `vocab` logits: one draw of each
    compiles every top-k a request can ask of them (`Engine.warm_up`)."""
    least: dict[tuple[int, int], int] = {}
    k = 1
    while takes_kernel(vocab, k):
        least.setdefault(_padded(vocab, k), k)
        k += 1
    return sorted(least.values())


def sample_top_k(logits: Tensor, k: int, temperature: float, top_p: float, min_p: float, uniform: Tensor) -> Tensor:
    """logits (rows, V), one uniform number in [0, 1) per row (fp32, on the device) → token ids
    (rows,) int64. The caller checks `takes_kernel`."""
    rows, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    chunks = triton.cdiv(V, CHUNK)
    n = chunks * k
    keys = torch.empty((rows, n), dtype=torch.int64, device=logits.device)
    _candidates_kernel[(rows, chunks)](logits, keys, V, k, logits.stride(0), keys.stride(0), CHUNK_=CHUNK,
                                       num_warps=4, **pdl_args(logits))
    out = torch.empty((rows,), dtype=torch.int64, device=logits.device)
    n_pad, k_pad = _padded(V, k)
    _draw_kernel[(rows,)](keys, uniform, out, n, k, keys.stride(0), temperature, top_p if top_p < 1 else 2.0, min_p,
                          N_PAD=n_pad, K_PAD=k_pad,
                          num_warps=8 if n_pad >= 4096 else 4, **pdl_args(logits))
    return out
