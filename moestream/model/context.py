"""Everything one forward pass shares across layers: positions, rotary cos/sin, cache addressing, mask.

Built once per step by the runtime, from device tensors and host-known sizes, so that no layer
needs to look at a tensor's value on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moestream.model.cache import ModelCache


@dataclass
class ForwardContext:
    positions: torch.Tensor                 # (B, L) absolute positions
    cos: torch.Tensor                       # (B, 1, L, D) in compute dtype
    sin: torch.Tensor
    mask: torch.Tensor | None               # (B, 1, L, S) bool, True = attend
    cache: ModelCache | None = None
    cache_rows: slice | torch.Tensor | None = None   # rows of the cache this batch uses (a slice, or a device
                                                     # index: a captured prompt chunk's row is read on the device)
    write_rows: torch.Tensor | None = None  # (B, L) cache row of every token
    kv_len: int = 0                         # cache positions attended to (host-known)
    valid: torch.Tensor | None = None       # (B, L) bool, False at padding: no-cache batches only, so that
                                            # recurrent mixers keep padded tokens out of their state
    attn_bias: torch.Tensor | None = None   # the mask as SDPA's additive bias (0 / -inf, compute dtype),
                                            # built once per forward instead of by SDPA in every layer
    seq_lens: torch.Tensor | None = None    # decode: (B,) positions attended per row (its position + 1),
                                            # for attention that reads each row to its own length

    def __post_init__(self):
        if self.attn_bias is None and self.mask is not None:
            self.attn_bias = torch.zeros(self.mask.shape, dtype=self.cos.dtype, device=self.mask.device).masked_fill_(
                ~self.mask, float("-inf"))


def _rotary(table: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor, dtype: torch.dtype):
    cos, sin = table
    return cos[positions].unsqueeze(1).to(dtype), sin[positions].unsqueeze(1).to(dtype)


def no_cache_context(table, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, dtype: torch.dtype) -> ForwardContext:
    """A whole batch at once, no cache: causal attention that ignores padded keys."""
    B, L = input_ids.shape
    device = input_ids.device
    if attention_mask is None:
        attention_mask = torch.ones(B, L, dtype=torch.long, device=device)
    valid = attention_mask.bool()
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    idx = torch.arange(L, device=device)
    causal = idx[None, :] <= idx[:, None]
    mask = causal[None] & valid[:, None, :]
    mask = mask | torch.eye(L, dtype=torch.bool, device=device)[None]  # padded queries attend to themselves: no NaN
    cos, sin = _rotary(table, positions, dtype)
    return ForwardContext(positions, cos, sin, mask.unsqueeze(1), valid=valid)


def prefill_context(table, cache: ModelCache, row: int, start: int, length: int, dtype: torch.dtype) -> ForwardContext:
    """One chunk of one sequence's prompt, at cache positions start..start+length-1 of `row`."""
    device = cache.device
    positions = torch.arange(start, start + length, device=device)[None]
    kv_len = start + length
    mask = torch.arange(kv_len, device=device)[None, :] <= positions[0][:, None]
    cos, sin = _rotary(table, positions, dtype)
    rows = torch.full_like(positions, row)
    return ForwardContext(positions, cos, sin, mask[None, None], cache, slice(row, row + 1), rows, kv_len)


def graph_prefill_context(table, cache: ModelCache, meta: torch.Tensor, length: int, kv_len: int,
                          dtype: torch.dtype) -> ForwardContext:
    """One sequence's prompt chunk padded to `length` tokens and addressed on the device, so a CUDA graph
    replays it for any row and start: `meta` = (row, start, n) long. Tokens n.. are padding past the
    chunk's end: no real query attends to them (each attends to positions up to its own), and their keys
    and values land past the sequence's length in its own row (a paged row's own blocks, or the null
    block past them), where the next write of those positions replaces them before anything reads them.
    `kv_len` >= start + n positions are read; the caller keeps start + length within the cache."""
    device = cache.device
    row = meta[0:1]
    positions = (meta[1] + torch.arange(length, device=device))[None]
    mask = torch.arange(kv_len, device=device)[None, :] <= positions[0][:, None]
    cos, sin = _rotary(table, positions, dtype)
    rows = row.view(1, 1).expand(1, length).contiguous()
    return ForwardContext(positions, cos, sin, mask[None, None], cache, row, rows, kv_len)


def decode_context(table, cache: ModelCache, positions: torch.Tensor, kv_len: int, dtype: torch.dtype,
                   rows: torch.Tensor | None = None) -> ForwardContext:
    """One new token for each of the first B rows; positions (B,) live on the device. `rows` (B, 1):
    the cache row each token writes to (default: its own, 0..B-1); a batch padded to a captured size
    sends its padding to a scratch row, so that it never writes into another sequence's row."""
    B = positions.shape[0]
    device = positions.device
    pos = positions[:, None]
    mask = torch.arange(kv_len, device=device)[None, :] <= pos
    cos, sin = _rotary(table, pos, dtype)
    if rows is None:
        rows = torch.arange(B, device=device)[:, None]
    return ForwardContext(pos, cos, sin, mask[:, None, None, :], cache, slice(0, B), rows, kv_len,
                          seq_lens=positions + 1)
