"""The generation loop: chunked prefill per sequence, then batched decode of all sequences together.

Sequences of different lengths share one KV cache; each decodes at its own position. The loop
yields one list of new token ids per step and reads them to the host once per step (to stream
and to stop); nothing inside a layer waits on the host.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from moestream.model.context import decode_context, prefill_context
from moestream.model.decoder import MoECausalLM
from moestream.runtime.cuda_graphs import DecodeGraphs, SegmentedDecode
from moestream.runtime.kv_cache import KVCache
from moestream.runtime.sampling import SamplingParams, make_generator, sample


@dataclass
class RunMetrics:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    prefill_s: float = 0.0
    peak_memory_bytes: int = 0

    @property
    def decode_tok_s(self) -> float:
        steps = self.generated_tokens - 1
        return steps / self.decode_s if self.decode_s > 0 and steps > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated_tokens,
                "ttft_s": self.ttft_s, "prefill_s": self.prefill_s, "decode_s": self.decode_s,
                "decode_tok_s": self.decode_tok_s, "peak_memory_bytes": self.peak_memory_bytes}


@dataclass
class GenerationRun:
    """State shared between the loop and its consumer: the consumer marks rows finished."""

    prompts: list[list[int]]
    params: SamplingParams
    finished: set[int] = field(default_factory=set)
    metrics: RunMetrics = field(default_factory=RunMetrics)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Generator:
    """Owns the rotary table and a reusable KV cache for a model on one device."""

    def __init__(self, model: MoECausalLM, device: torch.device, dtype: torch.dtype, max_context: int,
                 prefill_chunk: int = 512, cuda_graphs: bool = True):
        self.model, self.device, self.dtype = model, device, dtype
        self.max_context = max_context
        self.prefill_chunk = prefill_chunk
        self.rotary = None
        self._cache: KVCache | None = None
        self.cuda_graphs = cuda_graphs and device.type == "cuda" and not os.environ.get("MOESTREAM_NO_CUDA_GRAPHS")
        self._graphs: dict[int, DecodeGraphs] = {}
        self._segmented: dict[int, SegmentedDecode] = {}

    def forward(self, input_ids: torch.Tensor, ctx, last_only: bool = False, decoding: bool = False) -> torch.Tensor:
        """One model call, with the bank told what kind of step it is and how many tokens went through."""
        bank = self.model.bank
        if bank is not None:
            bank.begin_step(decoding)
        logits = self.model(input_ids, ctx, last_only=last_only)
        if bank is not None:
            bank.after_step(input_ids.numel())
        return logits

    def _decode_logits(self, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        bank = self.model.bank
        B = tokens.shape[0]
        if self.cuda_graphs and bank is not None and bank.graph_safe:
            graphs = self._graphs.get(B)
            if graphs is None or graphs.cache is not cache:
                graphs = self._graphs[B] = DecodeGraphs(self.model, self.rotary_table(), cache, B, self.dtype)
            bank.begin_step(True)
            logits = graphs(tokens, positions, kv_len)
            bank.after_step(B)
            return logits
        if bank is not None and bank.can_segment(B):   # on the CPU the same segments run eagerly
            seg = self._segmented.get(B)
            if seg is None or seg.cache is not cache:
                seg = self._segmented[B] = SegmentedDecode(self.model, self.rotary_table(), cache, B, self.dtype,
                                                           use_graphs=self.cuda_graphs)
            bank.begin_step(True)
            logits = seg(tokens, positions, kv_len)
            bank.after_step(B)
            return logits
        ctx = decode_context(self.rotary_table(), cache, positions, kv_len, self.dtype)
        return self.forward(tokens[:, None], ctx, decoding=True)[:, -1]

    def rotary_table(self):
        if self.rotary is None:
            from moestream.model.rotary import rotary_table

            self.rotary = rotary_table(self.model.config, self.max_context, self.device)
        return self.rotary

    def cache_for(self, batch: int, length: int) -> KVCache:
        """Reuse the cache when it is big enough; grow it (once) when a larger batch arrives."""
        c = self._cache
        if c is None or c.batch < batch or c.max_len < length:
            cfg = self.model.config
            self._cache = None
            self._graphs.clear()
            self._segmented.clear()
            c = KVCache(cfg.num_layers, batch, self.max_context, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device)
            self._cache = c
        return c

    @torch.inference_mode()
    def prepare(self, batch: int, length: int, prompt_length: int = 1) -> None:
        """Allocate the cache and capture the decode graphs a run of this size will need, ahead of time.

        Call between runs only: capturing writes the cache at the static buffers' positions.
        """
        cache = self.cache_for(batch, length)
        bank = self.model.bank
        if not (self.cuda_graphs and bank is not None):
            return
        if bank.graph_safe:
            graphs = self._graphs.get(batch)
            if graphs is None or graphs.cache is not cache:
                graphs = self._graphs[batch] = DecodeGraphs(self.model, self.rotary_table(), cache, batch, self.dtype)
        elif bank.can_segment(batch):
            graphs = self._segmented.get(batch)
            if graphs is None or graphs.cache is not cache:
                graphs = self._segmented[batch] = SegmentedDecode(self.model, self.rotary_table(), cache, batch, self.dtype)
        else:
            return
        graphs.capture_upto(min(length, self.max_context), prompt_length + 1)

    @torch.inference_mode()
    def prefill(self, cache: KVCache, row: int, prompt: list[int]) -> torch.Tensor:
        """Run one prompt through the model chunk by chunk; return the last position's logits (1, V)."""
        table = self.rotary_table()
        ids = torch.tensor(prompt, dtype=torch.long).to(self.device, non_blocking=True)
        logits = None
        for start in range(0, len(prompt), self.prefill_chunk):
            chunk = ids[start:start + self.prefill_chunk][None]
            ctx = prefill_context(table, cache, row, start, chunk.shape[1], self.dtype)
            logits = self.forward(chunk, ctx, last_only=True)
        return logits[:, -1]

    @torch.inference_mode()
    def teacher_forced(self, context: list[int], targets: list[int]) -> torch.Tensor:
        """Log-probabilities (len(targets),) of `targets` after `context`, scored one decode step at a
        time: the path generation takes, so decode-only approximations (the skip policy) count."""
        cache = self.cache_for(1, len(context) + len(targets))
        logits = self.prefill(cache, 0, context)
        positions = torch.tensor([len(context)], dtype=torch.long, device=self.device)
        wanted = torch.tensor(targets, dtype=torch.long, device=self.device)
        scores = []
        for step, token in enumerate(wanted):
            scores.append(logits.float().log_softmax(-1)[0, token])
            if step + 1 < len(targets):
                logits = self._decode_logits(cache, token.view(1), positions, len(context) + step + 1)
                positions = positions + 1
        return torch.stack(scores)

    @torch.inference_mode()
    def run(self, run: GenerationRun) -> Iterator[list[int]]:
        """Yield the new token of every row, step by step, until all rows are finished."""
        params, prompts = run.params, run.prompts
        B = len(prompts)
        longest = max(len(p) for p in prompts)
        budget = min(params.max_tokens, self.max_context - longest)
        cache = self.cache_for(B, longest + budget)
        gen = make_generator(params, self.device)
        m = run.metrics
        m.prompt_tokens = sum(len(p) for p in prompts)
        t0 = time.perf_counter()
        first = torch.cat([self.prefill(cache, row, p) for row, p in enumerate(prompts)])
        tokens = sample(first, params, gen)
        host = tokens.tolist()
        m.ttft_s = m.prefill_s = time.perf_counter() - t0
        m.generated_tokens = 1
        yield host
        positions = torch.tensor([len(p) for p in prompts], dtype=torch.long).to(self.device)
        t1 = time.perf_counter()
        for step in range(1, budget):
            if len(run.finished) >= B:
                break
            logits = self._decode_logits(cache, tokens, positions, longest + step)
            tokens = sample(logits, params, gen)
            positions = positions + 1
            host = tokens.tolist()
            m.generated_tokens += 1
            m.decode_s = time.perf_counter() - t1
            yield host
        _sync(self.device)
        m.decode_s = time.perf_counter() - t1
        if self.device.type == "cuda":
            m.peak_memory_bytes = torch.cuda.max_memory_allocated(self.device)
