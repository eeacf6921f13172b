"""The token embedding: `nn.Embedding` that draws no initial values on the meta device.

Every model is built on the meta device and its weights are then read from the checkpoint, so the
initial values are never used. torch's meta `normal_` is a Python reference that imports
`torch._dynamo` on first use: about 3 s of every load (and of every `moestream run`) for nothing.
"""

from __future__ import annotations

from torch import nn


class Embedding(nn.Embedding):
    """`nn.Embedding` (same parameters, names and state dict) whose meta-device weight is left undrawn."""

    def reset_parameters(self) -> None:
        if self.weight.is_meta:
            return
        super().reset_parameters()
