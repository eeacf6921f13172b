"""Plain-torch MoE dispatch over *quantized* bank slots: the spec of the dequantizing fused kernels.

Slots hold each projection as `<proj>.qweight` (S, N, K·bits/8) uint8, `<proj>.scales` (S, N, K/g)
and, for affine specs, `<proj>.biases`, for proj in (gate_up, down). The result is defined as:
dequantize every routed slot's weights to the hidden dtype (moestream.quant.dequantize, fp32 math),
then run `moe_reference` on them. FP8 slots (`moestream.quant.fp8.Fp8Spec`) hold `<proj>.qweight`
(S, N, K) uint8, the float8_e4m3fn bits, and `<proj>.scales` (S, rows, cols) float32 per block
(gate_up: the gate's grid, then the up's), dequantized by `dequantize_fp8`. Only the slots the routing uses are dequantized (one host read of
the used slot ids: this is the CPU path and the reference, not the CUDA hot path).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from moestream.quant import QuantSpec, dequantize
from moestream.quant.fp8 import Fp8Spec, dequantize_fp8

from .moe_reference import moe_reference, split_outside

PROJECTIONS = ("gate_up", "down")


@dataclass
class QuantHostReads:
    """Every quantized expert of a layer in (pinned) host memory, which slot id S + e reads in place:
    `stacks` holds the slots' tensors by name ("<proj>.qweight", ".scales", ".biases"), E experts
    each, same dtypes and per-expert shapes. `cpu_take` as `HostReads.cpu_take`: of a one-token
    call's m pairs outside the slots, the first cpu_take[m] are computed elsewhere."""

    stacks: Mapping[str, Tensor]
    cpu_take: Tensor | None = None

    @property
    def num_experts(self) -> int:
        return self.stacks["gate_up.qweight"].shape[0]


def dequantize_slots(slots: Mapping[str, Tensor], index: Tensor | None, spec: QuantSpec | Fp8Spec,
                     dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """gate_up (n, 2I, H) and down (n, H, I) of the slots `index` (None: every one), dequantized to `dtype`."""
    pick = (lambda t: t) if index is None else (lambda t: t.index_select(0, index))
    out = []
    for proj in PROJECTIONS:
        if isinstance(spec, Fp8Spec):
            q, s = pick(slots[f"{proj}.qweight"]), pick(slots[f"{proj}.scales"])
            if proj == "gate_up":   # each half on its own grid
                n, rows = q.shape[1] // 2, s.shape[1] // 2
                out.append(torch.cat([dequantize_fp8(q[:, :n], s[:, :rows], spec, dtype),
                                      dequantize_fp8(q[:, n:], s[:, rows:], spec, dtype)], dim=1))
            else:
                out.append(dequantize_fp8(q, s, spec, dtype))
            continue
        biases = slots.get(f"{proj}.biases")
        out.append(dequantize(pick(slots[f"{proj}.qweight"]), pick(slots[f"{proj}.scales"]),
                              pick(biases) if biases is not None else None, spec, dtype))
    return out[0], out[1]


def quant_moe_reference(hidden: Tensor, slots: Mapping[str, Tensor], slot_ids: Tensor, weights: Tensor,
                        spec: QuantSpec | Fp8Spec, reduce: bool = True, host: QuantHostReads | None = None) -> Tensor:
    """Routed-expert FFN over quantized slots: (T, H) in hidden's dtype; slot -1 contributes nothing.
    With `host`, a slot id S + e is expert e of the host stacks (less its `cpu_take`)."""
    S = slots["gate_up.qweight"].shape[0]
    num_host = 0
    if host is not None:
        num_host = host.num_experts
        slot_ids = split_outside(slot_ids, S, host.cpu_take)
    flat = slot_ids.reshape(-1).to(torch.int64)
    valid = (flat >= 0) & (flat < S + num_host)
    used = torch.unique(flat[valid])
    if used.numel() == 0:
        T, k = slot_ids.shape
        return torch.zeros_like(hidden) if reduce else hidden.new_zeros((T, k, hidden.shape[1]), dtype=torch.float32)
    in_slots, outside = used[used < S], used[used >= S] - S
    parts = {name: torch.cat([t.index_select(0, in_slots), host.stacks[name].index_select(0, outside.cpu()).to(t.device)])
             if len(outside) else t.index_select(0, in_slots) for name, t in slots.items()}
    gate_up, down = dequantize_slots(parts, None, spec, hidden.dtype)   # parts holds just the used experts
    remap = torch.full((S + num_host + 1,), -1, dtype=torch.int64, device=hidden.device)
    remap[used] = torch.arange(used.numel(), device=hidden.device)   # used is sorted: slots, then host experts
    local = torch.where(valid, flat, torch.full_like(flat, S + num_host))
    return moe_reference(hidden, gate_up, down, remap[local].view_as(slot_ids), weights, reduce=reduce)
