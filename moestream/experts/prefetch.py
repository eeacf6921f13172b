"""Next-layer prefetch for the fetch policy: copy the experts a prediction names before their layer runs.

The runtime applies the next MoE layer's router to the current hidden state and hands the
predicted ids here right after the current layer's routing read-back; the copies run on the copy
stream while the current layer computes. When the next layer's real routing arrives, `settle`
scores the prediction and returns the copies' event, so the compute stream waits for them only
if the layer needs them.

An accuracy gate keeps prefetch from costing more than it saves: a layer stops copying (but keeps
scoring its predictions) while its moving accuracy is under PREFETCH_MIN_ACCURACY, judged once
PREFETCH_WARMUP_CALLS predicted calls have been seen. Unpredictable routing (synthetic, or a
layer whose router disagrees with its predecessor) would otherwise only evict useful experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moestream.experts.residency import ResidencyPolicy
from moestream.experts.slots import SlotTable
from moestream.experts.transfer import Transfers

PREFETCH_WARMUP_CALLS = 16     # predicted calls per layer before prefetch is judged
PREFETCH_EMA = 1 / 32          # weight of the newest call in the moving accuracy
PREFETCH_MIN_ACCURACY = 0.3    # below this share of right predictions a layer stops prefetching


@dataclass
class Settled:
    """A layer call's view of its prediction: what to wait for and what to count."""

    pending: torch.cuda.Event | None   # prefetch copies queued for this layer
    predicted_hits: int = 0            # routed experts (distinct) the prediction named
    predicted_total: int = 0           # routed experts (distinct) in a predicted call
    prefetch_used: int = 0             # experts copied ahead that the call routed to
    scored: bool = False               # the call had a prediction or copies ahead


class Prefetcher:
    def __init__(self, slots: SlotTable, transfers: Transfers, policy: ResidencyPolicy):
        self.slots, self.transfers, self.policy = slots, transfers, policy
        self._pending: dict[int, torch.cuda.Event] = {}        # layer → copies issued ahead
        self._predicted: dict[int, set[int]] = {}              # layer → experts predicted for its next call
        self._accuracy: dict[int, tuple[float, int]] = {}      # layer → (moving accuracy, judged calls)
        self._copied: dict[int, set[int]] = {}                 # layer → experts copied ahead

    def accuracy(self, layer: int) -> tuple[float, int]:
        """(moving accuracy, predicted calls seen) of a layer's predictions."""
        return self._accuracy.get(layer, (1.0, 0))

    def pays(self, layer: int) -> bool:
        accuracy, calls = self.accuracy(layer)
        return calls < PREFETCH_WARMUP_CALLS or accuracy >= PREFETCH_MIN_ACCURACY

    def issue(self, layer: int, predicted: np.ndarray) -> int:
        """Start copying the predicted experts of `layer` that are missing, without waiting; returns
        how many copies were issued (0 while the layer's predictions do not pay)."""
        ls = self.slots[layer]
        experts = list(dict.fromkeys(int(e) for e in predicted.reshape(-1)))
        self._predicted[layer] = set(experts)
        if not self.pays(layer):
            return 0   # still predicted (accuracy keeps being measured) but nothing is copied
        missing = [e for e in experts if e not in ls.where]
        room = self.slots.capacity - len(self.policy.pinned.get(layer, ())) - (len(experts) - len(missing))
        missing = missing[:max(0, room)]
        if not missing:
            return 0
        victims = self.policy.victims(layer, ls.resident(), len(missing), set(experts))
        installed = self.slots.install(layer, missing, victims, self.transfers, wait="none")
        self._copied[layer] = set(missing)
        if installed.done is not None:
            self._pending[layer] = installed.done
        return len(missing)

    def settle(self, layer: int, experts: list[int]) -> Settled:
        """Score the prediction for this call of `layer` (its distinct routed experts) and hand back
        the event of the copies issued for it."""
        predicted = self._predicted.pop(layer, None)
        ahead = self._copied.pop(layer, set())
        out = Settled(self._pending.pop(layer, None), scored=bool(ahead) or predicted is not None)
        if predicted is not None:
            right = sum(1 for e in experts if e in predicted)
            out.predicted_total, out.predicted_hits = len(experts), right
            accuracy, calls = self.accuracy(layer)
            rate = max(PREFETCH_EMA, 1.0 / (calls + 1))   # a plain mean at first, then a moving average
            self._accuracy[layer] = (accuracy + rate * (right / len(experts) - accuracy), calls + 1)
        out.prefetch_used = sum(1 for e in experts if e in ahead)
        return out
