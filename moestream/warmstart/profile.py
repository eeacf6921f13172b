"""Profiles: per-layer expert activation frequencies measured on real prompts, saved as JSON.

A profile says, for every MoE layer, which fraction of tokens each expert was routed to (the
fractions of a layer sum to top-k). It is used twice: to *pin* the experts that matter most
(`Profile.pinned`, before the bank fills) and to *seed* the residency policy and the bank's
other slots with the profile's ranking (`apply_profile`), so a cold bank starts warm.

Recording attaches a routing observer to every MoE block; counts accumulate on the device
(index_add_ into an (L, E) tensor) and are read back once at the end.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from moestream.errors import InputError
from moestream.fileio import write_json_atomic
from moestream.model.routers import ObservedRouter

PROFILE_FORMAT = "moestream-profile"
PROFILE_VERSION = 1
# A profile seeds the LCP statistics as if this many tokens had just been routed by its frequencies:
# strong enough to outrank experts seen once or twice, gone after a few LCP half-lives of other use.
SEED_TOKENS = 128.0


# ---- shared helpers (traces use them too) -------------------------------------------------
def read_json(path: str | Path, what: str, how_to_make: str) -> dict:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{what} file {path} does not exist; {how_to_make}.")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        raise InputError(f"{what} file {path} is not valid JSON; {how_to_make} again.") from None
    if not isinstance(data, dict):
        raise InputError(f"{what} file {path} does not hold a JSON object; {how_to_make} again.")
    return data


def model_fingerprint(engine) -> dict:
    c = engine.config
    return {"arch": c.arch, "num_layers": c.num_layers, "num_experts": c.num_experts, "top_k": c.top_k,
            "checkpoint": engine.folder.name}


def encode_prompts(engine, prompts: Sequence[str | list[int]]) -> list[list[int]]:
    if not prompts:
        raise InputError("no prompts were given; give at least one prompt to record.")
    return [engine.encode(p) for p in prompts]


@contextmanager
def observing(engine, observer: Callable[[int, torch.Tensor], None]) -> Iterator[None]:
    """Route every MoE block through an ObservedRouter that calls `observer(layer, ids)` (nested
    inside any observer already there) and run eagerly meanwhile: decode graphs captured without
    it would not call it, and capturing with it would count the capture's warm-up steps."""
    blocks = engine.model.moe_blocks()
    previous = [b.swap_router(ObservedRouter(b.router, functools.partial(observer, b.layer))) for b in blocks]
    try:
        with engine.runner.eager():
            yield
    finally:
        for b, router in zip(blocks, previous):
            b.swap_router(router)


def run_prompts(engine, prompts: list[list[int]], max_tokens: int) -> None:
    """Prefill each prompt alone, then decode `max_tokens` greedy tokens (the model sees
    len(prompt) + max_tokens tokens per prompt; end-of-sequence does not stop it)."""
    if max_tokens < 0:
        raise InputError(f"max_tokens must be 0 or more, got {max_tokens}.")
    for ids in prompts:
        engine.generate(ids, max_tokens=max_tokens + 1, temperature=0.0, ignore_eos=True)


