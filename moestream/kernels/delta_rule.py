"""The gated delta rule as Gated DeltaNet calls it: flash-linear-attention's kernels where they
fit, else the plain-torch reference (`delta_rule_reference`, the spec).

flash-linear-attention (PyPI `fla-core`, import name `fla`: Python + Triton) runs the chunked
form for prefill and a fused recurrent step for decode. It is used for CUDA tensors in bf16 or
fp16 with head dims its kernels take (multiples of 16 up to 256; Qwen3-Next's are 128) when it
imports and the fused ops are on (`kernels.fused_ops`, so `fused_ops(False)` gives the
reference for A/B runs and tests); fp32 and the CPU always run the reference, so fp32 stays exact
against transformers. fla's recurrent step allocates its output and final state in the call and
never reads back to the host, so a decode step through it is captured in CUDA graphs like any
other launch (its Triton kernel compiles in the runner's warm-up, outside the capture).

The inputs are in the mixer's layout and before the steps both paths share: q and k not yet
normalised and not expanded to the value heads (fla normalises them in its kernels and reads key
head j // (Hv / Hk) for value head j, as the reference's `repeat_interleave` does). Rows of a
batch have the same length here: the runtime prefills one sequence at a time, and a padded
no-cache batch zeroes its padding's inputs, which gives zero keys and values, so left padding
writes nothing into a state that starts at zero (exactly, in both paths; right padding comes
after the real tokens and cannot change them).
"""

from __future__ import annotations

import functools
import importlib

import torch
from torch import Tensor

from . import cuda_module_available, fused_ops_enabled
from .delta_rule_reference import chunk_gated_delta_rule, gated_delta_step, l2_normalise

_FLA_DTYPES = (torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=None)
def fla_available() -> bool:
    """True when a CUDA device is visible and flash-linear-attention's gated delta rule imports."""
    return cuda_module_available("fla.ops.gated_delta_rule")


def _fla_head_dim(d: int) -> bool:
    """fla's kernels take head dims up to 256, and `tl.dot` needs tiles of at least 16."""
    return 16 <= d <= 256 and d % 16 == 0


def uses_fla(k: Tensor, v: Tensor) -> bool:
    """Whether `gated_delta_rule` with keys like `k` and values like `v` runs flash-linear-attention:
    CUDA, bf16/fp16, head dims fla's kernels take, fused ops on, fla installed."""
    return (v.dtype in _FLA_DTYPES and _fla_head_dim(k.shape[-1]) and _fla_head_dim(v.shape[-1])
            and fused_ops_enabled(v) and fla_available())


def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                     state: Tensor) -> tuple[Tensor, Tensor]:
    """Outputs of L tokens per row and the state after them.

    q, k (B, L, Hk, Dk) as the conv gives them; v (B, L, Hv, Dv), Hv a multiple of Hk; g (B, L, Hv)
    fp32 log decay; beta (B, L, Hv); state (B, Hv, Dk, Dv) fp32, the state before the first token.
    q and k are L2-normalised here and q scaled by 1/sqrt(Dk). Returns the output (B, L, Hv, Dv) in
    v's dtype and the new state (fp32); the input state is not modified. L == 1 is a decode step
    (the recurrent form), longer inputs take the chunked form.
    """
    if uses_fla(k, v):
        return _fla(q, k, v, g, beta, state)
    return _reference(q, k, v, g, beta, state)


def _fla(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """flash-linear-attention, called as transformers calls it (q, k, v in the compute dtype, g fp32)."""
    ops = importlib.import_module("fla.ops.gated_delta_rule")
    form = ops.fused_recurrent_gated_delta_rule if q.shape[1] == 1 else ops.chunk_gated_delta_rule
    return form(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                use_qk_l2norm_in_kernel=True)


def _reference(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """The plain-torch forms in fp32, heads first, heads expanded, q and k normalised beforehand."""
    group = v.shape[2] // q.shape[2]
    q, k = (t.repeat_interleave(group, dim=2) for t in (q, k))
    q, k, v32, g, beta = (t.transpose(1, 2).float() for t in (q, k, v, g, beta))
    q = l2_normalise(q) * q.shape[-1] ** -0.5
    k = l2_normalise(k)
    if q.shape[2] == 1:
        out, state = gated_delta_step(q[:, :, 0], k[:, :, 0], v32[:, :, 0], g[:, :, 0], beta[:, :, 0], state)
        out = out[:, :, None]
    else:
        out, state = chunk_gated_delta_rule(q, k, v32, g, beta, state)
    return out.transpose(1, 2).to(v.dtype), state
