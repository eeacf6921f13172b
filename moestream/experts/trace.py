"""Routing traces (benchmark-only): the expert ids a model chose, per token and MoE layer, replayed later.

`record_trace` runs prompts with a routing observer and keeps the k routed ids of every token at
every MoE layer. `TraceRouting` is a `routing_override` that makes a model route by a trace
instead of by its router: benchmarks then see real routing statistics on any checkpoint of the
same expert count and top-k (random weights included). Results that used it are labelled.

Replay stays on the device (trace tensor, token cursor and its advance are device ops), so it
works inside a captured CUDA graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moestream.errors import InputError
from moestream.experts.profile import (
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


class TraceRouting:
    """routing_override replaying a trace: (layer, router logits (T, E)) -> (weights (T, k) fp32, ids (T, k)).

    The i-th MoE layer of the target model (`moe_layers`: their absolute indices, or an int n for
    a model whose layers 0..n-1 are all MoE) replays trace layer i mod the trace's layer count.
    Tokens t of a forward take trace rows (cursor + t) mod N; the cursor advances by T after the
    target's last MoE layer. Weights are the router's own softmax probabilities at the replayed
    ids, renormalised. Everything per call is device arithmetic: safe inside CUDA-graph capture.
    """

    def __init__(self, trace: RoutingTrace, device: torch.device | str, moe_layers: int | Sequence[int],
                 num_experts: int | None = None, top_k: int | None = None):
        if num_experts is not None and num_experts != trace.num_experts:
            raise InputError(f"routing trace {trace.name} has {trace.num_experts} experts per layer but this model has "
                             f"{num_experts}; record a trace on a model with the same experts.")
        if top_k is not None and top_k != trace.top_k:
            raise InputError(f"routing trace {trace.name} routes top-{trace.top_k} but this model routes top-{top_k}; "
                             "record a trace on a model with the same top-k.")
        layers = list(range(moe_layers)) if isinstance(moe_layers, int) else sorted(int(x) for x in moe_layers)
        if not layers:
            raise InputError("the model has no MoE layers to replay a routing trace on.")
        L = len(trace.layers)
        self.trace_layer = {layer: i % L for i, layer in enumerate(layers)}
        self.last_layer = layers[-1]
        self.num_experts, self.top_k, self.tokens = trace.num_experts, trace.top_k, trace.tokens
        ids = torch.as_tensor(trace.ids, dtype=torch.long)
        self.per_layer = [ids[:, i].contiguous().to(device) for i in range(L)]   # (N, k) each
        self.cursor = torch.zeros((), dtype=torch.long, device=device)
        self.label = f"trace replay ({trace.name})"
        self.prediction_accuracy: float | None = None

    def predict(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """Next-layer prediction under replay (benchmark-only): the target model's own router says
        nothing about replayed routing, so the prediction is drawn from the replayed ids of `layer`
        at this forward's rows, each id kept with probability `prediction_accuracy` (measured on
        the model the trace came from) and otherwise replaced by a uniformly random expert.
        None means the plain router prediction (set the accuracy to model prefetch)."""
        T = h.shape[0]
        rows = (self.cursor + torch.arange(T, device=h.device)) % self.tokens
        ids = self.per_layer[self.trace_layer[layer]].index_select(0, rows)
        keep = torch.rand(ids.shape, device=h.device) < self.prediction_accuracy
        return torch.where(keep, ids, torch.randint_like(ids, self.num_experts))

    @classmethod
    def for_engine(cls, trace: RoutingTrace, engine) -> TraceRouting:
        return cls(trace, engine.device, [b.layer for b in engine.model.moe_blocks()],
                   num_experts=engine.config.num_experts, top_k=engine.config.top_k)

    def reset(self) -> None:
        """Start again at the trace's first token (a device op: fine between graph replays)."""
        self.cursor.zero_()

    def __call__(self, layer: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T, E = logits.shape
        if E != self.num_experts:
            raise InputError(f"the routing trace has {self.num_experts} experts per layer but this router has {E}.")
        rows = (self.cursor + torch.arange(T, device=logits.device)) % self.tokens
        ids = self.per_layer[self.trace_layer[layer]].index_select(0, rows)
        weights = logits.float().softmax(-1).gather(-1, ids)
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
        if layer == self.last_layer:
            self.cursor.add_(T).remainder_(self.tokens)
        return weights, ids