# ---- the profile --------------------------------------------------------------------------
@dataclass
class Profile:
    arch: str
    num_layers: int
    num_experts: int
    top_k: int
    checkpoint: str                         # the checkpoint folder's name (informative only)
    tokens: int                             # tokens each MoE layer saw while recording
    frequencies: dict[int, list[float]] = field(default_factory=dict)   # MoE layer → fraction per expert
    prompts: int = 0

    # ---- persistence --------------------------------------------------------------------
    def as_dict(self) -> dict:
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION,
                "model": {"arch": self.arch, "num_layers": self.num_layers, "num_experts": self.num_experts,
                          "top_k": self.top_k, "checkpoint": self.checkpoint},
                "tokens": self.tokens, "prompts": self.prompts,
                "frequencies": {str(layer): list(map(float, f)) for layer, f in sorted(self.frequencies.items())}}

    def save(self, path: str | Path) -> None:
        write_json_atomic(path, self.as_dict())

    @classmethod
    def load(cls, path: str | Path, config=None) -> Profile:
        """Read and validate a profile; with a ModelConfig, also check that it fits that model."""
        redo = "record it with `moestream profile MODEL --prompts FILE --out PROFILE`"
        data = read_json(path, "profile", redo)
        name = Path(path).name
        try:
            if data.get("format") != PROFILE_FORMAT:
                raise ValueError
            m = data["model"]
            profile = cls(arch=str(m["arch"]), num_layers=int(m["num_layers"]), num_experts=int(m["num_experts"]),
                          top_k=int(m["top_k"]), checkpoint=str(m.get("checkpoint", "")), tokens=int(data["tokens"]),
                          prompts=int(data.get("prompts", 0)),
                          frequencies={int(k): [float(x) for x in v] for k, v in data["frequencies"].items()})
        except (KeyError, TypeError, ValueError, AttributeError):
            raise InputError(f"profile {name} is not a moestream profile (fields missing or malformed); {redo}.") from None
        E = profile.num_experts
        for layer, f in profile.frequencies.items():
            a = np.asarray(f)
            if len(f) != E or not np.all(np.isfinite(a)) or a.min(initial=0) < 0 or a.max(initial=0) > 1 + 1e-6:
                raise InputError(f"profile {name} holds bad frequencies for layer {layer} (need {E} fractions in 0..1); {redo}.")
        if config is not None:
            profile.check_fits(config, name)
        return profile

    def check_fits(self, config, name: str = "the profile") -> None:
        redo = "record a profile for this model with `moestream profile`"
        if (self.num_experts, self.num_layers) != (config.num_experts, config.num_layers):
            raise InputError(f"{name} was recorded on a model with {self.num_layers} layers and {self.num_experts} "
                             f"experts, but this model has {config.num_layers} layers and {config.num_experts} experts; {redo}.")
        if self.arch != config.arch or self.top_k != config.top_k:
            raise InputError(f"{name} was recorded on a {self.arch} model with top-{self.top_k} routing, but this is "
                             f"a {config.arch} model with top-{config.top_k}; {redo}.")
        moe = {i for i, is_moe in enumerate(config.moe_layers) if is_moe}
        if set(self.frequencies) != moe:
            raise InputError(f"{name} covers layers {sorted(self.frequencies)} but this model's MoE layers are "
                             f"{sorted(moe)}; {redo}.")

    # ---- use ----------------------------------------------------------------------------
    def array(self, layer: int) -> np.ndarray:
        return np.asarray(self.frequencies[layer], dtype=np.float64)

    def ranking(self, layer: int) -> list[int]:
        """All experts of a layer, most used first (ties: lower id first)."""
        return np.argsort(-self.array(layer), kind="stable").tolist()

    def top(self, layer: int, n: int = 3) -> list[tuple[int, float]]:
        f = self.array(layer)
        return [(e, float(f[e])) for e in self.ranking(layer)[:n]]

    def pinned(self, top_k: int | None = None, threshold: float | None = None) -> dict[int, list[int]]:
        """Experts to pin per layer: the `top_k` most used ones (experts never used are left out),
        or those active on more than `threshold` of the tokens. Neither: nothing is pinned."""
        if top_k is not None and threshold is not None:
            raise InputError("give either a pin top-k or a pin threshold, not both.")
        if top_k is None and threshold is None:
            return {}
        if top_k is not None and not 0 <= top_k <= self.num_experts:
            raise InputError(f"--pin-top-k must be in 0..{self.num_experts}, got {top_k}.")
        if threshold is not None and not 0.0 <= threshold <= 1.0:
            raise InputError(f"--pin-threshold is a fraction of tokens in 0..1, got {threshold}.")
        out = {}
        for layer in sorted(self.frequencies):
            f = self.array(layer)
            if top_k is not None:
                chosen = [e for e in self.ranking(layer)[:top_k] if f[e] > 0]
            else:
                chosen = np.nonzero(f > threshold)[0].tolist()
            if chosen:
                out[layer] = sorted(chosen)
        return out

    def summary(self, n: int = 3) -> str:
        lines = [(f"{self.tokens} tokens ({self.prompts} prompts) on {self.checkpoint or self.arch}: "
                  f"{self.num_experts} experts, top-{self.top_k}")]
        for layer in sorted(self.frequencies):
            tops = ", ".join(f"e{e} {share:.1%}" for e, share in self.top(layer, n))
            lines.append(f"layer {layer:>3}  {tops}")
        return "\n".join(lines)


