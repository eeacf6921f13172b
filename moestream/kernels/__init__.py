"""Kernels, each beside its plain-torch reference (the reference is the spec).

`moe_reference` is plain torch and runs anywhere (it is the engine's CPU path). `fused_moe` is
the Triton version for CUDA; Triton is optional (absent in CI), so importing this package never
imports it: the `fused_moe` below is a thin wrapper that loads `kernels/fused_moe.py` on first
call. Use `fused_moe_available()` to choose between them.

Note on names: the Triton module is `moestream.kernels.fused_moe` and the function exported here
has the same name. Importing a submodule makes Python set it as an attribute of its package,
so the loader puts the function back afterwards; reach the module's internals with
`from moestream.kernels.fused_moe import <name>` or `importlib.import_module`, not with
`import moestream.kernels.fused_moe as m` (which yields the function).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from typing import Callable

from torch import Tensor

from .moe_reference import moe_reference
from .quant_linear_reference import quant_linear_reference
from .quant_moe_reference import quant_moe_reference

__all__ = ["moe_reference", "quant_linear_reference", "quant_moe_reference", "quant_linear", "fused_moe", "fused_moe_available", "fused_moe_quant",
           "fused_moe_quant_available"]

_fused_impl: Callable[..., Tensor] | None = None


def _load_fused_impl() -> Callable[..., Tensor]:
    """Import the Triton module once and return its `fused_moe`."""
    global _fused_impl
    if _fused_impl is None:
        module = importlib.import_module(f"{__name__}.fused_moe")
        _fused_impl = module.fused_moe
        globals()["fused_moe"] = _fused_moe_entry   # undo the submodule attribute (see above)
    return _fused_impl


def _fused_moe_entry(hidden: Tensor, gate_up: Tensor, down: Tensor, slot_ids: Tensor,
                     weights: Tensor, activation: str = "swiglu") -> Tensor:
    """Fused MoE dispatch over bank slots (Triton, CUDA); same contract as `moe_reference`.

    Loads Triton on first call; raises ImportError when it is not installed.
    """
    return _load_fused_impl()(hidden, gate_up, down, slot_ids, weights, activation)


fused_moe = _fused_moe_entry


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


def _submodule(name: str):
    """Import a Triton submodule whose name is also a function of this package, and put the
    function back (importing a submodule sets it as the package's attribute; see above)."""
    entry = globals()[name]
    module = importlib.import_module(f"{__name__}.{name}")
    globals()[name] = entry
    return module


def fused_moe_quant(hidden: Tensor, slots, slot_ids: Tensor, weights: Tensor, spec) -> Tensor:
    """Fused MoE dispatch over quantized bank slots (Triton, CUDA); same contract as `quant_moe_reference`."""
    return _submodule("fused_moe_quant").fused_moe_quant(hidden, slots, slot_ids, weights, spec)


@functools.lru_cache(maxsize=None)
def fused_moe_quant_available() -> bool:
    """True when the dequantizing Triton kernels can run here (CUDA, Triton, and the module exists)."""
    return fused_moe_available() and all(importlib.util.find_spec(f"{__name__}.{m}") is not None
                                         for m in ("fused_moe_quant", "quant_linear"))


def quant_linear(x: Tensor, qweight: Tensor, scales: Tensor, biases, spec, bias=None) -> Tensor:
    """x @ dequantize(weight)ᵀ (+ bias): the Triton kernel on CUDA when it exists, else the reference."""
    if x.is_cuda and fused_moe_quant_available():
        return _submodule("quant_linear").quant_linear(x, qweight, scales, biases, spec, bias)
    return quant_linear_reference(x, qweight, scales, biases, spec, bias)
