"""The paged KV cache on CUDA: one launch writes a step's keys and values into their blocks, and
decode attention reads each row's blocks in place (flash-decoding), in Triton.

Decode attention is split along the positions: program (b, kv head, split) walks its split's
positions of row b in tiles, looking each tile's blocks up in the row's table, and keeps an online
softmax for all the query heads of its kv head at once (GQA: the group's queries are one matrix,
so each key and value is read once per kv head, not once per query head). It reads only the row's
own length (`seq_lens`), never a padded bucket, and needs no mask. A second launch merges the
splits by their log-sum-exp. The number of splits is chosen from a host-known bound on the length,
so a CUDA graph captured for a length bucket replays with any shorter rows. The split buffers' width
depends on the batch and the kv heads alone, never on that bound, and the merge walks the splits in
tiles of a runtime count: decode at a new length bucket compiles nothing.

The spec is `paged_attention_reference.py`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, release_consumer, wait_for_producer

_PROGRAMS = 264          # ~2 per SM of an H100: enough splits to fill the GPU at batch 1
_TILE = 64               # positions per tile
_MERGE_TILE = 16         # splits the merge reads at a time


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, kp_ptr, vp_ptr, tables_ptr, rows_ptr, pos_ptr,
                     stride_k, stride_v, stride_table, stride_block, stride_pos,
                     HD: tl.constexpr, HD_PAD: tl.constexpr, BS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    block = tl.load(tables_ptr + row * stride_table + pos // BS).to(tl.int64)
    dst = block * stride_block + (pos % BS) * stride_pos
    i = tl.arange(0, HD_PAD)
    m = i < HD
    tl.store(kp_ptr + dst + i, tl.load(k_ptr + t * stride_k + i, mask=m).to(kp_ptr.dtype.element_ty), mask=m)
    tl.store(vp_ptr + dst + i, tl.load(v_ptr + t * stride_v + i, mask=m).to(vp_ptr.dtype.element_ty), mask=m)


def paged_kv_write(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                   tables: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> None:
    """k, v (B, L, kv_heads, D) into the pools at rows / positions (B, L); see the reference."""
    B, L, kv_heads, D = k.shape
    k2, v2 = (x.reshape(B * L, kv_heads * D) for x in (k, v))   # a view where (kv_heads, D) are packed
    k2, v2 = (x if x.stride(-1) == 1 else x.contiguous() for x in (k2, v2))
    rows, positions = rows.reshape(-1).contiguous(), positions.reshape(-1).contiguous()
    HD = kv_heads * D
    _kv_write_kernel[(B * L,)](k2, v2, k_pool, v_pool, tables, rows, positions, k2.stride(0), v2.stride(0),
                               tables.stride(0), k_pool.stride(0), k_pool.stride(1), HD=HD,
                               HD_PAD=triton.next_power_of_2(HD), BS=k_pool.shape[1], num_warps=4)


@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, o_ptr, lse_ptr, scale, split_len,
                         stride_qb, stride_qh, stride_block, stride_pos, stride_kvh, stride_table,
                         stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                         G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                         BS: tl.constexpr, TILE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         USE_PDL: tl.constexpr):
    wait_for_producer(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    heads = kvh * G + g
    d_ok = d < D
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=(g[:, None] < G) & d_ok[None, :], other=0.0)
    m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, D_PAD), tl.float32)
    for n0 in range(start, end, TILE):
        n = n0 + tl.arange(0, TILE)
        valid = n < end
        block = tl.load(tables_ptr + b * stride_table + n // BS, mask=valid, other=0).to(tl.int64)
        offs = block * stride_block + (n % BS) * stride_pos + kvh * stride_kvh
        kv_mask = valid[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    release_consumer(USE_PDL)
    held = l_i > 0   # an empty split (past the row's length) leaves lse at -inf and weighs nothing
    out = tl.where(held[:, None], acc / tl.where(held, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(held, m_i + tl.log(tl.where(held, l_i, 1.0)), float("-inf"))
    g_ok = g < G
    tl.store(o_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :], out,
             mask=g_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=g_ok)


@triton.jit(do_not_specialize=["splits"])
def _decode_merge_kernel(o_ptr, lse_ptr, out_ptr, splits, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                         stride_outb, stride_outh, D: tl.constexpr, D_PAD: tl.constexpr, S_TILE: tl.constexpr,
                         USE_PDL: tl.constexpr):
    """out[b, h] = the splits' outputs weighted by exp(lse - max lse), S_TILE splits at a time in one pass
    (a running maximum rescales what is summed so far), so one variant serves every split count and the
    splits are read once."""
    wait_for_producer(USE_PDL)
    release_consumer(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    lse_row = lse_ptr + b * stride_lb + h * stride_lh
    o_row = o_ptr + b * stride_ob + h * stride_oh
    top = tl.full([], float("-inf"), tl.float32)
    acc = tl.zeros([D_PAD], dtype=tl.float32)
    total = tl.full([], 0.0, tl.float32)
    for first in range(0, splits, S_TILE):   # split 0 always holds position 0: `top` is finite after it
        s = first + tl.arange(0, S_TILE)
        s_ok = s < splits
        lse = tl.load(lse_row + s, mask=s_ok, other=float("-inf"))
        o = tl.load(o_row + s[:, None] * stride_os + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        new_top = tl.maximum(top, tl.max(lse, axis=0))
        rescale = tl.exp(top - new_top)
        w = tl.exp(lse - new_top)
        acc = acc * rescale + tl.sum(w[:, None] * o, axis=0)
        total = total * rescale + tl.sum(w, axis=0)
        top = new_top
    tl.store(out_ptr + b * stride_outb + h * stride_outh + d, (acc / total).to(out_ptr.dtype.element_ty), mask=d_ok)


def most_splits(batch: int, kv_heads: int) -> int:
    """The most splits a launch of `batch` rows takes at any length: the split buffers' width, so their
    strides stay the same from one length bucket to the next (a served decode that reached a longer
    context compiled a merge variant per bucket, a stall mid-stream)."""
    return max(1, -(-_PROGRAMS // (batch * kv_heads)))


def split_length(batch: int, kv_heads: int, max_len: int) -> int:
    """Positions per split: enough splits to give the GPU ~_PROGRAMS programs, whole tiles each."""
    tiles = -(-max_len // _TILE)
    splits = min(tiles, most_splits(batch, kv_heads))
    return -(-tiles // splits) * _TILE


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                           seq_lens: torch.Tensor, max_len: int, scale: float | None = None) -> torch.Tensor:
    """(B, heads, D) attention of one query per row over its first seq_lens[b] positions (at most
    `max_len`, a host-known bound that sizes the splits); see the reference."""
    B, heads, D = q.shape
    kv_heads = k_pool.shape[2]
    G = heads // kv_heads
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_pool.stride(-1) != 1 or k_pool.stride(-2) != D or v_pool.stride() != k_pool.stride():
        raise ValueError("the KV pools must be (blocks, block_size, kv_heads, head_dim), packed alike")
    split_len = split_length(B, kv_heads, max_len)
    splits, width = -(-max_len // split_len), most_splits(B, kv_heads)
    o = torch.empty((B, heads, width, D), dtype=torch.float32, device=q.device)
    lse = torch.empty((B, heads, width), dtype=torch.float32, device=q.device)
    out = torch.empty((B, heads, D), dtype=q.dtype, device=q.device)
    scale = D ** -0.5 if scale is None else scale
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    D_PAD = max(16, triton.next_power_of_2(D))
    _decode_split_kernel[(B, kv_heads, splits)](
        q, k_pool, v_pool, tables, seq_lens, o, lse, scale, split_len,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), tables.stride(0),
        o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1),
        G=G, G_PAD=max(16, triton.next_power_of_2(G)), D=D, D_PAD=D_PAD, BS=k_pool.shape[1], TILE=_TILE,
        DOT_PRECISION=precision, num_warps=4, **pdl_args(q))
    _decode_merge_kernel[(B, heads)](o, lse, out, splits, o.stride(0), o.stride(1), o.stride(2), lse.stride(0),
                                     lse.stride(1), out.stride(0), out.stride(1), D=D, D_PAD=D_PAD,
                                     S_TILE=_MERGE_TILE, num_warps=4, **pdl_args(q))
    return out
