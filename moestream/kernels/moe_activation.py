"""Activations of the fused MoE kernels' epilogues, as Triton code (spec: moe_reference).

Add a new name to `moe_reference.ACTIVATIONS` first (the spec), then a code here and a branch
in `activate`. Parameters (the clamped SwiGLU's alpha and limit) are fp32 kernel arguments;
activations without parameters ignore them.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Activation name -> constexpr code understood by `activate`.
ACTIVATION_CODES: dict[str, int] = {"swiglu": 0, "swiglu_clamped": 1, "geglu_tanh": 2}

# gelu's tanh approximation, 0.5 * x * (1 + tanh(c * (x + 0.044715 * x^3))) with c = sqrt(2 / pi), is
# x * sigmoid(2c * (x + 0.044715 * x^3)) exactly (1 + tanh(z) = 2 * sigmoid(2z)): written so, it needs
# only tl.sigmoid, which the compiler and the interpreter both have.
GELU_TANH_2C = tl.constexpr(1.5957691216057308)   # 2 * sqrt(2 / pi)


@triton.jit
def activate(gate, up, ACTIVATION: tl.constexpr, alpha, limit):
    """Epilogue activation on fp32 accumulators (biases already added); codes match ACTIVATION_CODES."""
    tl.static_assert((ACTIVATION == 0) | (ACTIVATION == 1) | (ACTIVATION == 2), "unknown activation code")
    if ACTIVATION == 2:   # Gemma 4: gelu_tanh(gate) * up
        inner = gate + 0.044715 * gate * gate * gate
        # tensor * constexpr, not the reverse: Triton 3.9's interpreter keeps constexpr * tensor a constexpr
        return gate * tl.sigmoid(inner * GELU_TANH_2C) * up
    if ACTIVATION == 1:   # GPT-OSS: gate clamped above, up on both sides, (up + 1) * gate * sigmoid(alpha * gate)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        return (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
    return gate * tl.sigmoid(gate) * up
