"""The device's side of the stream worker: post a layer's routing to the CPU, collect its answer.

Hybrid misses run a decode step as one CUDA graph while the CPU computes its share of each layer's
missing experts (`cpu_moe.StreamWorker`). Two launches per MoE layer make the hand-off:

* `post` (one program): bumps the layer's sequence number (a device counter: graph replays need
  no host), writes the hidden rows, expert ids (-1 for a pair the bank serves: the device's map is
  the only record of what is resident, read here) and routing weights into the layer's pinned
  `Mailbox`, counts the routed pairs by where they are served (bank, read from host memory by the
  GPU, computed by the CPU) and per expert (used, missed: the bank's refresh reads them), then,
  after a system-scope fence, publishes the sequence number. The worker polls for it. Which pairs
  are the worker's: in a one-token call split by tables (`cpu_take` / `cpu_cut`), the first of
  those outside the bank, as the tables say; otherwise those whose source in the map is -1 (a
  batch's map names the experts the GPU reads in place, S + e, and leaves the rest to the CPU).
* `collect` (one program per block of the output): waits on the device until the worker's answer
  carries the sequence number (volatile loads of pinned memory, a bounded number of polls: a
  worker that never answers sets the error flag instead of hanging the GPU), then adds the CPU's
  fp32 rows to the layer's output in place. Where the post split its misses between both sides,
  it counts the call, whether the answer was not there yet (the device waited for the CPU), for
  how long, and how long the call took from its post to the answer, apart for one-token calls and
  batches: the hybrid policy moves each split until the wait is a small share of the call.

Mailboxes live in pinned host memory, which shares the device's virtual address space; the
kernels get CUDA aliases of those tensors (`device_alias`). On the CPU (tests, CPU-only runs) the
same protocol runs eagerly in torch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from moestream.kernels import cpu_moe
from moestream.kernels.cpu_moe import Mailbox
from moestream.kernels.moe_reference import split_outside

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import globaltimer
except ImportError:   # CPU-only installs: the torch path below serves them
    triton = None

# 1-2 µs per poll of host memory: 5-10 s before a device-side wait gives up (an answer takes
# well under 10 ms, even for a batch of 16 on a busy host).
MAX_POLLS = 5_000_000
POST_BLOCK = 1024
COLLECT_BLOCK = 1024


class _CudaArray:
    """A pinned host tensor presented as device memory (`__cuda_array_interface__`), so torch makes
    a CUDA tensor that aliases it: the Triton kernels then read and write the host memory in place."""

    TYPESTR: ClassVar[dict[torch.dtype, str]] = {torch.int32: "<i4", torch.float32: "<f4", torch.int64: "<i8", torch.uint8: "|u1",
                                                 torch.int16: "<i2", torch.float16: "<f2"}

    def __init__(self, t: Tensor):
        self.__cuda_array_interface__ = {"shape": (t.numel(),), "typestr": self.TYPESTR[t.dtype],
                                         "data": (t.data_ptr(), False), "version": 3}


def device_alias(t: Tensor, device: torch.device) -> Tensor:
    """A CUDA tensor over the same (pinned, contiguous) host memory as `t`."""
    if not t.is_pinned() or not t.is_contiguous():
        raise ValueError("only contiguous pinned host tensors can be aliased on the device")
    if t.dtype == torch.bfloat16:   # no bf16 typestr: alias the 16-bit words, then view them as bf16
        return device_alias(t.view(torch.int16), device).view(torch.bfloat16)
    with torch.cuda.device(device):
        return torch.as_tensor(_CudaArray(t), device=device)


@dataclass
class LayerHandoff:
    """One MoE layer's mailbox, its device aliases and its device-side counters."""

    box: Mailbox
    seq: Tensor          # (1,) int32 on the device: the layer's sequence number
    use: Tensor          # (E,) int32: routed pairs per expert since the last refresh
    miss: Tensor         # (E,) int32: of those, pairs not served by the bank
    pairs: Tensor        # (5,) int64: pairs served by the bank, read from host memory (shared ones too),
                         # computed by the CPU; pairs shared by both, and the CPU's intermediate rows of those
    balance: Tensor      # (9,) int32: whether the last post split its misses between both sides (0: no,
                         # 1: a one-token call, 2: a batch); then per kind ([1:5] one-token, [5:9] batches):
                         # calls that did, those whose device side waited for the CPU's answer, the µs it
                         # waited in all, and the µs from their posts to their answers in all
    stamp: Tensor        # (1,) int64: when the last post was published (ns; the device's clock on CUDA)
    alias: dict[str, Tensor] | None = None   # CUDA aliases of the box's tensors

    @classmethod
    def create(cls, box: Mailbox, use: Tensor, miss: Tensor, pairs: Tensor, balance: Tensor) -> LayerHandoff:
        """Counters given by the caller (views of one tensor per kind: a refresh reads them in one copy)."""
        device = use.device
        alias = None
        if device.type == "cuda":
            alias = {name: device_alias(getattr(box, name), device)
                     for name in ("post", "ids", "weights", "hidden", "result", "rows")}
        return cls(box, torch.zeros(1, dtype=torch.int32, device=device), use, miss, pairs, balance,
                   torch.zeros(1, dtype=torch.int64, device=device), alias)


