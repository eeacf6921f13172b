"""RMSNorm as these families define it: normalise in fp32, then scale; one class per way of scaling.

`RMSNorm` casts back, then multiplies by the weight (Llama, Qwen2/3, Mixtral, OLMoE).
`ZeroCentredRMSNorm` stores the weight centred on zero and multiplies by (1 + weight) in fp32
before casting back (Qwen3-Next): the same numbers as transformers' Qwen3NextRMSNorm in bf16 too.
`FP32ScaleRMSNorm` multiplies by the weight in fp32, then casts back (GPT-OSS: transformers keeps
those norms in fp32, so in bf16 the product is rounded once, not twice).
`GatedRMSNorm` normalises, scales, then multiplies by silu(gate) (Gated DeltaNet's output norm).
`GemmaRMSNorm` (Gemma 4) normalises with pow(mean + eps, -0.5), not rsqrt, and scales by the weight
in fp32 (transformers' Gemma4RMSNorm: pow and rsqrt can differ in the last bit); `UnscaledRMSNorm`
is the same without a weight (Gemma 4's value norm and router input norm).
`NORMS` is the registry an ArchSpec's `norm` names for the decoder's own norms.

On CUDA the first three run as one fused Triton launch each (`fused_scale` names how the kernel
applies the weight; the torch `reference` is the spec and the CPU path), and `add_and_norm` also
folds the residual add before the norm into that launch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moestream import kernels


class RMSNorm(nn.Module):
    fused_scale: int | None = kernels.SCALE_CAST_THEN_WEIGHT   # None: no fused kernel for this kind

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def _fused(self, x: torch.Tensor) -> bool:
        return self.fused_scale is not None and kernels.fused_ops_enabled(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused(x):
            return kernels.rms_norm(x, self.weight, self.eps, self.fused_scale)[0]
        return self.reference(x)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, its norm): the residual add and the next norm, one launch where fused."""
        if self._fused(delta):
            normed, summed = kernels.rms_norm(delta, self.weight, self.eps, self.fused_scale, residual=x)
            return summed, normed
        x = x + delta
        return x, self(x)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class ZeroCentredRMSNorm(RMSNorm):
    """Scale by (1 + weight): a zero weight is the identity scale (Qwen3-Next's layer and q/k norms)."""

    fused_scale = kernels.SCALE_ONE_PLUS_WEIGHT_FP32

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class FP32ScaleRMSNorm(RMSNorm):
    """Scale in fp32 before casting back (GPT-OSS's norms: the same numbers as transformers in bf16)."""

    fused_scale = kernels.SCALE_WEIGHT_FP32

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


class GatedRMSNorm(RMSNorm):
    """Normalise, scale, then gate by silu(gate) in fp32 (the norm before Gated DeltaNet's out-projection)."""

    fused_scale = None

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


def _gemma_normalise(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x in fp32 over the root of its mean square, by torch.pow as transformers' Gemma4RMSNorm does."""
    h = x.float()
    return h * torch.pow(h.pow(2).mean(-1, keepdim=True) + eps, -0.5)


class GemmaRMSNorm(RMSNorm):
    """Gemma 4's norm: normalise by pow(., -0.5) in fp32, scale by the weight in fp32, cast back."""

    fused_scale = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (_gemma_normalise(x, self.eps) * self.weight.float()).type_as(x)


class UnscaledRMSNorm(nn.Module):
    """Gemma 4's norm without a weight (with_scale=False): values, and the router's input."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _gemma_normalise(x, self.eps).type_as(x)


NORMS: dict[str, type[RMSNorm]] = {"rms": RMSNorm, "zero_centred_rms": ZeroCentredRMSNorm,
                                   "rms_fp32_scale": FP32ScaleRMSNorm, "gemma_rms": GemmaRMSNorm}
