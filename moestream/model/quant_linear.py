"""Linear and embedding layers whose weight is stored quantized (mixed precision of dense tensors).

`QuantLinear` holds `qweight` (packed uint8), `scales`, `biases` (affine specs) and an optional
additive `bias`, named as a packed checkpoint stores them (or, for an FP8 spec, `qweight` (N, K)
uint8 holding the e4m3 bits and `scales` the float32 block grid, as an FP8 checkpoint stores them); its forward runs the dequantizing
linear kernel (`kernels.quant_linear`: Triton on CUDA, the plain-torch reference elsewhere).
`QuantEmbedding` dequantizes only the rows it looks up. `quantize_modules` swaps them in for the
plain layers a precision plan names, on the meta device before any weight is read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from moestream import kernels
from moestream.quant import QuantSpec, dequantize
from moestream.quant.fp8 import Fp8Spec

# Never quantized, whatever the plan says: routing decisions stay at full precision.
FULL_PRECISION = ("shared_expert_gate",)


def _quant_parameters(module: nn.Module, rows: int, cols: int, spec: QuantSpec | Fp8Spec) -> None:
    if isinstance(spec, Fp8Spec):   # a byte a value, float32 per block
        module.qweight = nn.Parameter(torch.empty(rows, cols, dtype=torch.uint8), requires_grad=False)
        module.scales = nn.Parameter(torch.empty(spec.scale_shape(rows, cols), dtype=torch.float32),
                                     requires_grad=False)
        module.biases = None
        return
    spec.check_width(cols, f"the input dimension of a {rows}x{cols} weight")
    groups = spec.groups(cols)
    module.qweight = nn.Parameter(torch.empty(rows, spec.packed_width(cols), dtype=torch.uint8), requires_grad=False)
    module.scales = nn.Parameter(torch.empty(rows, groups, dtype=spec.scale_dtype), requires_grad=False)
    module.biases = (nn.Parameter(torch.empty(rows, groups, dtype=spec.scale_dtype), requires_grad=False)
                     if spec.has_bias else None)


class QuantLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, spec: QuantSpec):
        super().__init__()
        self.in_features, self.out_features, self.spec = in_features, out_features, spec
        _quant_parameters(self, out_features, in_features, spec)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        out = kernels.quant_linear(x.reshape(-1, self.in_features), self.qweight, self.scales, self.biases,
                                   self.spec, self.bias)
        return out.view(*lead, self.out_features)


class QuantEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, spec: QuantSpec, dtype: torch.dtype | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.spec = num_embeddings, embedding_dim, spec
        self.dtype = dtype   # what rows dequantize to; set by the loader (the compute dtype)
        self.embed_scale: float | None = None   # Gemma's sqrt(hidden) (gemma4_layer.ScaledEmbedding), if any
        _quant_parameters(self, num_embeddings, embedding_dim, spec)

    def forward(self, ids: Tensor) -> Tensor:
        flat = ids.reshape(-1)
        rows = dequantize(self.qweight.index_select(0, flat), self.scales.index_select(0, flat),
                          self.biases.index_select(0, flat) if self.biases is not None else None, self.spec,
                          self.dtype or torch.float32)
        rows = rows.view(*ids.shape, self.embedding_dim)
        if self.embed_scale is not None:   # the factor in the rows' dtype, as the unquantized embedding does
            rows = rows * torch.tensor(self.embed_scale, dtype=torch.float32).to(rows.dtype).tolist()
        return rows


def quantize_modules(model: nn.Module, precision: Callable[[str], QuantSpec | None]) -> dict[str, QuantSpec]:
    """Replace every nn.Linear / nn.Embedding whose path `precision` gives a spec by its quantized
    twin (parameters uninitialised: call on a meta-device model before loading). Returns what changed."""
    changed = {}
    for path, module in list(model.named_modules()):
        if not isinstance(module, (nn.Linear, nn.Embedding)) or path.rsplit(".", 1)[-1] in FULL_PRECISION:
            continue
        spec = precision(path)
        if spec is None:
            continue
        if isinstance(module, nn.Linear):
            new = QuantLinear(module.in_features, module.out_features, module.bias is not None, spec)
        else:
            new = QuantEmbedding(module.num_embeddings, module.embedding_dim, spec)
            new.embed_scale = getattr(module, "embed_scale", None)   # Gemma's sqrt(hidden) is kept
        owner, _, name = path.rpartition(".")
        setattr(model.get_submodule(owner) if owner else model, name, new)
        changed[path] = spec
    return changed
