"""Kernels, each beside its plain-torch reference (the reference is the spec).

`moe_reference`, `quant_moe_reference` and `quant_linear_reference` are plain torch and run
anywhere (they are the engine's CPU path). `fused_moe`, `fused_moe_quant` and `quant_linear` are
the Triton versions for CUDA; Triton is optional (absent from the CPU install), so importing this
package never imports it: each function below loads its `*_triton` module on first call. Use
`fused_moe_available()` / `fused_moe_quant_available()` to choose between them. The Triton
modules carry a `_triton` suffix so that importing one never shadows the function of the same
name on this package.
"""

from __future__ import annotations

import functools
import importlib

from torch import Tensor

from .moe_reference import moe_reference
from .quant_linear_reference import quant_linear_reference
from .quant_moe_reference import quant_moe_reference

__all__ = ["moe_reference", "quant_linear_reference", "quant_moe_reference", "quant_linear",
           "fused_moe", "fused_moe_available", "fused_moe_quant", "fused_moe_quant_available"]


@functools.cache
def _triton_module(name: str):
    """The Triton module `kernels/<name>_triton.py` (imported on first use, then cached)."""
    return importlib.import_module(f"{__name__}.{name}_triton")


def fused_moe(hidden: Tensor, gate_up: Tensor, down: Tensor, slot_ids: Tensor,
              weights: Tensor, activation="swiglu", gate_up_bias: Tensor | None = None,
              down_bias: Tensor | None = None) -> Tensor:
    """Fused MoE dispatch over bank slots (Triton, CUDA); same contract as `moe_reference`
    (optional expert biases, an `Activation` with parameters).

    Loads Triton on first call; raises ImportError when it is not installed.
    """
    return _triton_module("fused_moe").fused_moe(hidden, gate_up, down, slot_ids, weights, activation,
                                                 gate_up_bias, down_bias)


@functools.lru_cache(maxsize=None)
def fused_moe_available() -> bool:
    """True when `fused_moe` can run here: a CUDA device is visible and Triton imports."""
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        importlib.import_module("triton")
    except Exception:  # a broken install (ImportError, missing libcuda, ...) means "no"
        return False
    return True


def fused_moe_quant(hidden: Tensor, slots, slot_ids: Tensor, weights: Tensor, spec) -> Tensor:
    """Fused MoE dispatch over quantized bank slots (Triton, CUDA); same contract as `quant_moe_reference`."""
    return _triton_module("fused_moe_quant").fused_moe_quant(hidden, slots, slot_ids, weights, spec)


@functools.lru_cache(maxsize=None)
def fused_moe_quant_available() -> bool:
    """True when the dequantizing Triton kernels can run here (the same needs as `fused_moe`)."""
    return fused_moe_available()


def quant_linear(x: Tensor, qweight: Tensor, scales: Tensor, biases, spec, bias=None) -> Tensor:
    """x @ dequantize(weight)ᵀ (+ bias): the Triton kernel on CUDA when it exists, else the reference."""
    if x.is_cuda and fused_moe_quant_available():
        return _triton_module("quant_linear").quant_linear(x, qweight, scales, biases, spec, bias)
    return quant_linear_reference(x, qweight, scales, biases, spec, bias)
