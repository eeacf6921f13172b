"""Token sampling on the device: greedy, temperature, top-k, top-p, min-p, seeded."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moestream import kernels
from moestream.errors import InputError
from moestream.kernels.switch import Switch


@dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0        # 0 → greedy
    top_k: int = 0                  # 0 → off
    top_p: float = 1.0              # 1 → off
    min_p: float = 0.0              # 0 → off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def validate(self) -> None:
        for name in ("max_tokens", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InputError(f"{name} must be an integer, got {value!r}.")
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InputError(f"{name} must be a number, got {value!r}.")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise InputError(f"stop strings must be non-empty text, got {self.stop!r}.")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -2**63 <= self.seed < 2**64):
            raise InputError(f"seed must be an integer in -2^63..2^64-1, got {self.seed!r}.")
        if self.max_tokens < 1:
            raise InputError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if not 0 <= self.temperature < float("inf"):   # also rejects nan
            raise InputError(f"temperature must be >= 0, got {self.temperature}.")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}.")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not 0 <= self.min_p < 1:
            raise InputError(f"min_p must be in [0, 1), got {self.min_p}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled fp32 logits with everything outside top-k / top-p / min-p set to -inf (a
    tie at the k-th logit keeps every tied token)."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.min_p > 0:
        logits = _min_p(logits, params.min_p)
    if params.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        drop = torch.zeros_like(sorted_logits, dtype=torch.bool).scatter(-1, order, _top_p_drop(sorted_logits, params.top_p))
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop the tokens less likely than min_p times the most likely one (any order)."""
    probs = logits.softmax(-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p
    return logits.masked_fill(probs < threshold, float("-inf"))


def _top_p_drop(sorted_logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Of logits sorted best first, the ones top-p drops: a token goes when the tokens ranked above it
    already reach top_p (the top one always stays)."""
    probs = sorted_logits.softmax(-1)
    return (probs.cumsum(-1) - probs) >= top_p


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Next token ids (B,) from logits (B, V), without leaving the device.

    With top-k the other filters and the draw act on the k best tokens only (`draw_top_k`): the same
    distribution as filtering the whole row, without a sort or a filter pass over the vocabulary (a
    tie at the k-th logit keeps k of the tied tokens here). With temperature alone the draw is a
    Gumbel-max race over the scaled logits (argmax of logit / T + Gumbel noise: the softmax's
    distribution, without the softmax, whose single-row launch reads the vocabulary on one block)."""
    if params.greedy:
        return logits.argmax(dim=-1)
    if params.top_k and params.top_k < logits.shape[-1]:
        uniform = torch.rand(logits.shape[0], generator=generator, device=logits.device)
        return draw_top_k(logits, params, uniform)
    if params.top_p == 1 and params.min_p == 0:
        scaled = logits.float() / params.temperature
        uniform = torch.rand(scaled.shape, generator=generator, device=scaled.device)   # [0, 1): 0 gives -inf
        return (scaled - uniform.log_().neg_().log_()).argmax(dim=-1)
    probs = filter_logits(logits, params).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


_draw_kernel_on = Switch()


def draw_kernel(enabled: bool):
    """Switch the two-launch top-k draw (kernels/sampling_triton.py) on or off inside the block (A/B
    benchmarks; off: `draw_top_k_reference` on CUDA too)."""
    return _draw_kernel_on.set(enabled)


def draw_top_k(logits: torch.Tensor, params: SamplingParams, uniform: torch.Tensor) -> torch.Tensor:
    """Token ids (B,) among each row's top_k best logits, filtered by temperature, min-p and top-p,
    at each row's uniform number in [0, 1): two launches on CUDA (`kernels.sample_top_k`), else
    `draw_top_k_reference`."""
    k = params.top_k
    if _draw_kernel_on.on and kernels.sampling_kernel_takes(logits, k):
        return kernels.sample_top_k(logits, k, params.temperature, params.top_p, params.min_p, uniform)
    return draw_top_k_reference(logits, params, uniform)


def draw_top_k_reference(logits: torch.Tensor, params: SamplingParams, uniform: torch.Tensor) -> torch.Tensor:
    """The spec of the top-k draw in plain torch: the k best scaled logits, best first (`top_k`), min-p,
    then top-p over what it left, then the token where the kept tokens' cumulative probability first
    passes the row's uniform number."""
    values, ids = top_k(logits.float() / params.temperature, params.top_k)
    if params.min_p > 0:
        values = _min_p(values, params.min_p)
    if params.top_p < 1:
        values = values.masked_fill(_top_p_drop(values, params.top_p), float("-inf"))
    weights = (values - values[:, :1]).exp()                    # best first: the kept ones lead
    cdf = weights.cumsum(-1)
    pick = (cdf <= uniform[:, None] * cdf[:, -1:]).sum(-1, keepdim=True)
    pick = pick.clamp(max=torch.isfinite(values).sum(-1, keepdim=True) - 1)
    return ids.gather(-1, pick).squeeze(-1)


SPLIT_TOP_K_FROM = 16384   # row length from which `top_k` works in two stages
TOP_K_CHUNKS = 128


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.topk(x, k, dim=-1)` (values sorted best first, their indices) for 2-D `x`; a long row
    goes in two stages, the best k of each of `TOP_K_CHUNKS` chunks, then the best k of those, since
    one long row's top-k runs on one block of the GPU."""
    rows, n = x.shape
    if n < SPLIT_TOP_K_FROM or k > n // TOP_K_CHUNKS:
        return torch.topk(x, k, dim=-1)
    width = -(-n // TOP_K_CHUNKS)
    if width * TOP_K_CHUNKS > n:   # pad: -inf never beats a finite logit, and k <= n finite ones exist
        x = torch.nn.functional.pad(x, (0, width * TOP_K_CHUNKS - n), value=float("-inf"))
    values, ids = torch.topk(x.view(rows, TOP_K_CHUNKS, width), k, dim=-1)
    ids += torch.arange(0, TOP_K_CHUNKS * width, width, device=x.device)[:, None]
    best, where = torch.topk(values.view(rows, -1), k, dim=-1)
    return best, ids.view(rows, -1).gather(-1, where)


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> torch.Tensor:
    """Next token ids (B,) for a batch whose rows have their own parameters and generators.

    All-greedy batches take one argmax; otherwise every sampled row draws from its own
    generator (a request's seed reproduces its tokens whatever else is in the batch)."""
    if len(params) == 1:
        return sample(logits, params[0], generators[0])
    if all(p.greedy for p in params):
        return logits.argmax(dim=-1)
    rows = [sample(logits[i:i + 1], p, g) for i, (p, g) in enumerate(zip(params, generators))]
    return torch.cat(rows)


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.greedy:
        return None
    g = torch.Generator(device=device)
    if params.seed is not None:
        g.manual_seed(params.seed)
    else:
        g.seed()
    return g