class _Counter:
    """The routing observer of a profile run: counts per (MoE layer, expert) on the device."""

    def __init__(self, layers: list[int], num_experts: int, device: torch.device):
        self.row = {layer: i for i, layer in enumerate(layers)}
        self.counts = torch.zeros(len(layers), num_experts, dtype=torch.int64, device=device)
        self.seen = torch.zeros(len(layers), dtype=torch.int64, device=device)

    def __call__(self, layer: int, ids: torch.Tensor) -> None:
        r = self.row[layer]
        flat = ids.reshape(-1)
        self.counts[r].index_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))
        self.seen[r:r + 1].add_(ids.shape[0])


    def profile(self, engine, prompts: int) -> Profile:
        """Read the counts back (once) and turn them into a Profile."""
        counts = self.counts.cpu().numpy()
        seen = self.seen.cpu().numpy()
        if len(set(seen.tolist())) > 1:
            raise RuntimeError(f"MoE layers saw different token counts while profiling: {seen.tolist()}")
        tokens = int(seen[0]) if len(seen) else 0
        freqs = {layer: (counts[i] / max(tokens, 1)).tolist() for layer, i in self.row.items()}
        c = model_fingerprint(engine)
        return Profile(arch=c["arch"], num_layers=c["num_layers"], num_experts=c["num_experts"], top_k=c["top_k"],
                       checkpoint=c["checkpoint"], tokens=tokens, frequencies=freqs, prompts=prompts)


def profile_counter(engine) -> _Counter:
    return _Counter([b.layer for b in engine.model.moe_blocks()], engine.config.num_experts, engine.device)


def record_profile(engine, prompts: Sequence[str | list[int]], max_tokens: int = 0) -> Profile:
    """Run the prompts (prefill, plus `max_tokens` greedy decode tokens each) and count routing."""
    ids = encode_prompts(engine, prompts)
    counter = profile_counter(engine)
    with observing(engine, counter):
        run_prompts(engine, ids, max_tokens)
    return counter.profile(engine, len(ids))


# ---- seeding the bank ---------------------------------------------------------------------
def _bank_of(engine_or_bank):
    return getattr(engine_or_bank, "bank", engine_or_bank)


def profile_seed(profile: Profile, seed_tokens: float = SEED_TOKENS) -> dict[int, np.ndarray]:
    """What `policy.seed` gets per MoE layer: the profile's fractions as pseudo-counts of `seed_tokens` tokens."""
    return {layer: profile.array(layer) * seed_tokens for layer in profile.frequencies}


def apply_profile(engine_or_bank, profile: Profile, seed_tokens: float = SEED_TOKENS, refill: bool = True) -> int:
    """Seed the residency policy of every MoE layer with the profile, then (unless `refill` is
    False) fill the bank's non-pinned slots with the profile's most used experts. Returns how many
    experts were copied (0 when the bank holds every expert: seeding then changes statistics only)."""
    bank = _bank_of(engine_or_bank)
    if profile.num_experts != bank.num_experts:
        raise InputError(f"the profile has {profile.num_experts} experts per layer but the model has "
                         f"{bank.num_experts}; record a profile for this model with `moestream profile`.")
    missing = [layer for layer in bank.layers if layer not in profile.frequencies]
    if missing:
        raise InputError(f"the profile has no frequencies for MoE layers {missing}; record a profile for this "
                         "model with `moestream profile`.")
    seed = profile_seed(profile, seed_tokens)
    for layer in bank.layers:
        bank.policy.seed(layer, seed[layer])
    if bank.fully_resident or not refill:
        return 0
    if not bank.slots.is_filled():
        bank.fill()   # pinned first, then the policy's ranking: the profile's, just seeded
        return sum(bank.capacity for _ in bank.layers)
    copied = 0
    for layer in bank.layers:
        pinned = sorted(bank.policy.pinned.get(layer, ()))
        rest = [e for e in profile.ranking(layer) if e not in set(pinned)]
        copied += bank.swap_in(layer, (pinned + rest)[: bank.capacity])
    return copied


def prepare_profile(profile, config, pin_top_k: int | None = None, pin_threshold: float | None = None,
                    pinned: dict[int, list[int]] | None = None) -> tuple[Profile | None, dict[int, list[int]] | None]:
    """Before loading: read and check a profile (a path or a Profile) against the model's config
    (no weights read) and merge its pins with explicit ones. Returns (profile or None, pins)."""
    if profile is None:
        if pin_top_k is not None or pin_threshold is not None:
            raise InputError("--pin-top-k and --pin-threshold need a profile; pass --profile PROFILE.json.")
        return None, pinned
    if isinstance(profile, Profile):
        profile.check_fits(config)
    else:
        profile = Profile.load(profile, config)
    pins = {int(k): list(v) for k, v in (pinned or {}).items()}
    for layer, experts in profile.pinned(pin_top_k, pin_threshold).items():
        pins[layer] = sorted(set(pins.get(layer, [])) | set(experts))
    return profile, (pins or None)
