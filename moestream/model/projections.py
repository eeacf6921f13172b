"""The model's linear layers: `Linear` (batch-1 rows through the Triton GEMV on CUDA), and q, k and
v projected by one GEMM, their weights concatenated once after loading (on CUDA).

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

    def fuse_qkv(self) -> None:
        """Concatenate the three weights (and biases) and make each projection a view into them.
        Quantized projections (not plain `nn.Linear`) are left as they are."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        biased = {p.bias is not None for p in projs}
        if not all(type(p) in (nn.Linear, Linear) for p in projs) or len(biased) > 1 or self.qkv_weight is not None:
            return
        with torch.no_grad():
            weight = torch.cat([p.weight for p in projs])
            bias = torch.cat([p.bias for p in projs]) if True in biased else None
            sizes = tuple(p.out_features for p in projs)
            for p, w in zip(projs, weight.split(sizes)):
                p.weight.data = w
            if bias is not None:
                for p, b in zip(projs, bias.split(sizes)):
                    p.bias.data = b
        self.qkv_weight, self.qkv_bias, self.qkv_sizes = weight, bias, sizes

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, k, v) projections of x (..., hidden): one GEMM where fused (views of its output)."""
        if self.qkv_weight is not None and kernels.fused_ops_enabled(x):
            return kernels.linear(x, self.qkv_weight, self.qkv_bias).split(self.qkv_sizes, dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)
