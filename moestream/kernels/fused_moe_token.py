"""One token's routed experts (batch-1 decode) as two GEMV launches, the k-sum inside the second.

At T = 1 each of the k experts meets a single row, so the decode path's `tl.dot` over 16 padded
rows buys nothing, and its third launch (the sum over k) is a whole kernel boundary for 8 KB of
work. Here:

* gate_up: grid (k, cdiv(I, BLOCK_N)); program (j, n) streams BLOCK_N gate rows and the matching
  up rows of expert j's slot along H with wide loads, multiplies by the hidden row in fp32 and
  writes `act(gate + bias, up + bias)` into row j of a (k, I) buffer in the hidden dtype.
* down: grid (cdiv(H, BLOCK_N),); program n loads BLOCK_N down rows of all k pairs' experts at
  once (one [k, BLOCK_N, BLOCK_K] tile per step: every pair's bytes in flight together), takes
  each pair's GEMV against its activated row, times the routing weight, and adds the pairs to an
  fp32 total in order (`reduce`), or writes each pair's fp32 row (`reduce=False`, for a bank that
  gathers pair rows of several calls). Pairs whose expert has no slot (-1, or outside [0, S))
  are masked: none of their bytes is read.

Bits. The total is summed pair by pair from 0 in fp32, the order `_sum_over_k_kernel` sums pair
rows in, and the down launch is compiled without FMA contraction (`enable_fp_fusion=False`) so a
pair's weighted row is rounded to fp32 before it is added, as a written pair row is. A pair row
written here and summed there therefore gives the bits of the in-launch total: a bank computing
resident and streamed experts apart still equals full residency.

Slot map. With `slot_map` given, `ids` are expert ids and each program reads its slot from the
map (a bank's expert → slot table) itself: the separate indexing launch goes away.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from .moe_activation import activate
from .moe_reference import HostReads
from .pdl import pdl_args, release_consumer, wait_for_producer


@dataclass(frozen=True)
class TokenTile:
    block_n: int
    block_k: int
    num_warps: int


@dataclass(frozen=True)
class TokenConfig:
    gate_up: TokenTile
    down: TokenTile


# Swept on an H100 at Qwen3-30B-A3B's shape (`benchmarks/fused_moe_kernel.py --tune-token`): 31.1 µs
# cold for the two launches, against the decode path's 35.9 for its three.
DEFAULT_TOKEN_CONFIG = TokenConfig(gate_up=TokenTile(2, 2048, 4), down=TokenTile(2, 128, 4))


@triton.jit
def slot_of(ids_ptr, map_ptr, j, top_k, stride_id, num_slots, num_host, HAS_MAP: tl.constexpr):
    """Source of pair j, a scalar or a block of pairs (-1 where there is none, or j >= top_k): ids[j],
    through the slot map when there is one. Below num_slots a slot; num_slots + e an expert read in
    place from the host stack (when num_host > 0)."""
    e = tl.load(ids_ptr + j * stride_id, mask=j < top_k, other=-1).to(tl.int32)
    if HAS_MAP:
        e = tl.where(e >= 0, tl.load(map_ptr + tl.maximum(e, 0), mask=e >= 0, other=-1).to(tl.int32), -1)
    return tl.where((e >= 0) & (e < num_slots + num_host), e, -1)


@triton.jit
def pair_sources(ids_ptr, map_ptr, take_ptr, cut_ptr, top_k, stride_id, num_slots, num_host, HAS_MAP: tl.constexpr,
             SPLIT: tl.constexpr, K_PAD: tl.constexpr):
    """Sources of all K_PAD pairs (`slot_of`) and the first intermediate row each computes; with
    SPLIT, of the m pairs whose source is the host stack, the first take[m] in routing order are the
    CPU's (-1 here) and the next starts at row cut[m] (the CPU computes its rows below), as
    `split_outside_cut` says."""
    offs = tl.arange(0, K_PAD)
    src = slot_of(ids_ptr, map_ptr, offs, top_k, stride_id, num_slots, num_host, HAS_MAP)
    lo = tl.zeros((K_PAD,), dtype=tl.int32)
    if SPLIT:
        outside = src >= num_slots
        m = tl.sum(outside.to(tl.int32), axis=0)
        take = tl.load(take_ptr + m)
        cut = tl.load(cut_ptr + m)
        rank = tl.sum((outside[None, :] & (offs[None, :] < offs[:, None])).to(tl.int32), axis=1)
        lo = tl.where(outside & (rank == take), cut, 0)
        src = tl.where(outside & (rank < take), -1, src)
    return src, lo


@triton.jit
def expert_offset(src, num_slots, host_off, stride_e):
    """Element offset of a source's expert from the slot tensor's base: a slot, or (src >= num_slots)
    the host stack's expert, `host_off` elements away (pinned memory the GPU reads over PCIe)."""
    src = src.to(tl.int64)
    return tl.where(src < num_slots, src * stride_e, host_off + (src - num_slots) * stride_e)


