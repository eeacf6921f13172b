"""MoE dispatch over MXFP4 bank slots (experts/mxfp4_format.py): the plain-torch reference and the
CUDA entry.

Slots hold `gate_up.blocks (S, 2I, H/2)`, `gate_up.scales (S, 2I, H/32)`, `down.blocks (S, H, I/2)`,
`down.scales (S, H, I/32)` uint8 and, for experts with biases, `gate_up_bias (S, 2I)` and `down_bias
(S, H)`. The result is defined as: dequantize every routed slot to the hidden dtype (quant/mxfp4.py,
exact in fp32), then `moe_reference` with the biases and the activation.

On CUDA (fused_moe_mxfp4_triton.py, dequantizing in registers; neither reads the routing back):
calls of a few tokens run the one-pair kernels (each pair streams its expert's bytes), longer ones
the grouped kernels (pairs aligned by slot, each expert's tile dequantized once per M-block of
its tokens).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from moestream.quant.mxfp4 import dequantize_mxfp4

from .moe_reference import Activation, moe_reference

# Calls of at most this many tokens take the one-pair kernels (each pair reads its expert's bytes);
# longer ones the grouped kernels, which share each dequantized tile across an M-block of tokens.
# Not tuned on a GPU yet.
PAIR_KERNEL_MOST_TOKENS = 16


def dequantize_slots(slots: Mapping[str, Tensor], index: Tensor, dtype: torch.dtype) -> dict[str, Tensor]:
    """gate_up (n, 2I, H), down (n, H, I) and the biases of the slots `index`, in `dtype`."""
    out = {}
    for proj in ("gate_up", "down"):
        blocks, scales = slots[f"{proj}.blocks"].index_select(0, index), slots[f"{proj}.scales"].index_select(0, index)
        out[proj] = dequantize_mxfp4(blocks, scales, dtype)
        bias = slots.get(f"{proj}_bias")
        out[f"{proj}_bias"] = bias.index_select(0, index).to(dtype) if bias is not None else None
    return out


def mxfp4_moe_reference(hidden: Tensor, slots: Mapping[str, Tensor], slot_ids: Tensor, weights: Tensor,
                        activation: str | Activation = "swiglu", reduce: bool = True) -> Tensor:
    """Routed-expert FFN over MXFP4 slots, (T, H) in hidden's dtype (or the (T, k, H) fp32 pair rows
    with reduce=False); slot -1 or out of range contributes nothing. Only the used slots are
    dequantized (one host read of the routing: the CPU path and the spec, not the CUDA hot path)."""
    S = slots["gate_up.blocks"].shape[0]
    flat = slot_ids.reshape(-1).to(torch.int64)
    valid = (flat >= 0) & (flat < S)
    used = torch.unique(flat[valid])
    if used.numel() == 0:
        T, k = slot_ids.shape
        return torch.zeros_like(hidden) if reduce else hidden.new_zeros((T, k, hidden.shape[1]), dtype=torch.float32)
    w = dequantize_slots(slots, used, hidden.dtype)
    remap = torch.full((S + 1,), -1, dtype=torch.int64, device=hidden.device)
    remap[used] = torch.arange(used.numel(), device=hidden.device)
    local = remap[torch.where(valid, flat, torch.full_like(flat, S))].view_as(slot_ids)
    return moe_reference(hidden, w["gate_up"], w["down"], local, weights, Activation.of(activation),
                         w["gate_up_bias"], w["down_bias"], reduce=reduce)


def fused_mxfp4_moe(hidden: Tensor, slots: Mapping[str, Tensor], slot_ids: Tensor, weights: Tensor,
                    activation: str | Activation = "swiglu", reduce: bool = True) -> Tensor:
    """The CUDA dispatch (same contract as the reference): the one-pair kernels for few tokens, the
    grouped kernels for more; the pair rows summed by the launch that ends every fused dispatch."""
    from moestream import kernels

    from .fused_moe_mxfp4_triton import mxfp4_grouped, mxfp4_pairs

    activation = Activation.of(activation)
    run = mxfp4_pairs if hidden.shape[0] <= PAIR_KERNEL_MOST_TOKENS else mxfp4_grouped
    pairs = run(hidden, slots, slot_ids, weights, activation)
    return kernels.sum_pairs(pairs, hidden.dtype, fused=True) if reduce else pairs
