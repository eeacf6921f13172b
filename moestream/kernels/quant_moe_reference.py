"""Plain-torch MoE dispatch over *quantized* bank slots: the spec of the dequantizing fused kernels.

Slots hold each projection as `<proj>.qweight` (S, N, K·bits/8) uint8, `<proj>.scales` (S, N, K/g)
and, for affine specs, `<proj>.biases`, for proj in (gate_up, down). The result is defined as:
dequantize every routed slot's weights to the hidden dtype (moestream.quant.dequantize, fp32 math),
then run `moe_reference` on them. Only the slots the routing uses are dequantized (one host read of
the used slot ids: this is the CPU path and the reference, not the CUDA hot path).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from moestream.quant import QuantSpec, dequantize

from .moe_reference import moe_reference

PROJECTIONS = ("gate_up", "down")


def dequantize_slots(slots: Mapping[str, Tensor], index: Tensor, spec: QuantSpec,
                     dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """gate_up (n, 2I, H) and down (n, H, I) of the slots `index`, dequantized to `dtype`."""
    out = []
    for proj in PROJECTIONS:
        biases = slots.get(f"{proj}.biases")
        out.append(dequantize(slots[f"{proj}.qweight"].index_select(0, index),
                              slots[f"{proj}.scales"].index_select(0, index),
                              biases.index_select(0, index) if biases is not None else None, spec, dtype))
    return out[0], out[1]


def quant_moe_reference(hidden: Tensor, slots: Mapping[str, Tensor], slot_ids: Tensor, weights: Tensor,
                        spec: QuantSpec, reduce: bool = True) -> Tensor:
    """Routed-expert FFN over quantized slots: (T, H) in hidden's dtype; slot -1 contributes nothing."""
    S = slots["gate_up.qweight"].shape[0]
    flat = slot_ids.reshape(-1).to(torch.int64)
    valid = (flat >= 0) & (flat < S)
    used = torch.unique(flat[valid])
    if used.numel() == 0:
        T, k = slot_ids.shape
        return torch.zeros_like(hidden) if reduce else hidden.new_zeros((T, k, hidden.shape[1]), dtype=torch.float32)
    gate_up, down = dequantize_slots(slots, used, spec, hidden.dtype)
    remap = torch.full((S + 1,), -1, dtype=torch.int64, device=hidden.device)
    remap[used] = torch.arange(used.numel(), device=hidden.device)
    local = torch.where(valid, flat, torch.full_like(flat, S))
    return moe_reference(hidden, gate_up, down, remap[local].view_as(slot_ids), weights, reduce=reduce)
