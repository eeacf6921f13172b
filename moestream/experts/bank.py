"""The bank: per MoE layer, stacked device tensors of expert slots and a device slot map.

gate_up (S, 2I, H) and down (S, H, I) hold S = capacity experts; slot_map (E,) int32 maps an
expert id to its slot (-1 when not resident). Dispatch turns routed ids into slots with one
device-side gather and runs one fused kernel over the slots: no host sync when nothing misses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moestream.experts.store import ExpertStore


@dataclass
class LayerBank:
    gate_up: torch.Tensor   # (S, 2I, H)
    down: torch.Tensor      # (S, H, I)
    slot_map: torch.Tensor  # (E,) int32 on the device


def select_dispatch(device: torch.device):
    """The fused Triton kernel on CUDA when Triton is there, else the plain-torch reference."""
    from moestream import kernels

    if device.type == "cuda" and kernels.fused_moe_available():
        return kernels.fused_moe
    return kernels.moe_reference


class ExpertBank:
    """Every expert resident (capacity = E): the fast path and the exact reference for smaller banks."""

    def __init__(self, store: ExpertStore, device: torch.device, dtype: torch.dtype):
        self.store, self.device, self.dtype = store, device, dtype
        config = store.config
        self.num_experts = config.num_experts
        self.capacity = config.num_experts
        self.layers: dict[int, LayerBank] = {}
        pin = device.type == "cuda"
        staging = store.new_buffers(pin=pin)
        for layer in store.moe_layers:
            S = self.capacity
            gate_up = torch.empty((S, *store.gate_up_shape), dtype=dtype, device=device)
            down = torch.empty((S, *store.down_shape), dtype=dtype, device=device)
            for e in range(S):
                store.read_into(layer, e, *staging)
                gate_up[e].copy_(staging[0])
                down[e].copy_(staging[1])
            slot_map = torch.arange(self.num_experts, dtype=torch.int32, device=device)
            self.layers[layer] = LayerBank(gate_up, down, slot_map)
        self._dispatch = select_dispatch(device)

    def forward(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        bank = self.layers[layer]
        slots = bank.slot_map[expert_ids]
        return self._dispatch(hidden, bank.gate_up, bank.down, slots, weights)

    def nbytes(self) -> int:
        return sum(b.gate_up.nbytes + b.down.nbytes + b.slot_map.nbytes for b in self.layers.values())
