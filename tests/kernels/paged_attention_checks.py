"""Checks of the paged-attention kernels against their references, shared by the GPU test and the
interpreter test (which runs them on the CPU under TRITON_INTERPRET=1)."""

from __future__ import annotations

import torch

from moestream.kernels.paged_attention_reference import paged_decode_attention_reference, paged_kv_write_reference
from moestream.kernels.paged_attention_triton import paged_decode_attention, paged_kv_write
from moestream.model.cache import KVCache

TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _tables(rows: int, max_blocks: int, num_blocks: int, g: torch.Generator, device: str) -> torch.Tensor:
    """Every row's blocks drawn from a shuffled pool (block 0, the null block, left out)."""
    ids = torch.randperm(num_blocks - 1, generator=g)[: rows * max_blocks] + 1
    return ids.view(rows, max_blocks).to(torch.int32).to(device)


def check_write(device: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    block_size, kv_heads, D, rows, max_blocks = 8, 2, 32, 3, 4
    tables = _tables(rows, max_blocks, 16, g, device)
    pools = [torch.randn(16, block_size, kv_heads, D, generator=g).to(device, dtype) for _ in range(2)]
    expected = [p.clone() for p in pools]
    for L in (1, 5):
        qkv = torch.randn(rows, L, 3 * kv_heads * D, generator=g).to(device, dtype)   # k and v as strided views
        k = qkv[..., :kv_heads * D].view(rows, L, kv_heads, D)
        v = qkv[..., kv_heads * D:2 * kv_heads * D].view(rows, L, kv_heads, D)
        row_ids = torch.tensor([[2], [0], [1]], device=device).expand(rows, L)
        positions = torch.stack([torch.randperm(block_size * max_blocks, generator=g)[:L] for _ in range(rows)]).to(device)
        paged_kv_write(k, v, *pools, tables, row_ids, positions)
        paged_kv_write_reference(k, v, *expected, tables, row_ids, positions)
        for got, want in zip(pools, expected):
            assert torch.equal(got, want), f"paged_kv_write {dtype} L={L}"


def check_decode(device: str, dtype: torch.dtype, sizes=((3, 8, 2, 64, 16, 150), (2, 4, 4, 32, 8, 70),
                                                          (1, 16, 2, 128, 16, 600), (1, 4, 2, 32, 16, 1300))) -> None:
    """The last size splits its 1,300 positions 21 ways: the merge reads them in two tiles, one partial."""
    g = torch.Generator().manual_seed(1)
    for B, heads, kv_heads, D, block_size, max_len in sizes:
        max_blocks = -(-max_len // block_size)
        num_blocks = B * max_blocks + 5
        tables = _tables(B, max_blocks, num_blocks, g, device)
        k_pool = torch.randn(num_blocks, block_size, kv_heads, D, generator=g).to(device, dtype)
        v_pool = torch.randn(num_blocks, block_size, kv_heads, D, generator=g).to(device, dtype)
        q = torch.randn(B, heads, D, generator=g).to(device, dtype)
        lens = torch.randint(1, max_len + 1, (B,), generator=g)
        lens[0] = 1                                       # a row of one position: every split but one empty
        lens[-1] = max_len
        lens = lens.to(device)
        got = paged_decode_attention(q, k_pool, v_pool, tables, lens, max_len)
        want = paged_decode_attention_reference(q.float(), k_pool.float(), v_pool.float(), tables, lens)
        err = (got.float() - want).abs().max().item() / want.abs().max().item()
        assert err < TOLERANCE[dtype], f"paged_decode_attention {dtype} {B, heads, kv_heads, D, block_size}: {err}"
        # a bound larger than any row (a graph's length bucket) changes nothing
        wider = paged_decode_attention(q, k_pool, v_pool, torch.cat([tables, tables[:, :3]], dim=1), lens,
                                       max_len + 3 * block_size)
        assert (wider.float() - got.float()).abs().max().item() <= TOLERANCE[dtype] * want.abs().max().item()


def check_rows_cache(device: str, dtype: torch.dtype) -> None:
    """A rows `KVCache` read as blocks (`RowBlocks`: block r is row r, as long as the row, here 37
    positions, no power of two): the step's keys land at (row, position) as plain indexing puts them,
    and decode attends each row over its own length as softmax attention over those rows does."""
    g = torch.Generator().manual_seed(2)
    rows, max_len, heads, kv_heads, D = 4, 37, 8, 2, 64
    cache = KVCache(rows, max_len, kv_heads, D, dtype, torch.device(device))
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    want_k, want_v = cache.k.clone(), cache.v.clone()
    B = 3
    lens = torch.tensor([1, 20, max_len])
    row_ids = torch.tensor([[2], [0], [3]], device=device)                      # batch row b writes cache row row_ids[b]
    positions = (lens - 1)[:, None].to(device)
    k = torch.randn(B, 1, kv_heads, D, generator=g).to(device, dtype)
    v = torch.randn(B, 1, kv_heads, D, generator=g).to(device, dtype)
    paged_kv_write(k, v, cache.k, cache.v, cache.tables.table, row_ids, positions)
    want_k[row_ids, positions], want_v[row_ids, positions] = k, v
    assert torch.equal(cache.k, want_k) and torch.equal(cache.v, want_v), f"rows write {dtype}"
    q = torch.randn(B, heads, D, generator=g).to(device, dtype)
    got = paged_decode_attention(q, cache.k, cache.v, cache.tables.table[row_ids[:, 0]], lens.to(device), max_len)
    for b in range(B):
        n, r = int(lens[b]), int(row_ids[b, 0])
        keys = cache.k[r, :n].float().repeat_interleave(heads // kv_heads, dim=1)   # (n, heads, D)
        values = cache.v[r, :n].float().repeat_interleave(heads // kv_heads, dim=1)
        weights = torch.softmax(torch.einsum("hd,nhd->hn", q[b].float(), keys) / D ** 0.5, dim=-1)
        want = torch.einsum("hn,nhd->hd", weights, values)
        err = (got[b].float() - want).abs().max().item() / want.abs().max().item()
        assert err < TOLERANCE[dtype], f"rows decode {dtype} row {r} of {n} positions: {err}"


def check_all(device: str, dtypes) -> None:
    for dtype in dtypes:
        check_write(device, dtype)
        check_decode(device, dtype)
        check_rows_cache(device, dtype)
