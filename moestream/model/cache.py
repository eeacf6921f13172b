"""Per-sequence caches: one entry per layer, of the kind that layer's mixer needs.

A `ModelCache` holds, for a fixed number of batch rows, one layer cache per decoder layer; each
mixer class says which kind it needs (`make_cache`) and what it costs (`cache_bytes`), so the
memory plan and the runtime never assume one KV layout. Kinds today:

  KVCache   GQA keys and values, preallocated (rows, max_len, kv_heads, head_dim); slot j of row b
            holds position j of the sequence in row b, so sequences of different lengths share a
            batch and a row is written in place. Read as a paged pool whose blocks are whole rows
            (`RowBlocks`), a CUDA decode step attends from it with the paged kernels too.
  RecurrentCache  linear attention (Gated DeltaNet): per row the last conv inputs and the state
            matrices, a fixed size whatever the context; kept twice, by parity of the tokens
            consumed, so that a step never overwrites the state it reads.
  LatentCache  multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash): per row and position
            the compressed kv (kv_lora_rank, after its norm) and the rotated rope key shared by all
            heads, (rows, max_len, kv_lora_rank + qk_rope_head_dim): a fraction of full K/V.

  PagedKVCache  GQA keys and values in fixed-size blocks of a pool shared by every row: row b's
            position p lives in block `tables[b, p // block_size]` at offset p % block_size. A row
            holds only the blocks its length needs, and rows share full blocks of a common prefix (the
            runtime's `BlockManager` hands blocks out and counts their users); moving a row moves its
            table row, never its keys and values. Block 0 is never handed out: a padding row and
            every unfilled table entry point at it, so stray writes land there.

  RingKVCache  sliding-window attention (GPT-OSS's sliding layers): per row only the last `size`
            positions' keys and values, position p in slot p % size, so memory does not grow with
            the context; a step reads the ring as it was before the step and writes after.

Every kind can copy
one row to another (`move_row`: the scheduler keeps running sequences in the first rows) and
snapshot a row's first positions into a compact, standalone copy and restore it into any row
(`snapshot` / `restore`): the runtime's prefix cache keeps finished conversations that way. A
kind whose state cannot be cut at an arbitrary position (a recurrent state) answers
`can_cut = False`, and then only whole snapshots are reused.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import Tensor

from moestream import kernels
from moestream.model.rotary import norm_and_rotate


class LayerCache(ABC):
    """One layer's cache for `rows` sequences."""

    kind: str

    @abstractmethod
    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy what row `src` holds for its first `length` positions into row `dst`."""

    @abstractmethod
    def copy_rows_from(self, other: "LayerCache", rows: int) -> None:
        """Take over the first `rows` rows of a smaller cache of the same kind (the cache grew)."""

    can_cut = True   # a snapshot of n positions also serves any shorter prefix

    @abstractmethod
    def snapshot(self, row: int, length: int) -> tuple[Tensor, ...]:
        """A standalone copy of what row `row` holds for its first `length` positions."""

    @abstractmethod
    def restore(self, row: int, state: tuple[Tensor, ...], length: int) -> None:
        """Write the first `length` positions of a snapshot into row `row`."""


class RowBlocks:
    """A rows cache's block table: block r is row r, whole (block size = the row's length), so the
    paged decode kernels (rotary and write in one launch, flash-decoding from the row in place) serve
    a `KVCache` exactly as they serve a `PagedKVCache`, instead of SDPA over a masked, padded copy."""

    def __init__(self, rows: int, max_len: int, device: torch.device):
        self.block_size = max_len
        self.table = torch.arange(rows, dtype=torch.int32, device=device)[:, None]


class KVCache(LayerCache):
    kind = "kv"

    def __init__(self, rows: int, max_len: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        self.k = torch.zeros(rows, max_len, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.tables = RowBlocks(rows, max_len, device)

    @staticmethod
    def bytes_per_token(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def write(self, rows: Tensor, positions: Tensor, k: Tensor, v: Tensor) -> None:
        """rows, positions: (B, L) long; k, v: (B, L, kv_heads, head_dim)."""
        self.k[rows, positions] = k
        self.v[rows, positions] = v

    def read(self, rows: slice, kv_len: int) -> tuple[Tensor, Tensor]:
        """Views (B, kv_heads, kv_len, head_dim) over the first kv_len positions of `rows`."""
        return self.k[rows, :kv_len].transpose(1, 2), self.v[rows, :kv_len].transpose(1, 2)

    def move_row(self, src: int, dst: int, length: int) -> None:
        self.k[dst, :length].copy_(self.k[src, :length])
        self.v[dst, :length].copy_(self.v[src, :length])

    def copy_rows_from(self, other: LayerCache, rows: int) -> None:
        self.k[:rows].copy_(other.k[:rows])
        self.v[:rows].copy_(other.v[:rows])

    def snapshot(self, row: int, length: int) -> tuple[Tensor, ...]:
        return self.k[row, :length].clone(), self.v[row, :length].clone()

    def restore(self, row: int, state: tuple[Tensor, ...], length: int) -> None:
        k, v = state
        self.k[row, :length].copy_(k[:length])
        self.v[row, :length].copy_(v[:length])


class BlockTables:
    """Per row, the pool blocks that hold its positions: (rows, max_blocks) int32 on the device (0 =
    the null block), shared by every paged layer of a model. The engine writes the blocks the runtime's
    `BlockManager` hands out (`assign`); rows move (`move`) when the scheduler compacts them."""

    def __init__(self, rows: int, max_len: int, block_size: int, device: torch.device):
        self.block_size = block_size
        self.max_blocks = -(-max_len // block_size)
        self.table = torch.zeros(rows, self.max_blocks, dtype=torch.int32, device=device)

    def assign(self, row: int, blocks: list[int], start: int = 0) -> None:
        """Entries start.. of `row` become `blocks` (one small host-to-device copy)."""
        if blocks:
            self.table[row, start:start + len(blocks)].copy_(torch.tensor(blocks, dtype=torch.int32))

    def clear(self, row: int) -> None:
        self.table[row].zero_()

    def move(self, src: int, dst: int) -> None:
        self.table[dst].copy_(self.table[src])

    def copy_rows_from(self, other: "BlockTables", rows: int) -> None:
        self.table[:rows].copy_(other.table[:rows])


class PagedKVCache(LayerCache):
    """GQA keys and values in a pool of blocks (num_blocks, block_size, kv_heads, head_dim), addressed
    through the model's `BlockTables`: the same `write` / `read` as `KVCache`, so every full-KV mixer
    works on either. Reading gathers the attended positions of each row into one contiguous tensor;
    on CUDA the decode step attends straight from the blocks instead (`kernels/paged_attention`)."""

    kind = "paged"

    def __init__(self, tables: BlockTables, num_blocks: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, pool: tuple[Tensor, Tensor] | None = None):
        self.tables, self.block_size = tables, tables.block_size
        if pool is None:
            shape = (num_blocks, self.block_size, num_kv_heads, head_dim)
            pool = (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        self.k, self.v = pool

    @staticmethod
    def bytes_per_block(block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return block_size * KVCache.bytes_per_token(num_kv_heads, head_dim, dtype)

    def write(self, rows: Tensor, positions: Tensor, k: Tensor, v: Tensor) -> None:
        kernels.paged_kv_write(k, v, self.k, self.v, self.tables.table, rows, positions)

    def read(self, rows: slice, kv_len: int) -> tuple[Tensor, Tensor]:
        """(B, kv_heads, kv_len, head_dim) copies of the first kv_len positions of `rows`."""
        blocks = self.tables.table[rows, :-(-kv_len // self.block_size)].long()
        B = blocks.shape[0]

        def gather(pool: Tensor) -> Tensor:
            return pool[blocks].view(B, -1, *pool.shape[2:])[:, :kv_len].transpose(1, 2)

        return gather(self.k), gather(self.v)

    # Rows are table rows: moving or growing them is the tables' business, and a prefix is shared by
    # pointing at its blocks, never snapshotted.
    def move_row(self, src: int, dst: int, length: int) -> None:
        pass

    def copy_rows_from(self, other: LayerCache, rows: int) -> None:
        pass

    def snapshot(self, row: int, length: int) -> tuple[Tensor, ...]:
        raise NotImplementedError("a paged cache shares prefix blocks instead of snapshotting rows")

    def restore(self, row: int, state: tuple[Tensor, ...], length: int) -> None:
        raise NotImplementedError("a paged cache shares prefix blocks instead of restoring rows")


class RecurrentCache(LayerCache):
    """A linear-attention layer's state for `rows` sequences: the last K-1 inputs of its causal conv
    (conv_shape = (K-1, channels), compute dtype) and its recurrent state (state_shape, fp32 as the
    delta rule computes it). Its size does not depend on the context length.

    Each row keeps two copies, addressed by the parity of the number of tokens consumed: the state
    after n tokens lives in slot n % 2. A step over positions s..e-1 reads slot s % 2 and writes
    slot e % 2, so it never overwrites what it reads: running one decode step twice (a CUDA graph's
    warm-up, then its replay) leaves the state of running it once. A row starting a sequence
    (s = 0) reads zeros, whatever an earlier sequence left in it. Everything is addressed on the
    device (rows and positions are tensors): nothing is read back.

    The state after n tokens cannot give the state after fewer, so `can_cut` is False: a snapshot
    is only reused whole (by a prompt that extends exactly those n tokens).
    """

    kind = "recurrent"
    can_cut = False

    def __init__(self, rows: int, conv_shape: tuple[int, ...], state_shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, state_dtype: torch.dtype = torch.float32):
        self.conv = torch.zeros(rows, 2, *conv_shape, dtype=dtype, device=device)
        self.state = torch.zeros(rows, 2, *state_shape, dtype=state_dtype, device=device)

    @staticmethod
    def bytes_per_row(conv_shape: tuple[int, ...], state_shape: tuple[int, ...], dtype: torch.dtype,
                      state_dtype: torch.dtype = torch.float32) -> int:
        """Both parity copies of the conv inputs and of the state."""
        conv, state = math.prod(conv_shape), math.prod(state_shape)
        return 2 * (conv * torch.empty((), dtype=dtype).element_size()
                    + state * torch.empty((), dtype=state_dtype).element_size())

    def read(self, rows: Tensor, start: Tensor) -> tuple[Tensor, Tensor]:
        """(conv inputs, state) of row rows[b] before its position start[b]; zeros where start is 0.
        rows, start: (B,) long on the device."""
        slot, fresh = start % 2, start > 0

        def kept(x: Tensor) -> Tensor:   # where, not a product: stale NaNs in a reused row stay out
            return torch.where(fresh.view(-1, *[1] * (x.dim() - 1)), x, x.new_zeros(()))

        return kept(self.conv[rows, slot]), kept(self.state[rows, slot])

    def write(self, rows: Tensor, end: Tensor, conv: Tensor, state: Tensor) -> None:
        """Store row rows[b]'s conv inputs and state after its first end[b] tokens."""
        slot = end % 2
        self.conv[rows, slot] = conv.to(self.conv.dtype)
        self.state[rows, slot] = state.to(self.state.dtype)

    def move_row(self, src: int, dst: int, length: int) -> None:
        self.conv[dst].copy_(self.conv[src])
        self.state[dst].copy_(self.state[src])

    def copy_rows_from(self, other: LayerCache, rows: int) -> None:
        self.conv[:rows].copy_(other.conv[:rows])
        self.state[:rows].copy_(other.state[:rows])

    def snapshot(self, row: int, length: int) -> tuple[Tensor, ...]:
        """The state after the row's first `length` tokens (the runtime passes how many it consumed)."""
        return self.conv[row, length % 2].clone(), self.state[row, length % 2].clone()

    def restore(self, row: int, state: tuple[Tensor, ...], length: int) -> None:
        """Put a whole snapshot of `length` tokens back (a recurrent state is never cut shorter)."""
        conv, matrix = state
        self.conv[row, length % 2].copy_(conv)
        self.state[row, length % 2].copy_(matrix)


