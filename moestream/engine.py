"""The Engine: a loaded model plus tokenizer, with logits / generate / stream as the public API."""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from moestream.errors import InputError
from moestream.loader import BankOptions, LoadedModel, load_model, resolve_device, resolve_dtype
from moestream.model.context import no_cache_context
from moestream.runtime.detokenize import IncrementalDetokenizer, StopStringFilter
from moestream.runtime.generate import GenerationRun, Generator, RunMetrics
from moestream.runtime.sampling import SamplingParams

Prompt = str | list[int]


def _load_tokenizer(folder: Path):
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if not any((folder / n).exists() for n in names):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


class Engine:
    def __init__(self, loaded: LoadedModel, tokenizer, device: torch.device, dtype: torch.dtype, max_context: int):
        self.loaded = loaded
        self.model = loaded.model
        self.config = loaded.config
        self.tokenizer = tokenizer
        self.device, self.dtype = device, dtype
        self.max_context = max_context
        self.generator = Generator(self.model, device, dtype, max_context)
        self.last_metrics = RunMetrics()
        self.eos_ids = set(self.config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_ids.add(int(tokenizer.eos_token_id))

    # ---- bank statistics ----------------------------------------------------------------
    @property
    def bank(self):
        return self.loaded.bank

    def stats(self) -> dict:
        """Hits, misses, evictions, bytes copied and copy wait time, per layer and in total."""
        self.bank.sync_stats()
        return self.bank.stats.as_dict()

    def reset_stats(self) -> None:
        self.bank.sync_stats()
        self.bank.stats.reset()

    # ---- inputs -------------------------------------------------------------------------
    def encode(self, prompt: Prompt, chat: bool = False) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InputError("this checkpoint has no tokenizer files, so text prompts cannot be encoded; pass token ids instead.")
            if chat:
                if not getattr(self.tokenizer, "chat_template", None):
                    raise InputError("this tokenizer has no chat template; run without --chat.")
                return list(self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                               add_generation_prompt=True, tokenize=True,
                                                               return_dict=False))
            ids = self.tokenizer(prompt, add_special_tokens=True).input_ids
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise InputError("the prompt is empty; give at least one token.")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise InputError(f"token id {bad[0]} is outside the vocabulary (0..{self.config.vocab_size - 1}).")
        if len(ids) >= self.max_context:
            raise InputError(f"the prompt has {len(ids)} tokens but the context holds {self.max_context}; shorten the prompt or raise --max-context.")
        return ids

    # ---- full forward -------------------------------------------------------------------
    @torch.inference_mode()
    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(batch, seq, vocab) logits of a full forward without cache; padding marked by attention_mask."""
        input_ids = input_ids.to(self.device)
        if attention_mask is not None:
            attention_mask = attention_mask.to(self.device)
        if input_ids.shape[1] > self.max_context:
            raise InputError(f"the input has {input_ids.shape[1]} tokens but the context holds {self.max_context}; shorten it or raise max_context.")
        ctx = no_cache_context(self.generator.rotary_table(), input_ids, attention_mask, self.dtype)
        return self.generator.forward(input_ids, ctx)

    # ---- generation ---------------------------------------------------------------------
    def _params(self, **kw) -> SamplingParams:
        stop = kw.pop("stop", None)
        if isinstance(stop, str):
            stop = [stop]
        params = SamplingParams(stop=list(stop or []), **kw)
        params.validate()
        return params

    def _stream_rows(self, prompts: list[list[int]], params: SamplingParams) -> Iterator[tuple[int, int | None, str]]:
        """Yield (row, token, text delta) as tokens arrive; token None marks a row's final flush."""
        run = GenerationRun(prompts, params)
        detoks = [IncrementalDetokenizer(self.tokenizer, prompt_ids=p) if self.tokenizer is not None else None
                  for p in prompts]
        stops = [StopStringFilter(params.stop) for _ in prompts]
        counts = [0] * len(prompts)
        for step in self.generator.run(run):
            for row, token in enumerate(step):
                if row in run.finished:
                    continue
                counts[row] += 1
                is_eos = token in self.eos_ids and not params.ignore_eos
                delta = ""
                if detoks[row] is not None and not is_eos:
                    delta = stops[row].push(detoks[row].add(token))
                if is_eos or stops[row].stopped or counts[row] >= params.max_tokens:
                    run.finished.add(row)
                    delta += stops[row].flush()
                    yield row, (None if is_eos or stops[row].stopped else token), delta
                    continue
                yield row, token, delta
        for row in range(len(prompts)):
            if row not in run.finished:   # ran out of context
                yield row, None, stops[row].flush()
        self.last_metrics = run.metrics
        if self.device.type != "cuda":
            self.last_metrics.peak_memory_bytes = _peak_rss_bytes()

    def generate(self, prompt: Prompt | list[Prompt], max_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None,
                 stop: str | list[str] | None = None, chat: bool = False, ignore_eos: bool = False):
        """str for a text prompt, list[int] for token ids; a list of prompts gives a list of results."""
        batch = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
        prompts = list(prompt) if batch else [prompt]
        params = self._params(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                              min_p=min_p, seed=seed, stop=stop, ignore_eos=ignore_eos)
        ids = [self.encode(p, chat) for p in prompts]
        tokens: list[list[int]] = [[] for _ in prompts]
        texts = [""] * len(prompts)
        for row, token, delta in self._stream_rows(ids, params):
            if token is not None:
                tokens[row].append(token)
            texts[row] += delta
        results = [texts[i] if isinstance(p, str) else tokens[i] for i, p in enumerate(prompts)]
        return results if batch else results[0]

    def stream(self, prompt: Prompt, max_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None,
               stop: str | list[str] | None = None, chat: bool = False, ignore_eos: bool = False) -> Iterator[str]:
        """Incremental text of one prompt, piece by piece (never a broken character)."""
        if self.tokenizer is None:
            raise InputError("this checkpoint has no tokenizer files, so text cannot be streamed; use generate() with token ids.")
        params = self._params(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                              min_p=min_p, seed=seed, stop=stop, ignore_eos=ignore_eos)
        ids = self.encode(prompt, chat)
        for _, _, delta in self._stream_rows([ids], params):
            if delta:
                yield delta

    def stream_tokens(self, prompt: Prompt, **kw) -> Iterator[int]:
        """Token ids of one prompt as they are generated (works without a tokenizer)."""
        params = self._params(**kw)
        for _, token, _ in self._stream_rows([self.encode(prompt)], params):
            if token is not None:
                yield token


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def load(model: str | Path, device: str = "auto", dtype: str | torch.dtype = "auto", max_context: int | None = None,
         gpu_memory: int | str | None = None, memory: int | str | None = None, capacity: int | None = None,
         host_memory: int | str | None = None, host_tier: str = "auto", miss_policy: str = "fetch",
         residency: str = "lcp", pinned: dict[int, list[int]] | None = None, prefetch: bool = True) -> Engine:
    """Load a checkpoint folder or hub id; the tokenizer comes along when the checkpoint has one.

    `gpu_memory` (alias `memory`, which names no device) bounds everything the engine takes on
    the device; `capacity` fixes the bank slots per layer instead. Experts beyond the bank stay
    in pinned host RAM (`host_memory` bounds it) or on disk.
    """
    if max_context is not None and max_context < 2:
        raise InputError(f"max_context must be at least 2, got {max_context}.")
    if gpu_memory is not None and memory is not None:
        raise InputError("give either gpu_memory or memory (they are the same budget), not both.")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    options = BankOptions(gpu_memory=gpu_memory if gpu_memory is not None else memory, capacity=capacity,
                          host_memory=host_memory, host_tier=host_tier, miss_policy=miss_policy,
                          residency=residency, pinned=pinned, prefetch=prefetch)
    loaded = load_model(model, dev, dt, options, max_context)
    context = min(max_context or loaded.config.max_position, loaded.config.max_position)
    return Engine(loaded, _load_tokenizer(loaded.folder), dev, dt, context)
