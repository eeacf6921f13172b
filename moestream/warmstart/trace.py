"""Routing traces: the expert ids a model chose, per token and MoE layer, saved for replay.

`record_trace` runs prompts with a routing observer and keeps the k routed ids of every token at
every MoE layer. Benchmarks replay a trace on any checkpoint of the same expert count and top-k
(`moestream.bench.routing.TraceRouting`), so real routing statistics can be measured on random
weights; results that used one are labelled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moestream.errors import InputError
from moestream.warmstart.profile import (
    Profile,
    encode_prompts,
    model_fingerprint,
    observing,
    profile_counter,
    read_json,
    run_prompts,
    write_json_atomic,
)

TRACE_FORMAT = "moestream-trace"
TRACE_VERSION = 1


@dataclass
class RoutingTrace:
    num_experts: int
    top_k: int
    layers: list[int]          # the recording model's MoE layers (absolute indices), one per trace layer
    ids: np.ndarray            # (tokens, len(layers), top_k) routed expert ids
    arch: str = ""
    checkpoint: str = ""
    name: str = "trace"        # the file name it came from (labels benchmark results); not saved

    @property
    def tokens(self) -> int:
        return int(self.ids.shape[0])

    def as_dict(self) -> dict:
        return {"format": TRACE_FORMAT, "version": TRACE_VERSION,
                "model": {"arch": self.arch, "checkpoint": self.checkpoint},
                "num_experts": self.num_experts, "top_k": self.top_k, "layers": list(self.layers),
                "tokens": self.tokens, "ids": self.ids.tolist()}

    def save(self, path: str | Path) -> None:
        write_json_atomic(path, self.as_dict())

    @classmethod
    def load(cls, path: str | Path) -> RoutingTrace:
        redo = "record it with `moestream profile MODEL --prompts FILE --out PROFILE --trace TRACE`"
        data = read_json(path, "routing trace", redo)
        name = Path(path).name
        try:
            if data.get("format") != TRACE_FORMAT:
                raise ValueError
            E, k = int(data["num_experts"]), int(data["top_k"])
            layers = [int(x) for x in data["layers"]]
            ids = np.asarray(data["ids"], dtype=np.int64)
            model = data.get("model") or {}
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError):
            raise InputError(f"routing trace {name} is not a moestream trace (fields missing or malformed); {redo}.") from None
        if ids.ndim != 3 or ids.shape[0] < 1 or ids.shape[1:] != (len(layers), k) or not layers:
            raise InputError(f"routing trace {name} should hold (tokens, {len(layers)} layers, {k}) expert ids but "
                             f"holds shape {list(ids.shape)}; {redo}.")
        if ids.min() < 0 or ids.max() >= E:
            raise InputError(f"routing trace {name} names experts outside 0..{E - 1}; {redo}.")
        s = np.sort(ids, axis=-1)
        if k > 1 and np.any(s[..., 1:] == s[..., :-1]):
            raise InputError(f"routing trace {name} routes a token to the same expert twice; {redo}.")
        return cls(num_experts=E, top_k=k, layers=layers, ids=ids, arch=str(model.get("arch", "")),
                   checkpoint=str(model.get("checkpoint", "")), name=name)


class _Recorder:
    def __init__(self, layers: list[int]):
        self.chunks: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}

    def __call__(self, layer: int, ids: torch.Tensor) -> None:
        self.chunks[layer].append(ids.detach().clone())   # stays on the device until the end

    def trace(self, engine) -> RoutingTrace:
        layers = list(self.chunks)
        per_layer = [torch.cat(self.chunks[layer]) for layer in layers]
        if len({t.shape[0] for t in per_layer}) > 1:
            raise RuntimeError(f"MoE layers saw different token counts while tracing: {[t.shape[0] for t in per_layer]}")
        routed = torch.stack(per_layer, dim=1).cpu().numpy().astype(np.int64)   # the one read-back
        c = model_fingerprint(engine)
        return RoutingTrace(num_experts=c["num_experts"], top_k=c["top_k"], layers=layers, ids=routed,
                            arch=c["arch"], checkpoint=c["checkpoint"])


def record_trace(engine, prompts: Sequence[str | list[int]], max_tokens: int = 0) -> RoutingTrace:
    """Run the prompts (prefill, plus `max_tokens` greedy decode tokens each) and keep every routing."""
    return record_profile_and_trace(engine, prompts, max_tokens, profile=False)[1]


def record_profile_and_trace(engine, prompts: Sequence[str | list[int]], max_tokens: int = 0,
                             profile: bool = True, trace: bool = True) -> tuple[Profile | None, RoutingTrace | None]:
    """One pass over the prompts that records a profile, a trace, or both."""
    ids = encode_prompts(engine, prompts)
    counter = profile_counter(engine) if profile else None
    recorder = _Recorder([b.layer for b in engine.model.moe_blocks()]) if trace else None

    def observe(layer: int, routed: torch.Tensor) -> None:
        if counter is not None:
            counter(layer, routed)
        if recorder is not None:
            recorder(layer, routed)

    with observing(engine, observe):
        run_prompts(engine, ids, max_tokens)
    return (counter.profile(engine, len(ids)) if counter is not None else None,
            recorder.trace(engine) if recorder is not None else None)
