"""Align (token, position) pairs by bank slot for the grouped GEMM of `fused_moe`, on the device.

The pairs are grouped by slot and each group is padded to a multiple of BLOCK_M, so that every
M-block of the grouped GEMM belongs to one slot. Pairs whose slot is -1 or out of range go to a
trailing "unrouted" group (index S) whose blocks are tagged -1. Every size comes from host-known
shapes (T*k, S, BLOCK_M), so nothing is read back and the result can be captured in a graph.

Two implementations with bit-identical outputs:

* `moe_align_block_size` — one Triton launch (`_moe_align_kernel`), at most `_MAX_PROGRAMS`
  programs, each owning a contiguous range of pairs. Every program histograms all pairs (in
  HIST_CHUNK steps) to get the padded group starts, and the pairs before its range to get each
  group's running offset; it then walks its range in CHUNK steps, and a pair's row is
  `padded_start[g] + earlier_in_g + rank_in_chunk`: the same stable order as a sort. The same
  programs then tag the blocks and write the padding rows (disjoint from the pair rows, so no
  ordering between programs is needed). Each program's work is O(T*k) cheap histogram steps
  (T*k = 16384 is 16 steps), so the launch should cost a few microseconds (not measured yet).
* `moe_align_block_size_torch` — ~20 small torch launches (sort, searchsorted, cumsum,
  scatter); the spec the kernel is tested against, and a fallback (`USE_TRITON_ALIGN`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["moe_align_block_size", "moe_align_block_size_torch", "align_num_blocks"]

# Set to False to route the grouped path through the torch version (debugging aid).
USE_TRITON_ALIGN = True

_CHUNK_CELLS = 16384        # CHUNK * BINS cap for the one-hot gather (registers per program)
_HIST_CHUNK = 1024
_BLOCKS_PER_STEP = 8
_MAX_PROGRAMS = 128         # about one per SM; larger T*k gives each program several chunks


def align_num_blocks(num_pairs: int, num_slots: int, block_m: int) -> int:
    """Host-side upper bound on the M-blocks: T*k rows plus up to BLOCK_M-1 padding per group."""
    num_groups = num_slots + 1                      # group num_slots collects unrouted pairs
    max_rows = num_pairs + min(num_groups, num_pairs) * (block_m - 1)
    return triton.cdiv(max_rows, block_m)


def moe_align_block_size_torch(slot_ids: Tensor, num_slots: int,
                               block_m: int) -> tuple[Tensor, Tensor]:
    """Torch version of `moe_align_block_size` (same contract, same output bit for bit).

    torch.bincount is avoided on purpose (on CUDA it reads the maximum back to size its
    output); the group sizes come from searchsorted on the sorted slots instead.
    """
    device = slot_ids.device
    num_pairs = slot_ids.numel()
    num_groups = num_slots + 1
    num_blocks = align_num_blocks(num_pairs, num_slots, block_m)

    key = slot_ids.reshape(-1).to(torch.int64)
    key = key.masked_fill((key < 0) | (key >= num_slots), num_slots)
    sorted_key, order = torch.sort(key, stable=True)

    # bounds[g] = first sorted position of group g; bounds[num_groups] = num_pairs.
    bounds = torch.searchsorted(sorted_key, torch.arange(num_groups + 1, device=device))
    counts = bounds[1:] - bounds[:-1]
    padded = (counts + (block_m - 1)) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded

    # Sorted position p of group g goes to padded row padded_start[g] + (p - bounds[g]).
    shift = padded_start - bounds[:-1]
    dest = shift[sorted_key] + torch.arange(num_pairs, device=device)
    pair_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    pair_ids.scatter_(0, dest, order.to(torch.int32))

    block_start = torch.arange(num_blocks, device=device) * block_m
    block_slot = torch.searchsorted(padded_end, block_start, right=True)
    block_slot = torch.where(block_slot < num_slots, block_slot, -1).to(torch.int32)
    return pair_ids, block_slot


@triton.jit
def _group_keys(slot_ptr, pair, num_pairs, num_slots, top_k, stride_st, stride_sj,
                BINS: tl.constexpr):
    """Group of each pair: its slot, num_slots when unrouted, BINS-1 (a dummy) past the end."""
    in_range = pair < num_pairs
    slot = tl.load(slot_ptr + (pair // top_k) * stride_st + (pair % top_k) * stride_sj,
                   mask=in_range, other=-1)
    routed = (slot >= 0) & (slot < num_slots)
    key = tl.where(routed, slot, num_slots).to(tl.int32)
    return tl.where(in_range, key, BINS - 1)


@triton.jit(do_not_specialize=["num_pairs", "num_slots", "num_blocks", "pairs_per_program"])
def _moe_align_kernel(
    slot_ptr, pair_ids_ptr, block_slot_ptr,
    num_pairs, num_slots, top_k, num_blocks, pairs_per_program, stride_st, stride_sj,
    BLOCK_M: tl.constexpr, BINS: tl.constexpr, CHUNK: tl.constexpr, HIST_CHUNK: tl.constexpr,
    BLOCKS_PER_STEP: tl.constexpr,
):
    """See the module docstring. BINS >= num_slots + 2: groups 0..S, then the dummy bin.

    pairs_per_program is a multiple of CHUNK.
    """
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    bins = tl.arange(0, BINS)
    my_first = pid * pairs_per_program

    # 1. Group sizes over all pairs, and over the pairs before this program's chunk.
    hist_lane = tl.arange(0, HIST_CHUNK)
    total = tl.zeros((BINS,), dtype=tl.int32)
    before = tl.zeros((BINS,), dtype=tl.int32)
    for first in range(0, num_pairs, HIST_CHUNK):
        pair = first + hist_lane
        key = _group_keys(slot_ptr, pair, num_pairs, num_slots, top_k, stride_st, stride_sj,
                          BINS)
        total += tl.histogram(key, BINS)
        before += tl.histogram(tl.where(pair < my_first, key, BINS - 1), BINS)
    is_group = bins <= num_slots
    padded = tl.where(is_group, (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    padded_end = tl.cumsum(padded, axis=0)
    padded_start = padded_end - padded

    # 2. This program's pairs, CHUNK at a time: row = next free row of the group + rank among
    #    the equal keys earlier in the chunk.
    lane = tl.arange(0, CHUNK)
    next_free = padded_start + before
    my_end = tl.minimum(my_first + pairs_per_program, num_pairs)
    for first in range(my_first, my_end, CHUNK):
        pair = first + lane
        key = _group_keys(slot_ptr, pair, my_end, num_slots, top_k, stride_st, stride_sj, BINS)
        one_hot = key[:, None] == bins[None, :]
        base = tl.sum(tl.where(one_hot, next_free[None, :], 0), axis=1)
        earlier_same = (key[:, None] == key[None, :]) & (lane[None, :] < lane[:, None])
        rank = tl.sum(earlier_same.to(tl.int32), axis=1)
        tl.store(pair_ids_ptr + base + rank, pair, mask=pair < my_end)
        next_free += tl.sum(one_hot.to(tl.int32), axis=0)

    # 3. Blocks pid, pid + P, ... (in steps of BLOCKS_PER_STEP): slot tag, and padding rows.
    blk_lane = tl.arange(0, BLOCKS_PER_STEP)
    row_lane = tl.arange(0, BLOCK_M)
    for first_blk in range(pid * BLOCKS_PER_STEP, num_blocks, num_programs * BLOCKS_PER_STEP):
        blk = first_blk + blk_lane
        blk_mask = blk < num_blocks
        start = blk * BLOCK_M
        # group = number of groups that end at or before the block's first row (searchsorted)
        group = tl.sum((padded_end[None, :] <= start[:, None]).to(tl.int32), axis=1)
        tl.store(block_slot_ptr + blk, tl.where(group < num_slots, group, -1), mask=blk_mask)
        in_group = group[:, None] == bins[None, :]
        group_start = tl.sum(tl.where(in_group, padded_start[None, :], 0), axis=1)
        group_size = tl.sum(tl.where(in_group & is_group[None, :], total[None, :], 0), axis=1)
        local = start[:, None] - group_start[:, None] + row_lane[None, :]
        is_padding = (local >= group_size[:, None]) & blk_mask[:, None]
        rows = start[:, None] + row_lane[None, :]
        tl.store(pair_ids_ptr + rows, tl.zeros_like(rows) + num_pairs, mask=is_padding)


def moe_align_block_size(slot_ids: Tensor, num_slots: int, block_m: int) -> tuple[Tensor, Tensor]:
    """Group the (token, position) pairs by slot, each group padded to a multiple of block_m.

    One Triton launch, no host sync (see the module docstring); falls back to
    `moe_align_block_size_torch` when `USE_TRITON_ALIGN` is False.

    Args:
        slot_ids: (T, k) int slot per pair; -1 or any value outside [0, num_slots) = unrouted.
        num_slots: S, the bank's slot count.
        block_m: rows per M-block of the grouped GEMM (a power of two).

    Returns:
        pair_ids: (num_blocks * block_m,) int32 flat pair index (t*k + j) per padded row;
            padding rows hold T*k (out of range: the kernels mask them).
        block_slot: (num_blocks,) int32 slot of each M-block; -1 for the unrouted group and for
            the unused tail blocks of the upper bound.
    """
    num_pairs = slot_ids.numel()
    if not USE_TRITON_ALIGN or num_pairs == 0 or slot_ids.dim() != 2:
        return moe_align_block_size_torch(slot_ids, num_slots, block_m)
    device = slot_ids.device
    num_blocks = align_num_blocks(num_pairs, num_slots, block_m)
    pair_ids = torch.empty((num_blocks * block_m,), dtype=torch.int32, device=device)
    block_slot = torch.empty((num_blocks,), dtype=torch.int32, device=device)
    bins = triton.next_power_of_2(num_slots + 2)
    chunk = max(16, min(128, _CHUNK_CELLS // bins))
    chunks_per_program = triton.cdiv(triton.cdiv(num_pairs, chunk), _MAX_PROGRAMS)
    pairs_per_program = chunks_per_program * chunk
    grid = (triton.cdiv(num_pairs, pairs_per_program),)
    _moe_align_kernel[grid](
        slot_ids, pair_ids, block_slot,
        num_pairs, num_slots, slot_ids.shape[1], num_blocks, pairs_per_program,
        slot_ids.stride(0), slot_ids.stride(1),
        BLOCK_M=block_m, BINS=bins, CHUNK=chunk, HIST_CHUNK=_HIST_CHUNK,
        BLOCKS_PER_STEP=_BLOCKS_PER_STEP, num_warps=4,
    )
    return pair_ids, block_slot
