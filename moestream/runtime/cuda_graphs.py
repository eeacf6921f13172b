"""Decode steps as CUDA graph replays: one launch per step instead of ~50 per layer.

A batch-B decode step has static shapes except the attended cache length, so one graph is
captured per length bucket (powers of two from 256): attention then reads at most twice the
live context. Static input buffers take each step's tokens and positions; the graph reads
them on the device. Only banks that read nothing back during a step can be captured
(ExpertBank.graph_safe: fully resident, or the skip policy).
"""

from __future__ import annotations

import torch

from moestream.model.context import decode_context
from moestream.model.decoder import MoECausalLM
from moestream.runtime.kv_cache import KVCache


def length_bucket(kv_len: int, max_len: int, smallest: int = 256) -> int:
    bucket = smallest
    while bucket < kv_len:
        bucket *= 2
    return min(bucket, max_len)


class DecodeGraphs:
    def __init__(self, model: MoECausalLM, rotary, cache: KVCache, batch: int, dtype: torch.dtype):
        self.model, self.rotary, self.cache, self.dtype = model, rotary, cache, dtype
        device = cache.data.device
        self.batch = batch
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, dtype=torch.long, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def _step(self, kv_len: int) -> torch.Tensor:
        ctx = decode_context(self.rotary, self.cache, self.positions, kv_len, self.dtype)
        return self.model(self.tokens, ctx)[:, -1]

    def _capture(self, kv_len: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):   # compile kernels and settle the allocator outside the capture
                self._step(kv_len)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._step(kv_len)
        return graph, out

    def capture_upto(self, kv_len: int) -> None:
        """Capture every bucket up to the one holding kv_len (benchmarks keep capture out of timings)."""
        bucket = length_bucket(1, self.cache.max_len)
        while True:
            if bucket not in self.graphs:
                self.graphs[bucket] = self._capture(bucket)
            if bucket >= length_bucket(kv_len, self.cache.max_len):
                break
            bucket = length_bucket(bucket + 1, self.cache.max_len)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        """Logits (B, V) for one decode step; `tokens` and `positions` (B,) stay on the device."""
        self.tokens.copy_(tokens.view(-1, 1))
        self.positions.copy_(positions)
        bucket = length_bucket(kv_len, self.cache.max_len)
        entry = self.graphs.get(bucket)
        if entry is None:
            entry = self.graphs[bucket] = self._capture(bucket)
        entry[0].replay()
        return entry[1]