class LatentCache(LayerCache):
    """MLA's cache: for each row and position, the latent [compressed kv (rank) | rope key (rope_dim)]
    in one tensor (rows, max_len, rank + rope_dim), addressed like `KVCache` (slot j of row b holds
    position j). Keys and values are the latent expanded per head, so a prefix of positions is a
    valid cache on its own: it cuts anywhere (`can_cut`), as KV does."""

    kind = "latent"

    def __init__(self, rows: int, max_len: int, rank: int, rope_dim: int, dtype: torch.dtype, device: torch.device):
        self.rank = rank
        self.latent = torch.zeros(rows, max_len, rank + rope_dim, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_token(rank: int, rope_dim: int, dtype: torch.dtype) -> int:
        return (rank + rope_dim) * torch.empty((), dtype=dtype).element_size()

    def write(self, rows: Tensor, positions: Tensor, latent: Tensor) -> None:
        """rows, positions: (B, L) long; latent: (B, L, rank + rope_dim), the compressed kv (normalised)
        then the rope key (rotated)."""
        self.latent[rows, positions] = latent.to(self.latent.dtype)

    def read(self, rows: slice, kv_len: int) -> Tensor:
        """A view (B, kv_len, rank + rope_dim) over the first kv_len positions of `rows`: the caller
        splits it (or attends against it whole) without a copy."""
        return self.latent[rows, :kv_len]

    def move_row(self, src: int, dst: int, length: int) -> None:
        self.latent[dst, :length].copy_(self.latent[src, :length])

    def copy_rows_from(self, other: LayerCache, rows: int) -> None:
        self.latent[:rows].copy_(other.latent[:rows])

    def snapshot(self, row: int, length: int) -> tuple[Tensor, ...]:
        return (self.latent[row, :length].clone(),)

    def restore(self, row: int, state: tuple[Tensor, ...], length: int) -> None:
        self.latent[row, :length].copy_(state[0][:length])


class RingKVCache(LayerCache):
    """A sliding-window layer's keys and values: per row the last `size` positions (size = the
    window, or the context when shorter), position p in slot p % size.

    A step over positions s..s+L-1 of a row attends to the ring as it was before the step (slot j
    then holds position `slot_positions(s)[j]`, the last position below s congruent to j, or a
    negative one where the row has none yet) together with the step's own keys; only then are the
    last min(L, size) of those written (`write`). So a prompt chunk longer than the window still
    sees every key its window needs, a chunk boundary anywhere is exact, each row of a decode batch
    follows its own length, and a slot left over from an earlier sequence in the row is masked (its
    position is negative). Running a decode step twice (a CUDA graph's warm-up, then its replay)
    is harmless: the slot a step overwrites holds position s - size, outside the window of s.
    Everything is addressed on the device from the positions: no value is read back.

    A ring after n tokens no longer holds what a shorter prefix needs, so `can_cut` is False: a
    snapshot (the whole ring) is reused only for exactly those n tokens.
    """

    kind = "ring"
    can_cut = False

    def __init__(self, rows: int, size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        self.size = size
        self.k = torch.zeros(rows, size, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def slot_positions(self, start: Tensor) -> Tensor:
        """(B, size) long: the position slot j of row b holds before a step starting at start[b]
        ((B, 1) long): the last position below start[b] congruent to j mod size; negative where the
        row has written no such position (start[b] <= j)."""
        last = start - 1
        return last - torch.remainder(last - torch.arange(self.size, device=start.device), self.size)

    def read(self, rows: slice) -> tuple[Tensor, Tensor]:
        """Views (B, kv_heads, size, head_dim) of the whole ring of `rows`."""
        return self.k[rows].transpose(1, 2), self.v[rows].transpose(1, 2)

    def write(self, rows: Tensor, positions: Tensor, k: Tensor, v: Tensor) -> None:
        """rows, positions: (B, L) long; k, v: (B, L, kv_heads, head_dim). Only the last min(L, size)
        positions are kept (the earlier ones of a long chunk would be overwritten within the step)."""
        n = min(positions.shape[1], self.size)
        rows, slots = rows[:, -n:], torch.remainder(positions[:, -n:], self.size)
        self.k[rows, slots] = k[:, -n:]
        self.v[rows, slots] = v[:, -n:]

    def move_row(self, src: int, dst: int, length: int) -> None:
        self.k[dst].copy_(self.k[src])
        self.v[dst].copy_(self.v[src])

    def copy_rows_from(self, other: LayerCache, rows: int) -> None:
        self.k[:rows].copy_(other.k[:rows])
        self.v[:rows].copy_(other.v[:rows])

    def snapshot(self, row: int, length: int) -> tuple[Tensor, ...]:
        """The whole ring after the row's first `length` tokens (slots keep their position mod size,
        so it restores into any row)."""
        return self.k[row].clone(), self.v[row].clone()

    def restore(self, row: int, state: tuple[Tensor, ...], length: int) -> None:
        """Put a whole snapshot of `length` tokens back (a ring is never cut shorter)."""
        k, v = state
        self.k[row].copy_(k)
        self.v[row].copy_(v)


def attended_keys_values(ctx, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """What a full-KV mixer attends to, (B, kv_heads, S, D) each, from this step's keys and values
    (B, L, kv_heads, D): with a cache, this step written into its layer's cache and the first
    `kv_len` positions read back; without one (a full forward), this step's own."""
    if ctx.cache is None:
        return k.transpose(1, 2), v.transpose(1, 2)
    cache = ctx.cache[layer]
    cache.write(ctx.write_rows, ctx.positions, k, v)
    return cache.read(ctx.cache_rows, ctx.kv_len)


def _paged_decode_cache(ctx, layer: int, q: Tensor) -> PagedKVCache | KVCache | None:
    """This layer's full-KV cache when the step is a CUDA decode step that attends from its blocks (a
    rows cache's blocks are its rows, `RowBlocks`)."""
    cache = ctx.cache[layer] if ctx.cache is not None else None
    if isinstance(cache, (PagedKVCache, KVCache)) and ctx.seq_lens is not None and kernels.fused_ops_enabled(q):
        return cache
    return None


def _paged_decode(ctx, cache: PagedKVCache | KVCache, q: Tensor, scale: float | None) -> Tensor:
    out = kernels.paged_decode_attention(q[:, :, 0], cache.k, cache.v, cache.tables.table[ctx.cache_rows],
                                         ctx.seq_lens, ctx.kv_len, scale)
    return out[:, :, None]


def _one_fused_kind(q_norm, k_norm) -> bool:
    """Both norms absent, or both of one kind the fused kernels apply, with one epsilon."""
    if q_norm is None or k_norm is None:
        return q_norm is None and k_norm is None
    return q_norm.fused_scale is not None and q_norm.fused_scale == k_norm.fused_scale and q_norm.eps == k_norm.eps


def full_attention(ctx, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
    """Softmax attention (B, heads, L, D) of queries q (B, heads, L, D) over every earlier position,
    this step's keys and values (B, L, kv_heads, D) written first. A full-KV cache's (paged or
    rows) decode step on CUDA attends straight from its blocks, each row to its own length; otherwise SDPA over
    `attended_keys_values` with the step's mask."""
    cache = _paged_decode_cache(ctx, layer, q)
    if cache is not None:   # one launch writes k and v, into blocks or rows alike
        kernels.paged_kv_write(k, v, cache.k, cache.v, cache.tables.table, ctx.write_rows, ctx.positions)
        return _paged_decode(ctx, cache, q, scale)
    k, v = attended_keys_values(ctx, layer, k, v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=ctx.attn_bias, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def rotate_and_attend(ctx, layer: int, q: Tensor, k: Tensor, v: Tensor, q_norm, k_norm) -> Tensor:
    """Per-head q/k norm (`q_norm`/`k_norm`, or None) and rotary of q (B, L, heads, D) and k
    (B, L, kv_heads, D), then `full_attention`; returns (B, heads, L, D). On a full-KV cache's CUDA
    decode step the norms, the rotary and the write of k and v into their blocks are one launch."""
    cache = _paged_decode_cache(ctx, layer, q)
    if cache is not None and _one_fused_kind(q_norm, k_norm):
        normed = q_norm is not None   # else rotary alone (the kernel ignores eps and scale)
        q = kernels.qk_rope_paged(q, k, v, q_norm.weight if normed else None, k_norm.weight if normed else None,
                                  q_norm.eps if normed else 0.0, q_norm.fused_scale if normed else kernels.SCALE_NONE,
                                  ctx.cos, ctx.sin, cache.k, cache.v, cache.tables.table, ctx.write_rows,
                                  ctx.positions)
        return _paged_decode(ctx, cache, q.transpose(1, 2), None)
    q = norm_and_rotate(q, q_norm, ctx.cos, ctx.sin).transpose(1, 2)
    k = norm_and_rotate(k, k_norm, ctx.cos, ctx.sin)
    return full_attention(ctx, layer, q, k, v)


class FullKVMixer:
    """What every mixer that keeps full-context GQA keys and values shares: its cache kind and the
    bytes that cache takes (the memory plan reads `cache_bytes` without building the model)."""

    @staticmethod
    def cache_bytes(config, rows: int, max_len: int, dtype: torch.dtype) -> int:
        return rows * max_len * KVCache.bytes_per_token(config.num_kv_heads, config.head_dim, dtype)

    @staticmethod
    def make_cache(config, rows: int, max_len: int, dtype: torch.dtype, device: torch.device) -> KVCache:
        return KVCache(rows, max_len, config.num_kv_heads, config.head_dim, dtype, device)

    @staticmethod
    def score_bytes(config, tokens: int, attended: int, dtype: torch.dtype) -> int:
        """What attending `tokens` queries to `attended` positions holds beyond q, k, v, the output and
        the step's mask: nothing for SDPA, whose flash kernels (CUDA and CPU alike) keep no scores."""
        return 0

    pageable = True   # its cache may be a `PagedKVCache` instead (every layer of the model must agree)

    @staticmethod
    def block_bytes(config, block_size: int, dtype: torch.dtype) -> int:
        return PagedKVCache.bytes_per_block(block_size, config.num_kv_heads, config.head_dim, dtype)

    @staticmethod
    def make_paged_cache(config, tables: BlockTables, num_blocks: int, dtype: torch.dtype, device: torch.device,
                         pool: tuple[Tensor, Tensor] | None = None) -> PagedKVCache:
        return PagedKVCache(tables, num_blocks, config.num_kv_heads, config.head_dim, dtype, device, pool)


class ModelCache:
    """The caches of every layer for `rows` sequences of at most `max_len` positions; `tables` when
    the layers are paged (`PagedKVCache`: then a row is a block-table row)."""

    def __init__(self, layers: list[LayerCache], rows: int, max_len: int, device: torch.device,
                 tables: BlockTables | None = None):
        self.layers, self.rows, self.max_len, self.device = layers, rows, max_len, device
        self.tables = tables

    @property
    def paged(self) -> bool:
        return self.tables is not None

    def __getitem__(self, layer: int) -> LayerCache:
        return self.layers[layer]

    def move_row(self, src: int, dst: int, length: int) -> None:
        if self.tables is not None:
            self.tables.move(src, dst)
        for layer in self.layers:
            layer.move_row(src, dst, length)

    @property
    def can_cut(self) -> bool:
        return all(layer.can_cut for layer in self.layers)

    def snapshot(self, row: int, length: int) -> list[tuple[Tensor, ...]]:
        return [layer.snapshot(row, length) for layer in self.layers]

    def restore(self, row: int, state: list[tuple[Tensor, ...]], length: int) -> None:
        for layer, part in zip(self.layers, state):
            layer.restore(row, part, length)


class SlidingWindowMixer:
    """What every mixer over the last `window` positions shares: a `RingKVCache` of the window (its
    kind and size), and the keys, values and mask a step attends to. A step attends to the ring as
    it was before the step plus its own keys, then writes its keys into the ring: so chunks longer
    than the window, per-row lengths and a replayed decode step all stay exact."""

    layer: int
    window: int
    pageable = False   # a ring of the window, whatever a full-KV base class says

    @staticmethod
    def cache_bytes(config, rows: int, max_len: int, dtype: torch.dtype) -> int:
        return rows * min(config.sliding_window, max_len) * KVCache.bytes_per_token(
            config.num_kv_heads, config.head_dim, dtype)

    @staticmethod
    def make_cache(config, rows: int, max_len: int, dtype: torch.dtype, device: torch.device) -> RingKVCache:
        return RingKVCache(rows, min(config.sliding_window, max_len), config.num_kv_heads, config.head_dim, dtype,
                           device)

    def window_mask(self, key_positions: Tensor, query_positions: Tensor) -> Tensor:
        """(B, 1, Lq, Lk) bool: keys at or before the query and less than a window behind it;
        key positions (B, Lk), query positions (B, Lq). A negative key position is no key."""
        keys, queries = key_positions[:, None, :], query_positions[:, :, None]
        return ((keys >= 0) & (keys <= queries) & (keys > queries - self.window))[:, None]

    def sliding_attend(self, ctx, k: Tensor, v: Tensor, attend) -> Tensor:
        """`attend(keys, values, mask)` over this step's window; k, v (B, L, kv_heads, D) of the step,
        keys and values handed on as (B, kv_heads, S, D)."""
        positions = ctx.positions
        if ctx.cache is None:   # the whole (padded) batch at once: the window on top of its mask
            mask = self.window_mask(positions, positions)
            return attend(k.transpose(1, 2), v.transpose(1, 2), mask if ctx.mask is None else mask & ctx.mask)
        ring: RingKVCache = ctx.cache[self.layer]
        held_k, held_v = ring.read(ctx.cache_rows)
        key_positions = torch.cat((ring.slot_positions(positions[:, :1]), positions), dim=1)
        keys = torch.cat((held_k, k.transpose(1, 2)), dim=2)
        values = torch.cat((held_v, v.transpose(1, 2)), dim=2)
        out = attend(keys, values, self.window_mask(key_positions, positions))
        ring.write(ctx.write_rows, positions, k, v)   # after the read: the step attended to the ring before it
        return out