@triton.jit
def _token_gate_up_kernel(x_ptr, b_ptr, c_ptr, ids_ptr, map_ptr, bias_ptr, take_ptr, cut_ptr,
                          I, H, num_slots, num_host, host_off, top_k, stride_id, stride_be, stride_bn, stride_cm, stride_bias, alpha, limit,
                          HAS_MAP: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                          SPLIT: tl.constexpr, K_PAD: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_producer(USE_PDL)
    j = tl.program_id(0)
    if SPLIT:
        src, lo = pair_sources(ids_ptr, map_ptr, take_ptr, cut_ptr, top_k, stride_id, num_slots, num_host, HAS_MAP,
                           SPLIT, K_PAD)
        pick = tl.arange(0, K_PAD) == j
        slot = tl.sum(tl.where(pick, src, 0), axis=0)
        first = tl.sum(tl.where(pick, lo, 0), axis=0)
    else:
        slot = slot_of(ids_ptr, map_ptr, j, top_k, stride_id, num_slots, num_host, HAS_MAP)
        first = 0
    if slot < 0:
        return
    if (tl.program_id(1) + 1) * BLOCK_N <= first:
        return                           # rows the CPU computes (the down launch never reads them)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (offs_n % I).to(tl.int64)     # past I: wrap (store masked), loads stay unmasked along N
    offs_k = tl.arange(0, BLOCK_K)
    g_ptrs = b_ptr + expert_offset(slot, num_slots, host_off, stride_be) + rows[:, None] * stride_bn + offs_k[None, :]
    u_ptrs = g_ptrs + I * stride_bn
    x_ptrs = x_ptr + offs_k
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        if EVEN_K:
            wg = tl.load(g_ptrs)
            wu = tl.load(u_ptrs)
            x = tl.load(x_ptrs).to(tl.float32)[None, :]
        else:
            km = (k0 + offs_k) < H
            wg = tl.load(g_ptrs, mask=km[None, :], other=0.0)
            wu = tl.load(u_ptrs, mask=km[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=km, other=0.0).to(tl.float32)[None, :]
        acc_g += wg.to(tl.float32) * x
        acc_u += wu.to(tl.float32) * x
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    release_consumer(USE_PDL)
    gate = tl.sum(acc_g, axis=1)
    up = tl.sum(acc_u, axis=1)
    if HAS_BIAS:
        bias_row = bias_ptr + slot.to(tl.int64) * stride_bias
        gate += tl.load(bias_row + rows).to(tl.float32)
        up += tl.load(bias_row + I + rows).to(tl.float32)
    y = activate(gate, up, ACTIVATION, alpha, limit)
    tl.store(c_ptr + j * stride_cm + offs_n, y.to(c_ptr.dtype.element_ty), mask=offs_n < I)


@triton.jit
def _token_down_kernel(a_ptr, b_ptr, out_ptr, ids_ptr, map_ptr, w_ptr, bias_ptr, take_ptr, cut_ptr,
                       H, I, num_slots, num_host, host_off, top_k, stride_id, stride_w, stride_am, stride_be, stride_bn, stride_om,
                       stride_bias,
                       HAS_MAP: tl.constexpr, HAS_BIAS: tl.constexpr, REDUCE: tl.constexpr, K_PAD: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                       SPLIT: tl.constexpr, USE_PDL: tl.constexpr):
    """BLOCK_N output columns of every pair at once: the k experts' tiles are one [K_PAD, BLOCK_N,
    BLOCK_K] load per step, so a program has all its pairs' bytes in flight, not one at a time."""
    wait_for_producer(USE_PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (offs_n % H).to(tl.int64)
    offs_j = tl.arange(0, K_PAD)
    offs_k = tl.arange(0, BLOCK_K)
    slot, lo = pair_sources(ids_ptr, map_ptr, take_ptr, cut_ptr, top_k, stride_id, num_slots, num_host, HAS_MAP, SPLIT,
                        K_PAD)
    valid = slot >= 0
    slot = tl.where(valid, slot, 0).to(tl.int64)
    b_ptrs = (b_ptr + expert_offset(slot, num_slots, host_off, stride_be)[:, None, None]
              + rows[None, :, None] * stride_bn + offs_k[None, None, :])
    a_ptrs = a_ptr + offs_j[:, None] * stride_am + offs_k[None, :]
    acc = tl.zeros((K_PAD, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        if EVEN_K:
            am = valid[:, None]
        else:
            am = valid[:, None] & ((k0 + offs_k) < I)[None, :]
        if SPLIT:                         # a shared pair's rows below its cut are the CPU's: not read
            am = am & ((k0 + offs_k)[None, :] >= lo[:, None])
        w = tl.load(b_ptrs, mask=am[:, None, :], other=0.0)
        a = tl.load(a_ptrs, mask=am, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * a[:, None, :]
        b_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    release_consumer(USE_PDL)
    y = tl.sum(acc, axis=2)                                   # (K_PAD, BLOCK_N): one row per pair
    if HAS_BIAS:
        y += tl.load(bias_ptr + slot[:, None] * stride_bias + rows[None, :], mask=valid[:, None],
                     other=0.0).to(tl.float32)
    store_pair_rows(y, w_ptr, stride_w, valid, out_ptr, stride_om, offs_n, H, REDUCE, K_PAD, BLOCK_N)


@triton.jit
def store_pair_rows(y, w_ptr, stride_w, valid, out_ptr, stride_om, offs_n, H, REDUCE: tl.constexpr,
                    K_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """The down launches' epilogue: each pair's (K_PAD, BLOCK_N) fp32 row times its routing weight,
    then (REDUCE) summed into columns offs_n of out, or written as pair rows of out (`stride_om`)."""
    offs_j = tl.arange(0, K_PAD)
    y = y * tl.load(w_ptr + offs_j * stride_w, mask=valid, other=0.0).to(tl.float32)[:, None]
    if REDUCE:
        # Pair by pair from 0, as `_sum_over_k_kernel` adds written rows (extracting row j is exact:
        # one value plus zeros).
        total = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for j in tl.static_range(K_PAD):
            total += tl.sum(tl.where(offs_j[:, None] == j, y, 0.0), axis=0)
        tl.store(out_ptr + offs_n, total.to(out_ptr.dtype.element_ty), mask=offs_n < H)
    else:
        tl.store(out_ptr + offs_j[:, None] * stride_om + offs_n[None, :], y,
                 mask=valid[:, None] & (offs_n < H)[None, :])


def host_offset(host: Tensor, slots: Tensor) -> int:
    """Elements from `slots`' first element to `host`'s: the kernels reach a host stack through the
    slot tensor's pointer (one pointer argument per projection; pinned memory shares the device's
    virtual address space). Both must hold the same dtype and expert shape."""
    if host.dtype != slots.dtype or host.shape[1:] != slots.shape[1:] or not host.is_contiguous():
        raise ValueError(f"a host stack must be contiguous and match the slots' dtype and expert shape, got "
                         f"{tuple(host.shape)} {host.dtype} against {tuple(slots.shape)} {slots.dtype}")
    return (host.data_ptr() - slots.data_ptr()) // host.element_size()


def _tile(tile: TokenTile, K: int) -> TokenTile:
    """The tile kept within the problem: K steps no deeper than K's next power of two."""
    return TokenTile(tile.block_n, min(tile.block_k, triton.next_power_of_2(K)), tile.num_warps)


def token_moe(hidden: Tensor, gate_up: Tensor, down: Tensor, ids: Tensor, weights: Tensor, activation_code: int,
              intermediate: int, slot_map: Tensor | None = None, biases: tuple[Tensor, Tensor] | None = None,
              alpha: float = 1.0, limit: float = 0.0, reduce: bool = True,
              config: TokenConfig | None = None, host: HostReads | None = None) -> Tensor:
    """hidden (1, H), slots gate_up (S, 2I, H) and down (S, H, I), ids and weights (1, k) →
    (1, H) in hidden's dtype (`reduce`), or the (1, k, H) fp32 pair rows, zero where unrouted.
    `host`: stacks in pinned memory, which sources S + e read in place, less its `cpu_take` (and the
    rows below `cpu_cut` of the pair it shares).
    Inputs are validated by the caller (`fused_moe_with_config`)."""
    cfg = config or DEFAULT_TOKEN_CONFIG
    k = ids.shape[1]
    S, H, I = gate_up.shape[0], hidden.shape[1], intermediate
    num_host, gu_host, down_host, take, cut = 0, 0, 0, None, None
    if host is not None:
        num_host, take, cut = host.gate_up.shape[0], host.cpu_take, host.cpu_cut
        gu_host, down_host = host_offset(host.gate_up, gate_up), host_offset(host.down, down)
    split = take is not None
    ids1, w1 = ids.reshape(k), weights.reshape(k)
    has_map = slot_map is not None
    smap = slot_map if has_map else ids1
    if split and cut is None:
        cut = torch.zeros_like(take)        # whole experts only
    take = take if split else ids1          # unread placeholder pointers
    cut = cut if split else ids1
    has_bias = biases is not None
    gu_bias, down_bias = biases if has_bias else (gate_up, down)
    inter = torch.empty((k, I), dtype=hidden.dtype, device=hidden.device)
    gu = _tile(cfg.gate_up, H)
    _token_gate_up_kernel[(k, triton.cdiv(I, gu.block_n))](
        hidden, gate_up, inter, ids1, smap, gu_bias, take, cut,
        I, H, S, num_host, gu_host, k, ids1.stride(0), gate_up.stride(0), gate_up.stride(1), inter.stride(0),
        gu_bias.stride(0) if has_bias else 0, float(alpha), float(limit),
        HAS_MAP=has_map, HAS_BIAS=has_bias, ACTIVATION=activation_code,
        BLOCK_N=gu.block_n, BLOCK_K=gu.block_k, EVEN_K=H % gu.block_k == 0, SPLIT=split,
        K_PAD=triton.next_power_of_2(k), num_warps=gu.num_warps, **pdl_args(hidden))
    if reduce:
        out = torch.empty((1, H), dtype=hidden.dtype, device=hidden.device)
    else:
        out = torch.zeros((k, H), dtype=torch.float32, device=hidden.device)
    dn = _tile(cfg.down, I)
    _token_down_kernel[(triton.cdiv(H, dn.block_n),)](
        inter, down, out, ids1, smap, w1, down_bias, take, cut,
        H, I, S, num_host, down_host, k, ids1.stride(0), w1.stride(0), inter.stride(0), down.stride(0), down.stride(1), out.stride(0),
        down_bias.stride(0) if has_bias else 0,
        HAS_MAP=has_map, HAS_BIAS=has_bias, REDUCE=reduce, K_PAD=triton.next_power_of_2(k),
        BLOCK_N=dn.block_n, BLOCK_K=dn.block_k, EVEN_K=I % dn.block_k == 0, SPLIT=split, num_warps=dn.num_warps,
        enable_fp_fusion=False, **pdl_args(hidden))
    return out if reduce else out.view(1, k, H)
