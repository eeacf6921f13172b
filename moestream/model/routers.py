"""Routers: from a token's hidden state to its k experts and their weights, one class per kind.

A router owns its parameters under the names the checkpoint uses (`weight`, `bias` where the
config says the router has one (GPT-OSS), and for `sigmoid_grouped` `e_score_correction_bias`), so the MoE block registers it as `gate` / `router`
and the loader maps names one to one. `ROUTERS` is the registry an ArchSpec's `router` names; a
new kind is one more class.

Every router returns (weights (T, k) fp32, ids (T, k)). `logits` and `predict` are separate so
that benchmarks can swap the expert *choice* while keeping the model's own probabilities, and so
that next-layer prefetch can ask for a cheap prediction.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moestream import kernels
from moestream.archs.spec import ModelConfig
from moestream.model.norms import UnscaledRMSNorm
from moestream.model.projections import Linear


class Router(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        # A bias on the logits (GPT-OSS's router): it shifts the choice and the weights alike.
        self.bias = nn.Parameter(torch.empty(config.num_experts)) if config.router_bias else None
        self.top_k = config.top_k

    def logits(self, h: Tensor) -> Tensor:
        """Router logits (T, E) for hidden states (T, H)."""
        return kernels.linear(h, self.weight, self.bias)

    def select(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def forward(self, h: Tensor) -> tuple[Tensor, Tensor]:
        return self.select(self.logits(h))

    def predict(self, h: Tensor) -> Tensor:
        """The k experts this router would pick for h (next-layer prefetch): ids (T, k)."""
        return self.logits(h).topk(self.top_k, dim=-1).indices


class SoftmaxTopK(Router):
    """Softmax over all experts, then the k largest; renormalised to sum 1 when the config says so."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.renormalise = config.norm_topk_prob

    def select(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        if kernels.fused_ops_enabled(logits):   # one launch instead of five
            return kernels.router_topk(logits, self.top_k, kernels.SOFTMAX_THEN_TOPK, self.renormalise)
        weights, ids = torch.topk(logits.float().softmax(dim=-1), self.top_k, dim=-1)
        if self.renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids


class TopKSoftmax(Router):
    """The k largest logits, then a softmax over those k (Mixtral)."""

    def select(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        if kernels.fused_ops_enabled(logits):
            return kernels.router_topk(logits, self.top_k, kernels.TOPK_THEN_SOFTMAX, False)
        values, ids = torch.topk(logits.float(), self.top_k, dim=-1)
        return values.softmax(dim=-1), ids


class SigmoidGrouped(Router):
    """Sigmoid scores, a correction bias that steers the choice only, group-limited top-k, routed
    scaling: GLM-4.5's router, and DeepSeek-V3's (its `noaux_tc`).

    `e_score_correction_bias` (per expert, learnt for load balance without an auxiliary loss) is
    added to the scores to *choose* experts; the weights are the chosen experts' unbiased scores.
    The experts form `n_group` equal groups, each scored by the sum of its two best biased scores;
    only the `topk_group` best groups compete for the top-k (DeepSeek-V3 keeps a token's experts on
    few devices that way). The weights are renormalised to sum 1 when norm_topk_prob says so, then
    multiplied by `routed_scaling_factor`. Logits are computed in fp32 from fp32 inputs, as
    transformers does: scores are close together, and a bf16 router would choose differently.
    Everything stays on the device (no value is read back), so it captures in CUDA graphs.
    """

    full_precision = ("e_score_correction_bias",)   # loaded in fp32, as transformers keeps it

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        # Kept in fp32 whatever the compute dtype (`full_precision`), as transformers does: a rounded
        # bias would break near-ties between experts differently.
        self.e_score_correction_bias = nn.Parameter(torch.empty(config.num_experts), requires_grad=False)
        self.groups, self.kept_groups = config.n_group, config.topk_group
        self.renormalise, self.scale = config.norm_topk_prob, config.routed_scaling_factor

    def logits(self, h: Tensor) -> Tensor:
        return F.linear(h.float(), self.weight.float())

    def choose(self, scores: Tensor) -> Tensor:
        """Expert ids (T, k) for sigmoid scores (T, E): biased top-k within the best groups."""
        biased = scores + self.e_score_correction_bias.float()
        if self.kept_groups < self.groups:   # with every group kept, the group step changes nothing
            T, E = biased.shape
            grouped = biased.view(T, self.groups, E // self.groups)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            kept = group_scores.topk(self.kept_groups, dim=-1).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
            biased = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(T, E)
        return biased.topk(self.top_k, dim=-1).indices

    def select(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        scores = logits.float().sigmoid()
        ids = self.choose(scores)
        weights = scores.gather(-1, ids)
        if self.renormalise:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids

    def predict(self, h: Tensor) -> Tensor:
        """The experts this router picks (the bias and the groups decide them, not the logits alone)."""
        return self.choose(self.logits(h).sigmoid())


class SoftmaxGrouped(Router):
    """Softmax scores, group-limited top-k, routed scaling: DeepSeek-V2's router, as transformers'
    DeepseekV2TopkRouter computes it.

    Logits and softmax in fp32 from fp32 inputs. With `n_group` > 1 (topk_method
    "group_limited_greedy"; the config reader leaves one group for "greedy") the experts form equal
    groups, each scored by its best expert, and the others' scores are zeroed outside the
    `topk_group` best groups before the top-k (zero, not -inf, as transformers masks: softmax scores
    are positive, so a masked expert never beats a kept one). The chosen experts' scores are the
    weights, renormalised when norm_topk_prob says so (DeepSeek-V2's readers refuse that: transformers
    ignores the key), then multiplied by `routed_scaling_factor`. Device work only.
    """

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.groups, self.kept_groups = config.n_group, config.topk_group
        self.renormalise, self.scale = config.norm_topk_prob, config.routed_scaling_factor

    def logits(self, h: Tensor) -> Tensor:
        return F.linear(h.float(), self.weight.float())

    def _limited(self, scores: Tensor) -> Tensor:
        """Scores with every expert outside the token's topk_group best groups set to zero."""
        if self.kept_groups >= self.groups:   # every group kept: nothing to mask
            return scores
        T, E = scores.shape
        grouped = scores.view(T, self.groups, E // self.groups)
        kept = grouped.amax(dim=-1).topk(self.kept_groups, dim=-1).indices
        keep = torch.zeros(T, self.groups, dtype=torch.bool, device=scores.device).scatter_(1, kept, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), 0.0).view(T, E)

    def select(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        weights, ids = self._limited(logits.float().softmax(dim=-1)).topk(self.top_k, dim=-1)
        if self.renormalise:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids

    def predict(self, h: Tensor) -> Tensor:
        """The experts this router picks (the groups decide them, not the logits alone)."""
        return self.select(self.logits(h))[1]


class ScaledSoftmaxTopK(nn.Module):
    """Gemma 4's router, as transformers' Gemma4TextRouter computes it: the residual stream (not a
    layer norm's output) normalised without a weight, times a learnt per-dim `scale` and
    1/sqrt(hidden), through `proj`; softmax over all experts in fp32, top-k, renormalised to sum 1,
    then each weight multiplied by its expert's learnt `per_expert_scale` (after the renormalising,
    so the weights need not sum to 1). Parameters are named as on disk (`router.proj.weight`,
    `router.scale`, `router.per_expert_scale`), so it is not a `Router` (whose weight is `weight`),
    but it answers the same calls. Device work only.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        H, E = config.hidden_size, config.num_experts
        self.norm = UnscaledRMSNorm(config.rms_norm_eps)
        self.proj = Linear(H, E, bias=False)
        self.scale = nn.Parameter(torch.empty(H))
        self.per_expert_scale = nn.Parameter(torch.empty(E))
        self.root, self.top_k = H ** -0.5, config.top_k

    def logits(self, h: Tensor) -> Tensor:
        """Router logits (T, E) for residual-stream states h (T, H)."""
        return self.proj(self.norm(h) * self.scale * self.root)

    def select(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        weights, ids = torch.topk(logits.softmax(dim=-1, dtype=torch.float32), self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids

    def forward(self, h: Tensor) -> tuple[Tensor, Tensor]:
        return self.select(self.logits(h))

    def predict(self, h: Tensor) -> Tensor:
        """The k experts this router picks (the scales come after the choice: the logits decide)."""
        return self.logits(h).topk(self.top_k, dim=-1).indices


ROUTERS: dict[str, type[nn.Module]] = {"softmax_topk": SoftmaxTopK, "topk_softmax": TopKSoftmax,
                                       "sigmoid_grouped": SigmoidGrouped, "softmax_grouped": SoftmaxGrouped,
                                       "scaled_softmax_topk": ScaledSoftmaxTopK}


class ChosenRouter(nn.Module):
    """Keeps a router's logits but lets `choose(logits) -> (weights, ids)` pick the experts.

    Benchmarks swap it in (uniform synthetic routing, trace replay) with `MoEBlock.swap_router`;
    the model then runs unchanged. `predict` falls back to the wrapped router unless `choose`
    brings its own (replayed prediction).
    """

    def __init__(self, inner: Router, choose: Callable[[Tensor], tuple[Tensor, Tensor]],
                 predict: Callable[[Tensor], Tensor] | None = None):
        super().__init__()
        self.inner, self.choose, self._predict = inner, choose, predict

    def logits(self, h: Tensor) -> Tensor:
        return self.inner.logits(h)

    def forward(self, h: Tensor) -> tuple[Tensor, Tensor]:
        return self.choose(self.inner.logits(h))

    def predict(self, h: Tensor) -> Tensor:
        return self._predict(h) if self._predict is not None else self.inner.predict(h)


class ObservedRouter(nn.Module):
    """Routes as the wrapped router does and hands every choice (ids (T, k), on the device) to
    `observe` (profiles, traces, discovery). The observer must not read ids back during a
    captured step."""

    def __init__(self, inner: nn.Module, observe: Callable[[Tensor], None]):
        super().__init__()
        self.inner, self.observe = inner, observe

    def logits(self, h: Tensor) -> Tensor:
        return self.inner.logits(h)

    def forward(self, h: Tensor) -> tuple[Tensor, Tensor]:
        weights, ids = self.inner(h)
        self.observe(ids)
        return weights, ids

    def predict(self, h: Tensor) -> Tensor:
        return self.inner.predict(h)
