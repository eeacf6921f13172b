"""The paged-attention kernels (KV write, flash-decoding over blocks) against their references:
compiled on a GPU, under Triton's interpreter on the CPU; the reference itself against a plain
attention over contiguous keys."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from triton_interpreter import INTERPRETER_SKIP, check_all_under_interpreter

from moestream.kernels import fused_moe_available, paged_decode_attention_reference

needs_cuda = pytest.mark.skipif(not fused_moe_available(), reason="needs CUDA and Triton")


def test_the_reference_equals_attention_over_contiguous_keys():
    g = torch.Generator().manual_seed(0)
    B, heads, kv_heads, D, block_size, lens = 2, 4, 2, 8, 4, [5, 11]
    keys = torch.randn(B, 12, kv_heads, D, generator=g)
    values = torch.randn(B, 12, kv_heads, D, generator=g)
    tables = torch.tensor([[5, 1, 3], [2, 6, 4]], dtype=torch.int32)   # blocks anywhere in the pool
    k_pool, v_pool = torch.zeros(7, block_size, kv_heads, D), torch.zeros(7, block_size, kv_heads, D)
    for b in range(B):
        for i, block in enumerate(tables[b].tolist()):
            k_pool[block] = keys[b, i * block_size:(i + 1) * block_size]
            v_pool[block] = values[b, i * block_size:(i + 1) * block_size]
    q = torch.randn(B, heads, D, generator=g)
    got = paged_decode_attention_reference(q, k_pool, v_pool, tables, torch.tensor(lens))
    for b, n in enumerate(lens):
        k = keys[b, :n].repeat_interleave(heads // kv_heads, dim=1)    # (n, heads, D)
        v = values[b, :n].repeat_interleave(heads // kv_heads, dim=1)
        weights = torch.softmax(torch.einsum("hd,nhd->hn", q[b], k) / D ** 0.5, dim=-1)
        assert torch.allclose(got[b], torch.einsum("hn,nhd->hd", weights, v), atol=1e-6)


def test_a_launch_never_takes_more_splits_than_its_batch_width_at_any_length():
    """The split buffers are `most_splits(batch, kv heads)` wide whatever the length bound, so decode at a
    longer length bucket meets the same strides and merge kernel (no compile mid-stream): every bound's
    split count fits that width, and a long bound fills more than half of it."""
    from moestream.kernels.paged_attention_triton import _PROGRAMS, _TILE, most_splits, split_length

    for batch in (1, 2, 3, 4, 8, 16, 64):
        for kv_heads in (1, 2, 4, 8):
            width = most_splits(batch, kv_heads)
            assert width * batch * kv_heads >= _PROGRAMS or width == 1
            for max_len in [1, 63, 64, 65, 256, 1000, 4096, 4224, 20000, 32768, 131072, 262144]:
                split_len = split_length(batch, kv_heads, max_len)
                splits = -(-max_len // split_len)
                assert split_len % _TILE == 0 and splits <= width, (batch, kv_heads, max_len, splits, width)
                assert splits * split_len >= max_len
            assert -(-262144 // split_length(batch, kv_heads, 262144)) > width // 2   # long rows fill the width


@pytest.mark.skipif(**INTERPRETER_SKIP)
def test_paged_attention_under_interpreter():
    check_all_under_interpreter(Path(__file__).parent / "paged_attention_checks.py", timeout=600)


@needs_cuda
def test_paged_attention_on_gpu():
    from paged_attention_checks import check_all

    check_all("cuda", (torch.float32, torch.bfloat16, torch.float16))
