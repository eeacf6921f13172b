"""The Engine: a loaded model plus tokenizer, with logits / generate / stream as the public API."""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from moestream.errors import InputError
from moestream.checkpoint import resolve_checkpoint
from moestream.experts.discovery import DEFAULT_PROMPT as DEFAULT_DISCOVERY_PROMPT
from moestream.loader import BankOptions, LoadedModel, load_model, resolve_device, resolve_dtype, save_prepack
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
        self.prepack_error: str | None = None
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

    def warm_up(self, tokens: int = 8, bank_is_warm: bool = False) -> None:
        """Hybrid warm-up: a few generated tokens of a short prompt compile kernels, capture decode
        graphs and swap in that domain's missing experts before the first real request.

        A bank restored from a snapshot is already warm: then a 4-token prompt only compiles and
        captures, instead of streaming a prompt's worth of missing experts through the bank."""
        prompt = (self.encode(DEFAULT_DISCOVERY_PROMPT) if self.tokenizer is not None
                  else list(range(1, min(32, self.config.vocab_size))))
        if bank_is_warm:
            prompt = prompt[:4]
        self.generate(prompt, max_tokens=tokens, ignore_eos=True)
        self.reset_stats()

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
         residency: str = "lcp", pinned: dict[int, list[int]] | None = None, prefetch: bool = False,
         profile=None, pin_top_k: int | None = None, pin_threshold: float | None = None,
         discovery: bool | str | list[int] = True, prepack: str | Path | None = None,
         warmup_tokens: int = 0) -> Engine:
    """Load a checkpoint folder or hub id; the tokenizer comes along when the checkpoint has one.

    `gpu_memory` (alias `memory`, which names no device) bounds everything the engine takes on
    the device; `capacity` fixes the bank slots per layer instead. Experts beyond the bank stay
    in pinned host RAM (`host_memory` bounds it) or on disk.

    `profile` (a path or a Profile, from `moestream profile`) seeds the bank with the experts that
    its prompts used most; `pin_top_k` / `pin_threshold` also pin its top experts per layer.

    With a bounded bank and no profile, `discovery` (True: a built-in prompt; or your text or
    token ids) runs a router-only pass first so the bank starts with the experts it used.
    `prepack` names a folder for a snapshot of the warmed bank: loaded when it matches, else
    built, warmed with `warmup_tokens` generated tokens, and saved. `warmup_tokens` > 0 also
    compiles kernels and captures decode graphs before the first request.
    """
    if max_context is not None and max_context < 2:
        raise InputError(f"max_context must be at least 2, got {max_context}.")
    if gpu_memory is not None and memory is not None:
        raise InputError("give either gpu_memory or memory (they are the same budget), not both.")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    from moestream.experts.profile import apply_profile, prepare_profile, profile_seed

    profile, pinned = prepare_profile(model, profile, pin_top_k, pin_threshold, pinned)   # pins before the bank fills
    folder = resolve_checkpoint(model)
    tokenizer = _load_tokenizer(folder)
    options = BankOptions(gpu_memory=gpu_memory if gpu_memory is not None else memory, capacity=capacity,
                          host_memory=host_memory, host_tier=host_tier, miss_policy=miss_policy,
                          residency=residency, pinned=pinned, prefetch=prefetch, prepack=prepack,
                          discovery_ids=_discovery_ids(discovery, tokenizer))
    if profile is not None and options.seed is None:
        options.seed = profile_seed(profile)   # the bank's first fill then holds the profile's top experts
    loaded = load_model(folder, dev, dt, options, max_context)
    context = min(max_context or loaded.config.max_position, loaded.config.max_position)
    engine = Engine(loaded, tokenizer, dev, dt, context)
    if profile is not None:   # a bank restored from a prepacked snapshot keeps its experts
        apply_profile(engine, profile, refill=loaded.prepack is None or not loaded.prepack.loaded)
        engine.reset_stats()   # seeding is part of loading, like the bank's first fill
    if warmup_tokens > 0:
        engine.warm_up(warmup_tokens, bank_is_warm=loaded.prepack is not None and loaded.prepack.loaded)
    engine.prepack_error = save_prepack(loaded)   # only when the bank did not come from the snapshot
    return engine


def _discovery_ids(discovery: bool | str | list[int], tokenizer) -> list[int] | None:
    if discovery is False or discovery is None:
        return None
    if discovery is True:
        return tokenizer(DEFAULT_DISCOVERY_PROMPT).input_ids if tokenizer is not None else None
    if isinstance(discovery, str):
        if tokenizer is None:
            raise InputError("a discovery prompt given as text needs tokenizer files; pass token ids instead.")
        return tokenizer(discovery).input_ids
    return [int(t) for t in discovery]
