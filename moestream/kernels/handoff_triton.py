"""The hand-off's two CUDA kernels, `post` and `collect` (`handoff.py` says what they do and when),
with their launches. Apart from `handoff.py` so that importing it never imports Triton: only a
post or collect on a CUDA device loads this module (the CPU runs the same protocol in torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import globaltimer

if TYPE_CHECKING:
    from moestream.kernels.handoff import LayerHandoff


@triton.jit
def _fence_sys(x):
    """A system-scope fence in every thread (orders host-memory writes and reads around it)."""
    return tl.inline_asm_elementwise("fence.acq_rel.sys;\nmov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _post_kernel(seq_ptr, hidden_ptr, ids_ptr, w_ptr, map_ptr, take_ptr, cut_ptr, use_ptr, miss_ptr, pairs_ptr,
                 balance_ptr, stamp_ptr, hdr_ptr, box_ids_ptr, box_w_ptr, box_hidden_ptr, live_ptr,
                 T, H, top_k, num_slots, SPLIT: tl.constexpr, BLOCK: tl.constexpr, PAIRS: tl.constexpr):
    T = tl.minimum(T, tl.load(live_ptr))   # rows past the live ones pad a captured batch: nobody's
    n_hidden = T * H
    n_pairs = T * top_k
    seq = tl.load(seq_ptr) + 1
    tl.store(seq_ptr, seq)
    for i in range(0, n_hidden, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        m = offs < n_hidden
        tl.store(box_hidden_ptr + offs, tl.load(hidden_ptr + offs, mask=m), mask=m)
    p = tl.arange(0, PAIRS)
    pm = p < n_pairs
    e = tl.load(ids_ptr + p, mask=pm, other=-1).to(tl.int32)
    valid = pm & (e >= 0)
    src = tl.load(map_ptr + tl.maximum(e, 0), mask=valid, other=-1)
    in_bank = valid & (src >= 0) & (src < num_slots)
    read = valid & (src >= num_slots)
    # the worker's pairs: split by tables, every one outside the bank (the header's take picks);
    # else those the map leaves to nobody on the device (-1)
    if SPLIT:
        device_side = in_bank
    else:
        device_side = in_bank | read
    tl.store(box_ids_ptr + p, tl.where(device_side, -1, e), mask=pm)
    tl.store(box_w_ptr + p, tl.load(w_ptr + p, mask=pm, other=0.0).to(tl.float32), mask=pm)
    tl.store(hdr_ptr + 1, T)
    tl.atomic_add(use_ptr + e, 1, mask=valid)
    tl.atomic_add(miss_ptr + e, 1, mask=valid & ~in_bank)
    tl.atomic_add(pairs_ptr, tl.sum(in_bank.to(tl.int64)))
    take = -1                        # every pair outside the bank is the CPU's, unless split:
    cut = 0
    shared = 0
    if SPLIT:   # one token: the first take[m] of its m pairs outside the bank are the CPU's, and
        # the intermediate rows [0, cut[m]) of the next one (the device computes the rest of it)
        m = tl.sum(read.to(tl.int32), axis=0)
        take = tl.load(take_ptr + m)
        cut = tl.load(cut_ptr + m)
        shared = ((cut > 0) & (take < m)).to(tl.int32)
        rank = tl.sum((read[None, :] & (p[None, :] < p[:, None])).to(tl.int32), axis=1)
        read = read & (rank >= take)
    tl.store(hdr_ptr + 2, take)      # one store each: the worker takes the split from here (the device's table)
    tl.store(hdr_ptr + 3, cut)
    n_read = tl.sum(read.to(tl.int32), axis=0)
    n_cpu = tl.sum((valid & ~in_bank & ~read).to(tl.int32), axis=0)
    tl.atomic_add(pairs_ptr + 1, n_read.to(tl.int64))
    tl.atomic_add(pairs_ptr + 2, n_cpu.to(tl.int64))
    tl.atomic_add(pairs_ptr + 3, shared.to(tl.int64))
    tl.atomic_add(pairs_ptr + 4, (shared * cut).to(tl.int64))
    both = ((n_read > 0) & ((n_cpu + shared) > 0)).to(tl.int32)   # both sides have work: which kind of call
    if SPLIT:
        tl.store(balance_ptr, both)
    else:
        tl.store(balance_ptr, 2 * both)
    seq = _fence_sys(seq)            # every thread's writes to host memory before the flag
    tl.debug_barrier()
    tl.store(hdr_ptr, seq)
    tl.store(stamp_ptr, globaltimer())


@triton.jit
def _collect_kernel(seq_ptr, hdr_ptr, rows_ptr, out_ptr, error_ptr, live_ptr, balance_ptr, stamp_ptr, T, H,
                    max_polls, BLOCK: tl.constexpr):
    n = tl.minimum(T, tl.load(live_ptr)) * H   # padding rows get nothing added
    seq = tl.load(seq_ptr)
    flag = tl.load(hdr_ptr, volatile=True)
    polls = 0
    t0 = globaltimer()
    while (flag != seq) & (polls < max_polls):
        flag = tl.load(hdr_ptr, volatile=True)
        polls += 1
    kind = tl.load(balance_ptr)
    if (tl.program_id(0) == 0) & (kind != 0):   # a split call: who finished first, by how much
        t1 = globaltimer()
        base = balance_ptr + 1 + 4 * (kind - 1)
        tl.atomic_add(base, 1)
        tl.atomic_add(base + 1, (polls > 0).to(tl.int32))
        tl.atomic_add(base + 2, ((t1 - t0 + 500) // 1000).to(tl.int32))
        tl.atomic_add(base + 3, ((t1 - tl.load(stamp_ptr) + 500) // 1000).to(tl.int32))
    flag = _fence_sys(flag)          # the answer's rows after its flag
    if flag != seq:
        tl.atomic_max(error_ptr, 1)
    else:
        if tl.load(hdr_ptr + 1, volatile=True) > 0:
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            m = offs < n
            y = tl.load(out_ptr + offs, mask=m).to(tl.float32) + tl.load(rows_ptr + offs, mask=m, volatile=True)
            tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=m)


def post(h: LayerHandoff, hidden: Tensor, ids: Tensor, weights: Tensor, source_map: Tensor, num_slots: int,
         live: Tensor, cpu_take: Tensor | None, cpu_cut: Tensor | None, block: int) -> None:
    """`handoff.post` on the device: one program writes the layer's call into its mailbox's CUDA aliases
    (`cpu_take` given: a split one-token post, with its `cpu_cut` table)."""
    T, H = hidden.shape
    k = ids.shape[-1]
    a = h.alias
    split = cpu_take is not None
    _post_kernel[(1,)](h.seq, hidden.contiguous(), ids.reshape(-1).contiguous(), weights.reshape(-1).contiguous(),
                       source_map, cpu_take if split else source_map, cpu_cut if split else source_map,
                       h.use, h.miss, h.pairs, h.balance, h.stamp,
                       a["post"], a["ids"],
                       a["weights"], a["hidden"], live, T, H, k, num_slots, SPLIT=split,
                       BLOCK=block, PAIRS=max(16, triton.next_power_of_2(T * k)), num_warps=4)


def collect(h: LayerHandoff, out: Tensor, error: Tensor, live: Tensor, max_polls: int, block: int) -> None:
    """`handoff.collect` on the device: a program per `block` values of `out` waits (at most
    `max_polls` polls) for the worker's answer, then adds its rows in place."""
    T, H = out.shape
    _collect_kernel[(triton.cdiv(T * H, block),)](h.seq, h.alias["result"], h.alias["rows"], out, error,
                                                  live, h.balance, h.stamp, T, H, max_polls,
                                                  BLOCK=block, num_warps=4)
