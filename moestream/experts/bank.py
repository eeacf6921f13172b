"""The bank: per MoE layer, stacked device tensors of expert slots and a device slot map.

gate_up (S, 2I, H) and down (S, H, I) hold S = capacity experts; slot_map (E,) int32 maps an
expert id to its slot (-1 when not resident). Dispatch turns routed ids into slots with one
device-side gather and runs one fused kernel over the slots.

Capacity = E takes the same path with an identity slot map and never reads anything back.
Below E, the miss policy decides:
  fetch (exact): the layer reads its routing back once, copies missing experts into evicted
         slots (residency policy picks them), then runs the kernel over the updated slot map.
         Calls that route to more experts than the bank can take at once (long prompts) keep
         the bank as it is and stream the missing experts through a double-buffered staging
         area instead, so a prompt neither thrashes the decode bank nor needs every expert.
  skip:  (decode steps; prompts stay exact) non-resident experts get weight 0 and the others are renormalised, on the device,
         with no sync; every `refresh_every` tokens the bank swaps its coldest experts for the
         most-missed ones, from counters kept on the device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from moestream.errors import BudgetError, InputError
from moestream.experts.host_tier import DiskHostTier, PinnedHostTier, read_experts_into
from moestream.experts.residency import POLICIES, ResidencyPolicy
from moestream.experts.stats import BankStats
from moestream.experts.store import ExpertStore

MISS_POLICIES = ("fetch", "skip")
PREFETCH_WARMUP_CALLS = 16     # predicted calls per layer before prefetch is judged
PREFETCH_EMA = 1 / 32          # weight of the newest call in the moving accuracy
PREFETCH_MIN_ACCURACY = 0.3    # below this share of right predictions a layer stops prefetching


@dataclass
class LayerBank:
    gate_up: torch.Tensor   # (S, 2I, H)
    down: torch.Tensor      # (S, H, I)
    slot_map: torch.Tensor  # (E,) int32 on the device
    owner: list[int]        # host mirror: slot → expert id, -1 when free
    where: dict[int, int]   # host mirror: expert id → slot


def select_dispatch(device: torch.device):
    """The fused Triton kernel on CUDA when Triton is there, else the plain-torch reference."""
    from moestream import kernels

    if device.type == "cuda" and kernels.fused_moe_available():
        return kernels.fused_moe
    return kernels.moe_reference


class ExpertBank:
    def __init__(self, store: ExpertStore, device: torch.device, dtype: torch.dtype, capacity: int | None = None,
                 miss_policy: str = "fetch", residency: str = "lcp", host_tier: str = "auto",
                 host_memory: int | None = None, staging_slots: int = 0, pinned: dict[int, list[int]] | None = None,
                 refresh_every: int = 16, prefetch: bool = False, fill: bool = True):
        config = store.config
        self.store, self.device, self.dtype = store, device, dtype
        self.num_experts, self.top_k = config.num_experts, config.top_k
        self.capacity = capacity or config.num_experts
        if not self.top_k <= self.capacity <= self.num_experts:
            raise BudgetError(f"capacity {self.capacity} is outside {self.top_k}..{self.num_experts}: a layer needs at "
                              f"least its top-{self.top_k} experts and has only {self.num_experts}; pick a capacity in that range.")
        if miss_policy not in MISS_POLICIES:
            raise InputError(f"miss policy {miss_policy!r} is unknown; use one of {', '.join(MISS_POLICIES)}.")
        if residency not in POLICIES:
            raise InputError(f"residency policy {residency!r} is unknown; use one of {', '.join(POLICIES)}.")
        self.miss_policy = miss_policy
        self.policy: ResidencyPolicy = POLICIES[residency](self.num_experts)
        self.stats = BankStats()
        self.refresh_every = refresh_every
        self.fully_resident = self.capacity == self.num_experts
        self.slot_bytes = config.expert_numel() * torch.empty((), dtype=dtype).element_size()
        self._dispatch = select_dispatch(device)
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        for layer, experts in (pinned or {}).items():
            self.pin(layer, experts, load=False)
        self.tier = None if self.fully_resident else self._make_tier(host_tier, host_memory)
        self.layers: dict[int, LayerBank] = {layer: self._empty_layer() for layer in store.moe_layers}
        if fill:   # fill=False: the loader restores a snapshot or seeds the policy (discovery, profile) first
            self.fill()
        self.staging = self._make_staging(staging_slots) if not self.fully_resident else []
        self._staging_turn = 0
        self._staging_done: list[torch.cuda.Event | None] = [None] * len(self.staging)
        if miss_policy == "skip" and not self.fully_resident:
            E = self.num_experts
            self.miss_counts = {l: torch.zeros(E, dtype=torch.int32, device=device) for l in self.layers}
            self.use_counts = {l: torch.zeros(E, dtype=torch.int32, device=device) for l in self.layers}
            self.pair_counts = {l: torch.zeros(2, dtype=torch.int64, device=device) for l in self.layers}
        self._since_refresh = 0
        self.decoding = False  # set by the model per step: skip applies to decode steps only
        self.prefetch_enabled = prefetch
        self._pending: dict[int, torch.cuda.Event] = {}   # layer → copies issued by prefetch
        self._predicted: dict[int, set[int]] = {}          # layer → experts predicted for its next call
        self._recent_accuracy: dict[int, tuple[float, int]] = {}  # layer → (moving accuracy, calls)
        self._prefetched: dict[int, set[int]] = {}         # layer → experts copied ahead for its next call

    # ---- construction -------------------------------------------------------------------
    def _make_tier(self, kind, host_memory: int | None):
        if not isinstance(kind, str):   # an existing tier, shared between banks of one store
            return kind
        if self.device.type == "cpu":
            return DiskHostTier(self.store, self.device)
        total = self.slot_bytes * self.num_experts * len(self.store.moe_layers)
        if kind == "auto":
            limit = host_memory if host_memory is not None else int(0.6 * _available_ram())
            kind = "pinned" if total <= limit else "disk"
        if kind == "pinned":
            return PinnedHostTier(self.store, self.dtype)
        if kind == "disk":
            return DiskHostTier(self.store, self.device)
        raise InputError(f"host tier {kind!r} is unknown; use auto, pinned or disk.")

    def _initial_experts(self, layer: int) -> list[int]:
        """Pinned first, then the policy's ranking (seeded by a profile when there is one)."""
        pinned = sorted(self.policy.pinned.get(layer, ()))
        rest = [e for e in self.policy.ranking(layer) if e not in set(pinned)]
        return (pinned + rest)[: self.capacity]

    def _empty_layer(self) -> LayerBank:
        """Slots allocated, nothing resident: filled by `fill` or restored from a prepacked snapshot."""
        S, E = self.capacity, self.num_experts
        gate_up = torch.empty((S, *self.store.gate_up_shape), dtype=self.dtype, device=self.device)
        down = torch.empty((S, *self.store.down_shape), dtype=self.dtype, device=self.device)
        slot_map = torch.full((E,), -1, dtype=torch.int32, device=self.device)
        return LayerBank(gate_up, down, slot_map, [-1] * S, {})

    def fill(self) -> None:
        """Read every slot's expert from the host tier or the checkpoint (all of them at capacity E)."""
        for layer, bank in self.layers.items():
            experts = list(range(self.num_experts)) if self.fully_resident else self._initial_experts(layer)
            self._load_slots(layer, experts, bank.gate_up, bank.down)
            slot_map = torch.full((self.num_experts,), -1, dtype=torch.int32)
            slot_map[torch.tensor(experts)] = torch.arange(len(experts), dtype=torch.int32)
            bank.slot_map.copy_(slot_map)
            bank.owner[:] = experts
            bank.where.clear()
            bank.where.update({e: s for s, e in enumerate(experts)})

    def _load_slots(self, layer: int, experts: list[int], gate_up: torch.Tensor, down: torch.Tensor) -> None:
        if isinstance(self.tier, PinnedHostTier):
            idx = torch.tensor(experts)
            gate_up.copy_(self.tier.gate_up[layer][idx])
            down.copy_(self.tier.down[layer][idx])
            return
        if self.device.type == "cpu" and self.dtype == self.store.dtype:
            read_experts_into(self.store, layer, experts, gate_up, down)
            return
        pin = self.device.type == "cuda"
        buf_gu = torch.empty((len(experts), *self.store.gate_up_shape), dtype=self.store.dtype, pin_memory=pin)
        buf_dn = torch.empty((len(experts), *self.store.down_shape), dtype=self.store.dtype, pin_memory=pin)
        read_experts_into(self.store, layer, experts, buf_gu, buf_dn)
        gate_up.copy_(buf_gu)
        down.copy_(buf_dn)

    def _make_staging(self, slots: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        half = max(1, slots // 2) if slots else max(self.top_k, 8)
        return [(torch.empty((half, *self.store.gate_up_shape), dtype=self.dtype, device=self.device),
                 torch.empty((half, *self.store.down_shape), dtype=self.dtype, device=self.device)) for _ in range(2)]

    # ---- pinning ------------------------------------------------------------------------
    def pin(self, layer: int, experts: list[int], load: bool = True) -> None:
        """Keep these experts resident for good; loads them now when the bank exists."""
        experts = sorted(set(int(e) for e in experts))
        if len(experts) > self.capacity - self.top_k and not self.fully_resident:
            raise BudgetError(f"pinning {len(experts)} experts in layer {layer} leaves fewer than top-{self.top_k} "
                              f"free slots of {self.capacity}; pin fewer experts or raise the capacity.")
        self.policy.pinned[layer] = set(experts)
        if load and not self.fully_resident:
            bank = self.layers[layer]
            missing = [e for e in experts if e not in bank.where]
            if missing:
                victims = self.policy.victims(layer, [e for e in bank.owner if e >= 0], len(missing), set(experts))
                self._install(layer, missing, victims)

    # ---- the hot path -------------------------------------------------------------------
    def forward(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        bank = self.layers[layer]
        if self.fully_resident:   # hits are counted in after_step: this path may run as a CUDA graph replay
            return self._dispatch(hidden, bank.gate_up, bank.down, bank.slot_map[expert_ids], weights)
        if self.miss_policy == "skip" and self.decoding:
            return self._forward_skip(layer, bank, hidden, expert_ids, weights)
        return self._forward_fetch(layer, bank, hidden, expert_ids, weights)

    def dispatch(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Device-only dispatch through the current slot map: the caller guarantees residency."""
        bank = self.layers[layer]
        return self._dispatch(hidden, bank.gate_up, bank.down, bank.slot_map[expert_ids], weights)

    def can_segment(self, batch: int) -> bool:
        """Decode of `batch` tokens can always be made resident before its experts run (fetch policy)."""
        if self.fully_resident or self.miss_policy != "fetch":
            return False
        most_pinned = max((len(p) for p in self.policy.pinned.values()), default=0)
        return batch * self.top_k <= self.capacity - most_pinned and batch <= self.capacity

    def _prediction_pays(self, layer: int) -> bool:
        """Prefetch only where the prediction has been right often enough: unpredictable routing
        (synthetic, or a layer whose router disagrees with its predecessor) would only spend
        bandwidth evicting useful experts. Judged on a moving average over recent calls, once
        PREFETCH_WARMUP_CALLS have been seen; predictions keep being scored while it is off."""
        accuracy, calls = self._recent_accuracy.get(layer, (1.0, 0))
        return calls < PREFETCH_WARMUP_CALLS or accuracy >= PREFETCH_MIN_ACCURACY

    def ensure_resident(self, layer: int, expert_ids: np.ndarray, wait: str = "host") -> None:
        """Host side of a fetch: count hits and misses, copy missing experts into evicted slots.

        Experts prefetched for this layer count as hits (their copies were issued ahead); the
        compute stream is made to wait for those copies before the layer's experts run.
        """
        bank = self.layers[layer]
        experts, counts = np.unique(expert_ids, return_counts=True)
        self.policy.record(layer, experts, counts)
        resident = np.array([e in bank.where for e in experts.tolist()], dtype=bool)
        stats = self.stats.layer(layer)
        stats.hits += int(counts[resident].sum())
        stats.misses += int(counts[~resident].sum())
        predicted = self._predicted.pop(layer, None)
        if predicted is not None:
            right = sum(1 for e in experts.tolist() if e in predicted)
            stats.predicted_total += len(experts)
            stats.predicted_hits += right
            accuracy, calls = self._recent_accuracy.get(layer, (1.0, 0))
            rate = max(PREFETCH_EMA, 1.0 / (calls + 1))   # a plain mean at first, then a moving average
            self._recent_accuracy[layer] = (accuracy + rate * (right / len(experts) - accuracy), calls + 1)
        pending = self._pending.pop(layer, None)
        missing = experts[~resident].tolist()
        ahead = self._prefetched.pop(layer, set())
        if ahead or predicted is not None:   # copies this call needed: hidden behind the previous layer or not
            stats.prefetch_used += sum(1 for e in experts.tolist() if e in ahead)
            stats.demand_copies += len(missing)
        if missing:   # queued after any prefetch on the same copy stream: waiting on it covers both
            victims = self.policy.victims(layer, [e for e in bank.owner if e >= 0], len(missing), set(experts.tolist()))
            self._install(layer, missing, victims, wait=wait)
        elif pending is not None:
            if wait == "device":
                torch.cuda.current_stream(self.device).wait_event(pending)
            else:
                t0 = time.perf_counter()
                pending.synchronize()
                stats.copy_wait_s += time.perf_counter() - t0

    def _forward_skip(self, layer, bank, hidden, expert_ids, weights):
        slots = bank.slot_map[expert_ids]
        present = slots >= 0
        kept = weights * present
        scale = weights.sum(-1, keepdim=True) / kept.sum(-1, keepdim=True).clamp_min(1e-20)
        flat = expert_ids.reshape(-1)
        self.miss_counts[layer].index_add_(0, flat, (~present).reshape(-1).to(torch.int32))
        self.use_counts[layer].index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        n_present = present.sum()
        self.pair_counts[layer] += torch.stack((n_present, present.numel() - n_present))
        return self._dispatch(hidden, bank.gate_up, bank.down, slots, (kept * scale).to(weights.dtype))

    def _forward_fetch(self, layer, bank, hidden, expert_ids, weights):
        flat = expert_ids.reshape(-1).cpu().numpy()          # the one host sync of a layer that may miss
        experts = np.unique(flat)
        missing = [e for e in experts.tolist() if e not in bank.where]
        free_slots = self.capacity - len(self.policy.pinned.get(layer, ())) - (len(experts) - len(missing))
        if missing and (len(missing) > free_slots or hidden.shape[0] > self.capacity):
            experts, counts = np.unique(flat, return_counts=True)
            self.policy.record(layer, experts, counts)
            stats = self.stats.layer(layer)
            missed = np.isin(experts, missing)
            stats.hits += int(counts[~missed].sum())
            stats.misses += int(counts[missed].sum())
            return self._forward_staged(layer, bank, hidden, expert_ids, weights, missing)
        self.ensure_resident(layer, flat)
        return self.dispatch(layer, hidden, expert_ids, weights)

    def _install(self, layer: int, experts: list[int], victims: list[int], wait: str = "host"):
        """Copy `experts` over the slots of `victims` and update both slot maps.

        wait: "host" blocks until the copies land; "device" makes the compute stream wait for them
        (the host runs on); "none" returns the copies' event to the caller (prefetch).
        """
        bank = self.layers[layer]
        stats = self.stats.layer(layer)
        slots = [bank.where.pop(v) for v in victims]
        t0 = time.perf_counter()
        copied, done = self._copy_experts(layer, experts, [(bank.gate_up[s], bank.down[s]) for s in slots])
        if done is not None and wait == "host":
            done.synchronize()
        elif done is not None and wait == "device":
            torch.cuda.current_stream(self.device).wait_event(done)
        stats.copy_wait_s += time.perf_counter() - t0
        stats.bytes_copied += copied
        stats.evictions += sum(1 for v in victims if v >= 0)
        for e, s in zip(experts, slots):
            bank.owner[s] = e
            bank.where[e] = s
        pin = self.device.type == "cuda"
        update = torch.tensor(victims + experts, dtype=torch.long).pin_memory() if pin else \
            torch.tensor(victims + experts, dtype=torch.long)
        values = torch.tensor([-1] * len(victims) + slots, dtype=torch.int32)
        values = values.pin_memory() if pin else values
        bank.slot_map.index_put_((update.to(self.device, non_blocking=True),), values.to(self.device, non_blocking=True))
        return done

    # ---- next-layer prefetch ------------------------------------------------------------
    def prefetch(self, layer: int, predicted: np.ndarray) -> None:
        """Start copying the predicted experts of `layer` that are missing, without waiting.

        Called with the next layer's router applied to the current hidden state; the copies run
        on the copy stream while this layer computes. `ensure_resident` later makes the compute
        stream wait for them and counts how many of the actual experts were predicted.
        """
        bank = self.layers[layer]
        experts = list(dict.fromkeys(int(e) for e in predicted.reshape(-1)))
        self._predicted[layer] = set(experts)
        if not self._prediction_pays(layer):
            return   # still predicted (accuracy keeps being measured) but nothing is copied
        missing = [e for e in experts if e not in bank.where]
        room = self.capacity - len(self.policy.pinned.get(layer, ())) - (len(experts) - len(missing))
        missing = missing[:max(0, room)]
        if not missing:
            return
        victims = self.policy.victims(layer, [e for e in bank.owner if e >= 0], len(missing), set(experts))
        done = self._install(layer, missing, victims, wait="none")
        self.stats.layer(layer).prefetched += len(missing)
        self._prefetched[layer] = set(missing)
        if done is not None:
            self._pending[layer] = done

    def _copy_experts(self, layer: int, experts: list[int], dests: list[tuple[torch.Tensor, torch.Tensor]],
                      after: torch.cuda.Event | None = None) -> tuple[int, torch.cuda.Event | None]:
        """Queue the copies on the copy stream (after `after`, when given); return bytes and a done event."""
        copied = 0
        if self.copy_stream is None:
            for e, (gu, dn) in zip(experts, dests):
                copied += self.tier.copy_into(layer, e, gu, dn)
            return copied, None
        if after is None:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        else:
            self.copy_stream.wait_event(after)
        with torch.cuda.stream(self.copy_stream):
            for e, (gu, dn) in zip(experts, dests):
                copied += self.tier.copy_into(layer, e, gu, dn)
            done = torch.cuda.Event()
            done.record()
        return copied, done

    def _forward_staged(self, layer, bank, hidden, expert_ids, weights, missing: list[int]) -> torch.Tensor:
        """Resident experts from the bank, missing ones streamed through two staging buffers.

        While one buffer's experts compute, the next group is copied into the other one; the
        stage maps of every group are uploaded in one copy so the host never waits in between.
        """
        t0 = time.perf_counter()
        out = self._dispatch(hidden, bank.gate_up, bank.down, bank.slot_map[expert_ids], weights).float()
        stats = self.stats.layer(layer)
        group = self.staging[0][0].shape[0]
        groups = [missing[i:i + group] for i in range(0, len(missing), group)]
        stage_maps = torch.full((len(groups), self.num_experts), -1, dtype=torch.int32)
        for g, chunk in enumerate(groups):
            stage_maps[g, torch.tensor(chunk)] = torch.arange(len(chunk), dtype=torch.int32)
        stage_maps = stage_maps.to(self.device)
        for g, chunk in enumerate(groups):
            turn = self._staging_turn
            gu, dn = self.staging[turn]
            copied, ready = self._copy_experts(layer, chunk, [(gu[i], dn[i]) for i in range(len(chunk))],
                                               after=self._staging_done[turn])
            stats.bytes_copied += copied
            if ready is not None:
                torch.cuda.current_stream(self.device).wait_event(ready)
            out += self._dispatch(hidden, gu, dn, stage_maps[g][expert_ids], weights).float()
            if self.copy_stream is not None:
                done = torch.cuda.Event()
                done.record()
                self._staging_done[turn] = done
            self._staging_turn ^= 1
        result = out.to(hidden.dtype)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        stats.copy_wait_s += time.perf_counter() - t0   # the streamed section is bound by its copies
        return result

    # ---- between steps ------------------------------------------------------------------
    @property
    def graph_safe(self) -> bool:
        """A decode step reads nothing back: it can be captured and replayed as a CUDA graph."""
        return self.fully_resident or self.miss_policy == "skip"

    def begin_step(self, decoding: bool) -> None:
        """Called before each forward: one token per sequence lets the skip policy apply (prompts stay exact)."""
        self.decoding = decoding

    def after_step(self, tokens: int) -> None:
        """Advance the residency clock; in skip mode, refresh the bank from miss counters now and then."""
        self.stats.tokens += tokens
        self.policy.advance(tokens)
        if self.fully_resident:
            for layer in self.layers:
                self.stats.layer(layer).hits += tokens * self.top_k
            return
        if self.miss_policy != "skip":
            return
        self._since_refresh += tokens
        if self._since_refresh >= self.refresh_every:
            self._since_refresh = 0
            self.refresh_from_misses()

    def refresh_from_misses(self) -> None:
        """Skip mode: swap cold resident experts for hot missed ones (one sync per refresh)."""
        for layer, bank in self.layers.items():
            misses = self.miss_counts[layer].cpu().numpy().copy()   # copies: on the CPU .cpu() aliases
            uses = self.use_counts[layer].cpu().numpy().copy()
            hits, missed = self.pair_counts[layer].tolist()
            self.miss_counts[layer].zero_()
            self.use_counts[layer].zero_()
            self.pair_counts[layer].zero_()
            stats = self.stats.layer(layer)
            stats.hits += hits
            stats.misses += missed
            used = np.nonzero(uses)[0]
            if len(used):
                self.policy.record(layer, used, uses[used])
            hot = [e for e in np.argsort(-misses, kind="stable").tolist() if misses[e] > 0 and e not in bank.where]
            if not hot:
                continue
            resident = [e for e in bank.owner if e >= 0]
            pinned = self.policy.pinned.get(layer, set())
            evictable = [e for e in resident if e not in pinned]
            # swap only when the missed expert beats the coldest resident one
            n = min(len(hot), len(evictable))
            victims = self.policy.victims(layer, resident, n, set()) if n else []
            cold_priority = self.policy.priority(layer, np.array(victims, dtype=np.int64)) if victims else []
            hot_priority = self.policy.priority(layer, np.array(hot[:n], dtype=np.int64)) if n else []
            pairs = [(h, v) for h, v, hp, vp in zip(hot[:n], victims, hot_priority, cold_priority) if hp > vp]
            if pairs:
                self._install(layer, [h for h, _ in pairs], [v for _, v in pairs])

    def sync_stats(self) -> None:
        """Fold device-side counters (skip mode) into the host statistics."""
        if self.miss_policy == "skip" and not self.fully_resident:
            for layer in self.layers:
                hits, missed = self.pair_counts[layer].tolist()
                self.pair_counts[layer].zero_()
                s = self.stats.layer(layer)
                s.hits += hits
                s.misses += missed


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30