if triton is not None:
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
         live: Tensor, cpu_take: Tensor | None = None, cpu_cut: Tensor | None = None) -> None:
    """Hand a layer's call to the worker: (T, H) hidden rows, (T, k) expert ids and weights, of which
    the first `live` ((1,) int32 on the device) rows are real (a captured batch pads the rest);
    `source_map` is the map the GPU's dispatch reads (a slot, or num_slots + e: outside the bank,
    read in place; -1: the CPU's) and `cpu_take` / `cpu_cut` the one-token split (`HostReads`), which
    sort the pairs for the counters and which the post hands the worker (header [2] take, [3] cut; a
    shared pair counts as read by the device). Without them the map alone splits the call."""
    T, H = hidden.shape
    k = ids.shape[-1]
    if T * H > h.box.hidden.numel() or T * k > h.box.ids.numel():
        raise ValueError(f"a call of {T} tokens is larger than the mailbox was made for")
    if h.alias is not None:
        a = h.alias
        split = cpu_take is not None
        if split and cpu_cut is None:
            raise ValueError("a split post needs its cut table too (zeros where no pair is shared)")
        _post_kernel[(1,)](h.seq, hidden.contiguous(), ids.reshape(-1).contiguous(), weights.reshape(-1).contiguous(),
                           source_map, cpu_take if split else source_map, cpu_cut if split else source_map,
                           h.use, h.miss, h.pairs, h.balance, h.stamp,
                           a["post"], a["ids"],
                           a["weights"], a["hidden"], live, T, H, k, num_slots, SPLIT=split,
                           BLOCK=POST_BLOCK, PAIRS=max(16, triton.next_power_of_2(T * k)), num_warps=4)
        return
    box = h.box
    T = min(T, int(live[0]))
    n_pairs = T * k
    seq = int(h.seq[0]) + 1
    h.seq[0] = seq
    flat = ids[:T].reshape(-1).to(torch.int32)
    src = torch.where(flat >= 0, source_map[flat.long().clamp_min(0)], -2).view(T, -1)
    split = cpu_take is not None and T == 1
    device_side = ((src >= 0) & (src < num_slots)) if split else (src >= 0)
    box.ids[:n_pairs].copy_(torch.where(device_side.reshape(-1), -1, flat))
    box.weights[:n_pairs].copy_(weights[:T].reshape(-1).float())
    box.hidden[:T * H].copy_(hidden[:T].reshape(-1))
    box.post[1] = T
    m = int((src >= num_slots).sum())
    take = int(cpu_take[m]) if split else -1
    cut = int(cpu_cut[m]) if split and cpu_cut is not None else 0
    box.post[2], box.post[3] = take, cut
    shared = int(split and cut > 0 and take < m)
    read = split_outside(src, num_slots, cpu_take if split else None) >= num_slots
    valid = flat >= 0
    e = flat[valid].long()
    in_bank = ((src >= 0) & (src < num_slots)).reshape(-1)[valid]
    h.use.index_add_(0, e, torch.ones_like(e, dtype=torch.int32))
    h.miss.index_add_(0, e, (~in_bank).to(torch.int32))
    n_read = read.sum()
    n_cpu = valid.sum() - in_bank.sum() - n_read
    h.pairs += torch.stack((in_bank.sum(), n_read, n_cpu, torch.tensor(shared), torch.tensor(shared * cut)))
    h.balance[0] = int(n_read > 0 and n_cpu + shared > 0) * (1 if split else 2)
    cpu_moe.publish(box.post, seq)
    h.stamp[0] = time.perf_counter_ns()


def collect(h: LayerHandoff, out: Tensor, error: Tensor, live: Tensor) -> Tensor:
    """Add the worker's rows for this layer's last post to the first `live` rows of `out` (T, H), in
    place; returns `out`. On the device a worker that never answers sets `error` (the step's output
    is then wrong: the caller checks it after the step); on the CPU it raises."""
    T, H = out.shape
    if h.alias is not None:
        _collect_kernel[(triton.cdiv(T * H, COLLECT_BLOCK),)](h.seq, h.alias["result"], h.alias["rows"], out, error,
                                                              live, h.balance, h.stamp, T, H, MAX_POLLS,
                                                              BLOCK=COLLECT_BLOCK, num_warps=4)
        return out
    seq = int(h.seq[0])
    kind, t0 = int(h.balance[0]), time.perf_counter_ns()
    late = kind and not cpu_moe.answered(h.box.result, seq)
    if not cpu_moe.wait_answer(h.box.result, seq, timeout_s=10.0):
        raise RuntimeError("the CPU expert worker did not answer within 10 s; it may have stopped")
    if kind:
        t1 = time.perf_counter_ns()
        base = 1 + 4 * (kind - 1)
        h.balance[base:base + 4] += torch.tensor([1, int(late), round((t1 - t0) / 1e3) if late else 0,
                                       round((t1 - int(h.stamp[0])) / 1e3)], dtype=h.balance.dtype)
    T = min(T, int(live[0]))
    if int(h.box.result[1]) > 0:
        out[:T].copy_((out[:T].float() + h.box.rows[:T * H].view(T, H)).to(out.dtype))
    return out
