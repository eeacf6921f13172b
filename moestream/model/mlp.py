"""The dense SwiGLU MLP: layers listed in mlp_only_layers and shared experts use it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moestream.model.projections import Linear


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
