"""The paged KV cache's two device operations in plain torch: writing a step's keys and values into
their blocks, and one decode token's attention over its row's blocks. The spec of
`paged_attention_triton.py`, and the CPU path.

Layout: pools (num_blocks, block_size, kv_heads, head_dim); `tables` (rows, max_blocks) int32 names
the block holding each row's positions p in block_size-sized runs (entry p // block_size, offset
p % block_size).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def paged_slots(tables: Tensor, rows: Tensor, positions: Tensor, block_size: int) -> Tensor:
    """Flat pool slots (same shape as rows / positions, long) of rows[i]'s position positions[i]."""
    blocks = tables[rows, positions // block_size].long()
    return blocks * block_size + positions % block_size


def paged_kv_write_reference(k: Tensor, v: Tensor, k_pool: Tensor, v_pool: Tensor, tables: Tensor,
                             rows: Tensor, positions: Tensor) -> None:
    """k, v (B, L, kv_heads, D) into the pools at rows (B, L) / positions (B, L)."""
    slots = paged_slots(tables, rows, positions, k_pool.shape[1])
    k_pool.view(-1, *k_pool.shape[2:])[slots] = k.to(k_pool.dtype)
    v_pool.view(-1, *v_pool.shape[2:])[slots] = v.to(v_pool.dtype)


def paged_decode_attention_reference(q: Tensor, k_pool: Tensor, v_pool: Tensor, tables: Tensor, seq_lens: Tensor,
                                     scale: float | None = None) -> Tensor:
    """Attention of one query per row over that row's first seq_lens[b] positions.

    q (B, heads, D); tables (B, max_blocks) the batch's table rows; seq_lens (B,) long, at least 1.
    Returns (B, heads, D) in q's dtype. Every table entry is gathered, the positions past a row's
    length masked: simple, and far more reading than the kernel does."""
    B, heads, D = q.shape
    kv_heads = k_pool.shape[2]
    blocks = tables.long()
    keys = k_pool[blocks].view(B, -1, kv_heads, D).transpose(1, 2)
    values = v_pool[blocks].view(B, -1, kv_heads, D).transpose(1, 2)
    held = torch.arange(keys.shape[2], device=q.device)[None, :] < seq_lens[:, None]
    bias = torch.zeros(held.shape, dtype=q.dtype, device=q.device).masked_fill_(~held, float("-inf"))
    out = F.scaled_dot_product_attention(q[:, :, None], keys.to(q.dtype), values.to(q.dtype),
                                         attn_mask=bias[:, None, None, :], scale=scale,
                                         enable_gqa=heads != kv_heads)
    return out[:, :, 0]
