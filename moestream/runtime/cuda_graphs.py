"""Decode steps and resident prompt chunks as CUDA graph replays: a few launches instead of ~50 a layer.

A batch-B decode step has static shapes except the attended cache length, so one graph is
captured per length bucket (powers of two from 256): attention then reads at most twice the
live context. Static input buffers take each step's tokens and positions; the graph reads
them on the device (in an expert-parallel group a follower's tokens arrive from rank 0 inside the
graph: `before_step`). Only banks that read nothing back during a step can be captured whole
(ExpertBank.graph_safe: fully resident, or the skip policy); a fetch-policy bank decodes as graph
segments split at each router (`SegmentedDecode`). A fully resident bank's prompt chunks of up to
512 tokens replay as graphs too (`PromptGraphs`): their row, start and length are read on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from moestream.experts.bank import ExpertBank
from moestream.model.cache import ModelCache
from moestream.model.context import decode_context, graph_prefill_context
from moestream.model.decoder import MoECausalLM
from moestream.model.moe import MoEBlock


def capture(forward: Callable[[], torch.Tensor], pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """`forward` as a graph in `pool`, and its output: two runs on a side stream first (kernels compile and
    the allocator settles outside the capture; they do the step's work as the replay will)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()
    return graph, out


def length_bucket(kv_len: int, max_len: int, smallest: int = 256) -> int:
    bucket = smallest
    while bucket < kv_len:
        bucket *= 2
    return min(bucket, max_len)


class DecodeGraphs:
    """Whole decode steps of `batch` rows as graphs. With a `scratch_row`, a smaller batch B runs
    through them too: rows B.. are padding whose cache writes go to the scratch row (their reads and
    outputs are ignored), so one capture serves every batch size up to `batch` (a server's batch
    changes every time a request joins or leaves; capturing each size mid-stream would stall it)."""

    def __init__(self, model: MoECausalLM, rotary, cache: ModelCache, batch: int, dtype: torch.dtype,
                 scratch_row: int | None = None, pool=None, before_step: Callable[[torch.Tensor], None] | None = None):
        """`before_step`: run on the token buffer first thing in every step, captured with it (an
        expert-parallel group's broadcast of rank 0's tokens, `ModelRunner.before_decode`)."""
        self.model, self.rotary, self.cache, self.dtype = model, rotary, cache, dtype
        self.before_step = before_step
        device = cache.device
        self.batch, self.scratch_row = batch, scratch_row
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, dtype=torch.long, device=device)
        self.rows = torch.arange(batch, device=device)[:, None]
        self._own_rows = self.rows.clone()
        self._padded_to: int = batch   # rows.. of `rows` now point at the scratch row
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()

    def _step(self, kv_len: int) -> torch.Tensor:
        if self.before_step is not None:
            self.before_step(self.tokens)
        ctx = decode_context(self.rotary, self.cache, self.positions, kv_len, self.dtype, rows=self.rows)
        return self.model(self.tokens, ctx)[:, -1]

    def _use_rows(self, live: int) -> None:
        """Rows 0..live-1 write to themselves, the rest (padding) to the scratch row."""
        if live == self._padded_to:
            return
        if live < self.batch and self.scratch_row is None:
            raise ValueError(f"a batch of {live} cannot run through graphs of {self.batch} rows without a scratch row")
        self.rows[:live].copy_(self._own_rows[:live])
        self.rows[live:].fill_(self.scratch_row if self.scratch_row is not None else 0)
        self._padded_to = live

    def _capture(self, kv_len: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        return capture(lambda: self._step(kv_len), self.pool)

    def capture_upto(self, kv_len: int, from_len: int = 1) -> None:
        """Capture every bucket from from_len's up to kv_len's (benchmarks keep capture out of timings)."""
        bucket = length_bucket(from_len, self.cache.max_len)
        while True:
            if bucket not in self.graphs:
                self.graphs[bucket] = self._capture(bucket)
            if bucket >= length_bucket(kv_len, self.cache.max_len):
                break
            bucket = length_bucket(bucket + 1, self.cache.max_len)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        """Logits (B, V) for one decode step of B <= batch rows; `tokens` and `positions` (B,) stay on
        the device."""
        B = tokens.shape[0]
        self._use_rows(B)
        self.tokens[:B].copy_(tokens.view(-1, 1))
        self.positions[:B].copy_(positions)
        bucket = length_bucket(kv_len, self.cache.max_len)
        entry = self.graphs.get(bucket)
        if entry is None:
            entry = self.graphs[bucket] = self._capture(bucket)
        entry[0].replay()
        return entry[1][:B]


# Prompt chunk lengths captured as graphs: a chunk runs padded to the next one; a longer one runs eagerly,
# where the device's work (~30 µs a token a layer on the 30B shape) dwarfs the host's launches anyway.
PROMPT_GRAPH_LENGTHS = (16, 32, 64, 128, 256, 512)


class PromptGraphs:
    """One sequence's prompt chunks of up to 512 tokens as graph replays, where the bank is fully resident.

    Eagerly, a resident prompt chunk waits for the host: ~20 launches a layer from Python (a 512-token
    prompt of the 24-layer 30B shape kept the device busy 15 of its 32 ms). A chunk runs padded to the next
    of PROMPT_GRAPH_LENGTHS and reads a power-of-two bucket of positions (as decode does); its row, start
    and length live in a device buffer (`graph_prefill_context`), so one capture serves every row and start
    of its (length, bucket). Only caches whose positions past a sequence's length are free to write take
    the padding: full keys and values, in rows or blocks (`takes`); not rings or recurrent states.
    `use_graphs=False` runs the same padded forward eagerly (the CPU, tests)."""

    def __init__(self, model: MoECausalLM, rotary, cache: ModelCache, dtype: torch.dtype, pool=None,
                 use_graphs: bool = True):
        self.model, self.rotary, self.cache, self.dtype = model, rotary, cache, dtype
        self.use_graphs = use_graphs
        # (row, start, n) then the chunk's ids: filled by one copy a chunk.
        self.inputs = torch.zeros(3 + PROMPT_GRAPH_LENGTHS[-1], dtype=torch.long, device=cache.device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if pool is None and use_graphs:
            pool = torch.cuda.graph_pool_handle()
        self.pool = pool

    @staticmethod
    def takes(cache: ModelCache) -> bool:
        """Whether every layer's cache lets padding write past a sequence's length (full keys and values)."""
        return all(layer.kind in ("kv", "paged") for layer in cache.layers)

    def padded_length(self, start: int, n: int) -> int | None:
        """The captured length a chunk of n tokens at `start` runs at, or None (too long, or its padding
        would run past the cache's last position)."""
        length = next((size for size in PROMPT_GRAPH_LENGTHS if n <= size), None)
        return length if length is not None and start + length <= self.cache.max_len else None

    def _forward(self, length: int, kv_len: int) -> torch.Tensor:
        ctx = graph_prefill_context(self.rotary, self.cache, self.inputs[:3], length, kv_len, self.dtype)
        last = (self.inputs[2] - 1).view(1)
        return self.model(self.inputs[3:3 + length][None], ctx, last=last)[:, -1]

    def __call__(self, row: int, ids: list[int], start: int) -> torch.Tensor:
        """Logits (1, V) of the chunk's last position, after its positions start.. went into `row`; a
        copy, so no later replay of a graph sharing the pool can overwrite them."""
        n = len(ids)
        length = self.padded_length(start, n)
        if length is None:
            raise ValueError(f"a chunk of {n} tokens at {start} is not one a prompt graph runs")
        host = torch.tensor([row, start, n, *ids], dtype=torch.long)
        self.inputs[:3 + n].copy_(host, non_blocking=True)
        kv_len = length_bucket(start + n, self.cache.max_len)
        if not self.use_graphs:
            return self._forward(length, kv_len)
        entry = self.graphs.get((length, kv_len))
        if entry is None:
            entry = self.graphs[length, kv_len] = capture(lambda: self._forward(length, kv_len), self.pool)
        entry[0].replay()
        return entry[1].clone()


@dataclass
class _Carry:
    """What one segment hands to the next: the residual stream and the routing of the next MoE layer."""

    ctx: object
    x: torch.Tensor
    h: torch.Tensor | None = None
    ids: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    predicted: torch.Tensor | None = None   # next MoE layer's experts, its router applied to this h
    logits: torch.Tensor | None = None
    readback: torch.Tensor | None = None    # what the host reads after this segment, as one fp32 vector


class SegmentedDecode:
    """Decode with a fetch-policy bank: graph segments split at each MoE layer's routing.

    Segment i runs the experts of MoE layer i-1, the layers up to MoE layer i and that layer's
    attention and router. Between segments the host reads the routing (the one sync the fetch
    policy needs per layer) and makes the routed experts resident; the next segment then reads
    the updated slot map from the device. Everything else of a step replays as graphs.
    With prefetch on, each segment also applies the next MoE layer's router to its hidden state;
    the predicted misses start copying right after the sync, behind the current layer's compute.
    """

    def __init__(self, model: MoECausalLM, bank: ExpertBank, rotary, cache: ModelCache, batch: int,
                 dtype: torch.dtype, use_graphs: bool = True,
                 before_step: Callable[[torch.Tensor], None] | None = None,
                 bank_ids: Callable[[int, np.ndarray], np.ndarray] | None = None):
        """`before_step`: as `DecodeGraphs`' (run on the token buffer first, inside segment 0).
        `bank_ids(layer, ids)`: the routed expert ids as the bank numbers them, -1 for experts another
        rank holds (an expert-parallel rank's share: `ShardedExperts.bank_ids`); None: the same ids."""
        self.model, self.bank, self.rotary, self.cache, self.dtype = model, bank, rotary, cache, dtype
        self.use_graphs = use_graphs
        if bank_ids is not None and bank.hybrid:
            raise ValueError("an expert-parallel rank's bank decodes with the fetch policy, not the hybrid one")
        self.before_step, self.bank_ids = before_step, bank_ids
        self.prefetch = bank.prefetch_enabled
        self.layers = list(model.model.layers)
        self.moe_layers = [i for i, layer in enumerate(self.layers) if isinstance(layer.ffn, MoEBlock)]
        device = cache.device
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, dtype=torch.long, device=device)
        # Hybrid misses: per MoE layer, the rows the CPU computed for experts it served, added to the
        # layer's output by the next segment (zero when every miss was copied).
        H = model.config.hidden_size
        self.cpu_rows = ([torch.zeros(batch, H, dtype=torch.float32, device=device) for _ in self.moe_layers]
                         if bank.hybrid else None)
        self._rows_set = [False] * len(self.moe_layers)
        self.graphs: dict[int, list[tuple[torch.cuda.CUDAGraph, _Carry]]] = {}
        self.pool = torch.cuda.graph_pool_handle() if use_graphs else None

    def _segment(self, i: int, kv_len: int, prev: _Carry | None) -> _Carry:
        if i == 0:
            if self.before_step is not None:
                self.before_step(self.tokens)
            ctx = decode_context(self.rotary, self.cache, self.positions, kv_len, self.dtype)
            x, delta, start = self.model.model.embed_tokens(self.tokens), None, 0
        else:
            ctx, layer = prev.ctx, self.moe_layers[i - 1]
            routed = self.layers[layer].ffn.combine(prev.h, prev.ids, prev.weights, resident=True)
            if self.cpu_rows is not None:
                routed = (routed.float() + self.cpu_rows[i - 1]).to(routed.dtype)
            x, delta, start = prev.x, routed.view_as(prev.x), layer + 1
        if i == len(self.moe_layers):
            for layer in self.layers[start:]:
                x, delta = layer(x, ctx, delta)
            return _Carry(ctx, x, logits=self.model.head(x, delta)[:, -1])
        moe = self.moe_layers[i]
        for layer in self.layers[start:moe]:
            x, delta = layer(x, ctx, delta)
        x, h = self.layers[moe].attend_and_norm(x, ctx, delta)
        h = h.reshape(-1, x.shape[-1])
        weights, ids = self.layers[moe].ffn.route(h)
        predicted = None
        if self.prefetch and i + 1 < len(self.moe_layers):
            predicted = self.layers[self.moe_layers[i + 1]].ffn.router.predict(h)
        # One vector for the layer's one read-back, built inside the segment: the routing, the next
        # layer's prediction, and, where the CPU may compute experts, the weights and hidden rows.
        parts = [ids.reshape(-1).float()]
        if predicted is not None:
            parts.append(predicted.reshape(-1).float())
        if self.cpu_rows is not None:
            parts += [weights.reshape(-1).float(), h.reshape(-1).float()]
        return _Carry(ctx, x, h, ids, weights, predicted, readback=torch.cat(parts))

    def _make_resident(self, i: int, carry: _Carry) -> None:
        """The one sync of a layer: read its routing (and the next layer's prediction), fetch, prefetch."""
        bank = self.bank
        host = carry.readback.cpu()
        n, T = carry.ids.numel(), carry.h.shape[0]
        p = n + (carry.predicted.numel() if carry.predicted is not None else 0)
        actual = host[:n].numpy().astype(np.int64)
        predicted = host[n:p].numpy().astype(np.int64) if carry.predicted is not None else None
        wait = "device" if self.cache.device.type == "cuda" else "host"
        if self.bank_ids is not None:   # this rank's experts only, as its bank numbers them
            actual = self.bank_ids(self.moe_layers[i], actual)
            actual = actual[actual >= 0]
            if predicted is not None:
                predicted = self.bank_ids(self.moe_layers[i + 1], predicted)
                predicted = predicted[predicted >= 0]
        if self.cpu_rows is None:
            bank.ensure_resident(self.moe_layers[i], actual, wait=wait)
        else:
            rest = host[p:]
            weights, hidden = rest[:n].view(T, -1), rest[n:].view(T, -1).to(carry.h.dtype)
            rows = bank.ensure_resident_hybrid(self.moe_layers[i], actual.reshape(T, -1), hidden, weights, wait=wait)
            if rows is not None:
                self.cpu_rows[i].copy_(rows, non_blocking=True)
            elif self._rows_set[i]:
                self.cpu_rows[i].zero_()
            self._rows_set[i] = rows is not None
        if predicted is not None:
            bank.prefetch(self.moe_layers[i + 1], predicted)

    def _eager(self, kv_len: int) -> torch.Tensor:
        carry = None
        for i in range(len(self.moe_layers) + 1):
            carry = self._segment(i, kv_len, carry)
            if i < len(self.moe_layers):
                self._make_resident(i, carry)
        return carry.logits

    def _capture(self, kv_len: int) -> list[tuple[torch.cuda.CUDAGraph, _Carry]]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._eager(kv_len)   # compile kernels outside the capture
        torch.cuda.current_stream().wait_stream(side)
        out, carry = [], None
        for i in range(len(self.moe_layers) + 1):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                carry = self._segment(i, kv_len, carry)
            out.append((graph, carry))
        return out

    capture_upto = DecodeGraphs.capture_upto

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        self.tokens.copy_(tokens.view(-1, 1))
        self.positions.copy_(positions)
        if not self.use_graphs:
            return self._eager(kv_len)
        bucket = length_bucket(kv_len, self.cache.max_len)
        segments = self.graphs.get(bucket)
        if segments is None:
            segments = self.graphs[bucket] = self._capture(bucket)
        for i, (graph, carry) in enumerate(segments):
            graph.replay()
            if i < len(self.moe_layers):
                self._make_resident(i, carry)
        return segments[-1][1].logits
