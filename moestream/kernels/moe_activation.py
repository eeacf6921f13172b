"""Activations of the fused MoE kernels' epilogues, as Triton code (spec: moe_reference).

Add a new name to `moe_reference.ACTIVATIONS` first (the spec), then a code here and a branch
in `activate`.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Activation name -> constexpr code understood by `activate`.
ACTIVATION_CODES: dict[str, int] = {"swiglu": 0}


@triton.jit
def activate(gate, up, ACTIVATION: tl.constexpr):
    """Epilogue activation on fp32 accumulators; codes match ACTIVATION_CODES."""
    tl.static_assert(ACTIVATION == 0, "unknown activation code")
    # Hook: a clamped SwiGLU (GPT-OSS) becomes `elif ACTIVATION == 1:` with alpha/limit args.
    return gate * tl.sigmoid(gate) * up
