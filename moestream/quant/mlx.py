"""MLX-quantized checkpoints (mlx-community layout), read as they are.

MLX's affine quantization is ours: w = q·scale + bias per group along the input dimension, its
uint32 `weight` arrays hold the same little-endian bit stream as our packed uint8 bytes. config.json
names the default `{"bits", "group_size"}` under `quantization` (or `quantization_config`), and may
override it per module path (a dict) or exclude a module (`false`); a module is quantized in the
file when its `<path>.scales` tensor exists.
"""

from __future__ import annotations

from typing import Any

import torch

from moestream.errors import CheckpointError
from moestream.quant.spec import AFFINE_BITS, GROUPS, QuantSpec


def mlx_quantization(raw_config: dict[str, Any]) -> dict[str, Any] | None:
    """The quantization block of an MLX config.json, or None for an unquantized checkpoint."""
    for key in ("quantization", "quantization_config"):
        q = raw_config.get(key)
        if isinstance(q, dict) and "bits" in q and "group_size" in q:
            mode = q.get("mode", "affine")
            if mode != "affine":
                raise CheckpointError(f"config.json quantizes with MLX mode {mode!r}; moestream reads affine MLX "
                                      "checkpoints only, so use an affine (e.g. 4-bit) conversion of this model.")
            return q
    return None


def mlx_spec(quantization: dict[str, Any], path: str, scale_dtype: torch.dtype) -> QuantSpec | None:
    """The spec MLX stored the module at `path` with (its override, else the default)."""
    override = quantization.get(path)
    if override is False:
        return None
    source = override if isinstance(override, dict) else quantization
    bits, group = int(source["bits"]), int(source["group_size"])
    if bits not in AFFINE_BITS or group not in GROUPS:
        raise CheckpointError(f"config.json stores {path} with {bits} bits in groups of {group}; moestream reads "
                              f"{'/'.join(map(str, AFFINE_BITS))} bits in groups of {'/'.join(map(str, GROUPS))}.")
    return QuantSpec("int", bits, group, scale_dtype)
