"""The model's linear layers: `Linear` (batch-1 rows through the Triton GEMV on CUDA), and q, k and
v projected by one GEMM, their weights concatenated once after loading (on CUDA); quantized q, k
and v of one format likewise (their packed bytes, scales and biases concatenated: one GEMV).

At batch 1 a projection is a GEMV whose time is mostly launch and tail, not bytes: the k and v
projections of a Qwen3-30B-A3B layer read 2 MB each yet take as long as a 4 MB one. One GEMM over
the concatenated weight does all three. Each projection's own weight becomes a view into the
concatenated tensor, so memory does not grow, parameter names stay the checkpoint's, and the
separate projections (the torch path, `fused_ops(False)`) still work on the same storage.
"""

from __future__ import annotations

import torch
from torch import nn

from moestream import kernels
from moestream.model.quant_linear import QuantLinear
from moestream.quant import QuantSpec


class Linear(nn.Linear):
    """`nn.Linear` whose forward is `kernels.linear`: the GEMV kernel for a decode step's single row
    on CUDA, `F.linear` everywhere else. Same parameters, names and state dict as `nn.Linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, self.weight, self.bias)


class FusedQKV:
    """Mixin for a mixer with `q_proj`, `k_proj`, `v_proj` linears."""

    qkv_weight: torch.Tensor | None = None
    qkv_bias: torch.Tensor | None = None
    qkv_sizes: tuple[int, int, int] = (0, 0, 0)
    # quantized q, k, v fused: (packed bytes, scales, biases or None), their spec
    qkv_packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
    qkv_spec: QuantSpec | None = None

    def fuse_qkv(self) -> None:
        """Concatenate the three weights (and biases) and make each projection a view into them:
        plain projections, or quantized ones of one format. Mixed ones are left as they are."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        biased = {p.bias is not None for p in projs}
        if len(biased) > 1 or self.qkv_weight is not None or self.qkv_packed is not None:
            return
        sizes = tuple(p.out_features for p in projs)
        if all(type(p) in (nn.Linear, Linear) for p in projs):
            self.qkv_weight = _concatenated(projs, "weight")
        elif (all(isinstance(p, QuantLinear) for p in projs) and len({p.spec for p in projs}) == 1
              and _grids_stack(projs)):
            packed = _concatenated(projs, "qweight"), _concatenated(projs, "scales")
            biases = _concatenated(projs, "biases") if projs[0].biases is not None else None
            self.qkv_packed, self.qkv_spec = (*packed, biases), projs[0].spec
        else:
            return
        self.qkv_bias = _concatenated(projs, "bias") if True in biased else None
        self.qkv_sizes = sizes

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, k, v) projections of x (..., hidden): one GEMM where fused (views of its output)."""
        if self.qkv_weight is not None and kernels.fused_ops_enabled(x):
            return kernels.linear(x, self.qkv_weight, self.qkv_bias).split(self.qkv_sizes, dim=-1)
        if self.qkv_packed is not None and kernels.fused_ops_enabled(x):
            flat = kernels.quant_linear(x.reshape(-1, x.shape[-1]), *self.qkv_packed, self.qkv_spec, self.qkv_bias)
            return flat.view(*x.shape[:-1], -1).split(self.qkv_sizes, dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


def _grids_stack(projs: tuple[QuantLinear, ...]) -> bool:
    """Whether the projections' scales concatenate into the scales of their concatenated weight: always
    for group formats; for FP8 when every block of rows but the last projection's is whole."""
    spec = projs[0].spec
    if spec.kind != "fp8":
        return True
    return spec.block_n is not None and all(p.out_features % spec.block_n == 0 for p in projs[:-1])


def _concatenated(projs: tuple[nn.Module, ...], name: str) -> torch.Tensor:
    """The projections' parameters `name` concatenated along their rows; each parameter becomes a view
    into the result (memory does not grow, the state dict keeps the checkpoint's names)."""
    with torch.no_grad():
        whole = torch.cat([getattr(p, name) for p in projs])
        for p, part in zip(projs, whole.split([getattr(p, name).shape[0] for p in projs])):
            getattr(p, name).data = part
    return whole
