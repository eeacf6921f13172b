"""Benchmark routing: the expert choice swapped for a synthetic or a replayed one (labelled in results).

Random-weight checkpoints do not route near-uniformly: their hidden states are so alike that
the routers pick nearly the same experts for every token, a best case for a bank. Benchmarks
therefore choose the routing: `UniformRouting` (k distinct experts per token drawn uniformly on
the device, the worst case for a bank) or `TraceRouting` (a recorded trace of a trained model's
routing, replayed token by token). `use_routing` swaps every MoE block's router for a
`ChosenRouter` around it: the model's own logits still give the weights at the chosen ids, and
nothing in the model checks for an override on its hot path.

Both are device arithmetic only (no read-back), so they work inside captured CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moestream import kernels
from moestream.errors import InputError
from moestream.warmstart.trace import RoutingTrace


class UniformRouting:
    """k distinct experts per token drawn uniformly; the router's own probabilities kept at the drawn
    ids and renormalised, so the expert weights stay realistic while the choice is the worst case.

    On CUDA with the fused ops one launch per layer draws and weights (`kernels.uniform_topk`), as
    the model's own router takes one: the benchmark's routing then costs what a real router costs
    (the torch form, seven launches per layer, added ~19 µs to every layer of a decode step). The
    random streams come from `seed` (0 unless given) and a counter: a device counter
    on CUDA, a host one for the CPU's torch form; so ranks given the same routing draw alike."""

    label = "uniform (synthetic)"   # what a bench result's `routing` field says
    prediction_accuracy = None

    def __init__(self, top_k: int, device: torch.device | str | None = None, seed: int = 0):
        self.top_k = top_k
        self.seed = seed   # fixed by default: a benchmark run draws the same routing in every process
        self.calls = 0   # the CPU form's draws so far (its generator is seeded from seed + calls)
        self.draws: torch.Tensor | None = None   # rows drawn so far, on the device (made outside any capture)
        if device is not None and torch.device(device).type == "cuda":
            self.draws = torch.zeros(1, dtype=torch.int64, device=device)

    def __call__(self, layer: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if kernels.fused_ops_enabled(logits):
            if self.draws is None or self.draws.device != logits.device:
                if torch.cuda.is_current_stream_capturing():   # a counter made in a capture restarts every replay
                    raise RuntimeError("UniformRouting needs its device counter before a CUDA graph is captured; "
                                       "give it the device when making it")
                self.draws = torch.zeros(1, dtype=torch.int64, device=logits.device)
            return kernels.uniform_topk(logits, self.top_k, self.draws, self.seed)
        generator = None
        if logits.device.type == "cpu":   # from the seed, so every CPU rank of a group draws alike
            generator = torch.Generator().manual_seed(self.seed + self.calls)
            self.calls += 1
        ids = torch.rand(logits.shape, device=logits.device, generator=generator).topk(self.top_k, dim=-1).indices
        weights = logits.float().softmax(-1).gather(-1, ids)
        return weights / weights.sum(-1, keepdim=True), ids

    def to(self, device: torch.device | str) -> UniformRouting:
        """This routing with its draw counter on `device` (a rank's own copy after unpickling)."""
        if torch.device(device).type == "cuda" and (self.draws is None or self.draws.device != torch.device(device)):
            self.draws = torch.zeros(1, dtype=torch.int64, device=device)
        return self

    def __getstate__(self) -> dict:
        return {**self.__dict__, "draws": None}   # the counter is a device tensor: each rank makes its own

    def reset(self) -> None:
        """Start the draws again (on CUDA the torch form follows torch's generator): a
        run after a reset draws what the last one drew (a device op: fine between graph replays)."""
        self.calls = 0
        if self.draws is not None:
            self.draws.zero_()


class TraceRouting:
    """Replays a trace: (layer, router logits (T, E)) -> (weights (T, k) fp32, ids (T, k)).

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

    def to(self, device: torch.device | str) -> TraceRouting:
        """This replay with its ids and cursor on `device` (a rank's own copy after unpickling)."""
        self.per_layer = [ids.to(device) for ids in self.per_layer]
        self.cursor = self.cursor.to(device)
        return self

    def __getstate__(self) -> dict:
        return {**self.__dict__, "per_layer": [ids.cpu() for ids in self.per_layer], "cursor": self.cursor.cpu()}

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


def use_routing(engine, routing: UniformRouting | TraceRouting) -> None:
    """Make every MoE block of `engine` choose its experts by `routing` (benchmark-only). A routing
    swapped in earlier is replaced, not stacked. With a replayed prediction accuracy set, next-layer
    prefetch predicts from the trace too. With several devices every rank swaps in the same routing
    (uniform draws from one seed, a replay from one trace), so the followers route as rank 0 does;
    reset it with `engine.runner.reset_routing()` so they start again together."""
    engine.runner.use_routing(routing)


def apply_routing(engine, kind: str, trace_path=None) -> UniformRouting | TraceRouting | None:
    """The benchmark routing a script's `--routing model|uniform|trace [--trace FILE]` names, swapped
    into `engine` (None for the model's own). One place for every benchmark's choice."""
    if kind == "model":
        return None
    if kind == "uniform":
        routing = UniformRouting(engine.config.top_k, engine.device)
    elif kind == "trace":
        if trace_path is None:
            raise InputError("--routing trace needs a routing trace; give --trace FILE.")
        routing = TraceRouting.for_engine(RoutingTrace.load(trace_path), engine)
    else:
        raise InputError(f"unknown routing {kind!r}; use model, uniform or trace.")
    use_routing(engine, routing)
    return routing
