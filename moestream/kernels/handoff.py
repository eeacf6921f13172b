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

import functools
import time
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from moestream.kernels import cpu_moe
from moestream.kernels.cpu_moe import Mailbox
from moestream.kernels.moe_reference import split_outside

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


@functools.cache
def _device_kernels():
    """The hand-off's Triton kernels and their launches (`handoff_triton.py`), imported at the first
    post or collect on a CUDA device: the CPU path, and every process that imports this module without
    launching (a follower rank, the CLI, the tests), never loads Triton."""
    from moestream.kernels import handoff_triton

    return handoff_triton


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
        if cpu_take is not None and cpu_cut is None:
            raise ValueError("a split post needs its cut table too (zeros where no pair is shared)")
        _device_kernels().post(h, hidden, ids, weights, source_map, num_slots, live, cpu_take, cpu_cut, POST_BLOCK)
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
        _device_kernels().collect(h, out, error, live, MAX_POLLS, COLLECT_BLOCK)
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
