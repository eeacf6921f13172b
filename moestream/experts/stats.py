"""Counters of the bank: per layer and in total, readable as a dict, a table or JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class LayerStats:
    hits: int = 0            # routed (token, expert) pairs whose expert was in the bank
    misses: int = 0          # pairs whose expert was not
    evictions: int = 0       # experts dropped from the bank to make room
    bytes_copied: int = 0    # expert bytes copied into the bank or the staging area
    copy_wait_s: float = 0.0  # host time spent waiting for those copies (a staged layer: issuing its stream)
    prefetched: int = 0      # experts copied ahead on the next-layer prediction
    predicted_hits: int = 0  # routed experts (distinct per call) that the prediction named
    predicted_total: int = 0  # routed experts (distinct per call) in calls that had a prediction
    prefetch_used: int = 0   # experts copied ahead that the call then routed to (their copy was hidden)
    demand_copies: int = 0   # experts such calls still had to copy while the layer waited
    cpu_served: int = 0      # missed pairs computed on the CPU from host RAM instead of copied (hybrid misses)
    cpu_bytes: int = 0       # expert bytes the CPU read from host RAM for them
    cpu_s: float = 0.0       # host time spent computing them
    host_read: int = 0       # missed pairs the GPU computed reading the expert in place from host RAM (hybrid)
    host_read_bytes: int = 0  # expert bytes it read so, over PCIe

    def add(self, other: "LayerStats") -> None:
        for k, v in asdict(other).items():
            setattr(self, k, getattr(self, k) + v)

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 1.0

    @property
    def prediction_accuracy(self) -> float | None:
        return self.predicted_hits / self.predicted_total if self.predicted_total else None

    @property
    def hidden_share(self) -> float | None:
        """Share of the copies a predicted call needed that were already issued ahead (each expert
        copy costs the same time, so this is the share of its miss time moved off the critical path)."""
        n = self.prefetch_used + self.demand_copies
        return self.prefetch_used / n if n else None


@dataclass
class BankStats:
    layers: dict[int, LayerStats] = field(default_factory=dict)
    tokens: int = 0          # tokens that went through the model (prefill and decode)

    def layer(self, i: int) -> LayerStats:
        s = self.layers.get(i)
        if s is None:
            s = self.layers[i] = LayerStats()
        return s

    def record(self, layer: int, **counts: int | float) -> None:
        """Add one layer call's counters (any LayerStats fields) in one call."""
        s = self.layer(layer)
        for name, value in counts.items():
            setattr(s, name, getattr(s, name) + value)

    def total(self) -> LayerStats:
        t = LayerStats()
        for s in self.layers.values():
            t.add(s)
        return t

    def reset(self) -> None:
        self.layers.clear()
        self.tokens = 0

    def as_dict(self) -> dict:
        total = self.total()
        per_layer = {str(i): {**asdict(s), "hit_rate": s.hit_rate, "prediction_accuracy": s.prediction_accuracy,
                              "hidden_share": s.hidden_share} for i, s in sorted(self.layers.items())}
        return {"tokens": self.tokens, **asdict(total), "hit_rate": total.hit_rate,
                "prediction_accuracy": total.prediction_accuracy, "hidden_share": total.hidden_share,
                "bytes_copied_per_token": total.bytes_copied / self.tokens if self.tokens else 0.0,
                "cpu_bytes_per_token": total.cpu_bytes / self.tokens if self.tokens else 0.0,
                "host_read_bytes_per_token": total.host_read_bytes / self.tokens if self.tokens else 0.0,
                "layers": per_layer}

    def table(self) -> str:
        rows = [("layer", "hits", "misses", "on CPU", "GPU reads", "hit rate", "evictions", "MB copied", "wait s",
                 "MB CPU", "CPU s", "MB read", "prefetched", "pred acc", "hidden")]
        items = sorted(self.layers.items()) + [("all", self.total())]
        for i, s in items:
            acc, hidden = s.prediction_accuracy, s.hidden_share
            rows.append((str(i), str(s.hits), str(s.misses), str(s.cpu_served), str(s.host_read), f"{s.hit_rate:.1%}",
                         str(s.evictions), f"{s.bytes_copied / 1e6:.1f}", f"{s.copy_wait_s:.3f}",
                         f"{s.cpu_bytes / 1e6:.1f}", f"{s.cpu_s:.3f}", f"{s.host_read_bytes / 1e6:.1f}", str(s.prefetched),
                         "-" if acc is None else f"{acc:.1%}", "-" if hidden is None else f"{hidden:.1%}"))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        return "\n".join("  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows)
