"""One launch that counts the routed pairs a table maps to something: an expert-parallel rank's
share of a step's pairs (its own experts), added to a device counter without reading anything back.

Done with torch ops it is a gather, a comparison, a sum and an add: four launches a MoE layer, which
inside a replayed decode step cost more than the counting is worth. The spec is the torch fallback in
`kernels.count_mapped`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit(do_not_specialize=["n"])
def _count_mapped_kernel(ids_ptr, table_ptr, counter_ptr, n, BLOCK: tl.constexpr):
    total = tl.zeros((), tl.int64)
    for start in range(0, n, BLOCK):
        i = start + tl.arange(0, BLOCK)
        inside = i < n
        ids = tl.load(ids_ptr + i, mask=inside, other=0).to(tl.int64)
        mapped = tl.load(table_ptr + ids, mask=inside, other=-1)
        total += tl.sum((mapped >= 0).to(tl.int64), axis=0)
    tl.store(counter_ptr, tl.load(counter_ptr) + total)


def count_mapped(ids: torch.Tensor, table: torch.Tensor, counter: torch.Tensor) -> None:
    """counter (0-d int64) += the number of `ids` whose `table` entry is >= 0 (one program: a layer's
    pairs are at most a few thousand)."""
    ids = ids.reshape(-1)
    ids = ids if ids.is_contiguous() else ids.contiguous()
    block = min(_BLOCK, max(16, triton.next_power_of_2(ids.numel())))
    _count_mapped_kernel[(1,)](ids, table, counter, ids.numel(), BLOCK=block, num_warps=4)
