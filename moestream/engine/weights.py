"""Dense weights: every parameter of the module tree read by its checkpoint name, in the right precision.

A full-precision parameter is read as stored and cast to the compute dtype; where the checkpoint
holds it quantized the MLX way (`<module>.weight` packed + `.scales` [+ `.biases`]) it is
dequantized (routers are kept at full precision whatever the file holds). A quantized module
(`QuantLinear`, `QuantEmbedding`) takes its packed tensors as stored (`.qweight` of a packed
checkpoint, or MLX's packed `.weight`), or quantizes the full-precision weight now (quantize on
load), on the target device where that is faster. An FP8 checkpoint's linears (float8_e4m3fn
`.weight` + its scale grid, `moestream.quant.fp8`) are FP8 `QuantLinear`s that take both as stored;
an FP8 weight of any other module is dequantized to the compute dtype here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor, nn

from moestream.archs import ModelConfig
from moestream.checkpoint import TensorIndex
from moestream.errors import CheckpointError
from moestream.experts.store import check_fp8_weight
from moestream.model.decoder import parameter_dtype
from moestream.model.quant_linear import QuantEmbedding, QuantLinear
from moestream.quant import QuantSpec, dequantize, quantize
from moestream.quant.fp8 import Fp8Spec, dequantize_fp8

QUANT_PARTS = ("qweight", "scales", "biases")
StoredSpec = Callable[[str], QuantSpec | None]   # module path → the spec it is stored with (MLX), else None


class StoredReader(Protocol):
    """Modules a checkpoint stores in a foreign quantization (GPTQ, AWQ, compressed-tensors:
    checkpoint/int_quantized.py): given as our affine parts where exact, else dequantized."""

    def holds(self, path: str) -> bool: ...
    def parts(self, path: str, n: int, k: int) -> dict[str, Tensor]: ...
    def dense(self, path: str, n: int, k: int) -> Tensor: ...


def parameter_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """Bytes the loaded parameters take: packed parts as they are, everything else in `dtype`."""
    size = torch.empty((), dtype=dtype).element_size()
    total = 0
    for module in model.modules():
        quant = isinstance(module, (QuantLinear, QuantEmbedding))
        for name, p in module.named_parameters(recurse=False):
            total += p.numel() * (p.element_size() if quant and name in QUANT_PARTS else size)
    return total


def _module_source(module: str, config: ModelConfig, index: TensorIndex) -> str:
    """Where a module's weight is read from: a tied (or absent-but-tied) LM head reads the embedding."""
    if module != "lm_head":
        return module
    present = any(f"lm_head.{part}" in index for part in ("weight", "qweight"))
    if config.tie_embeddings or not present:
        if not config.tie_embeddings:
            raise CheckpointError(f"tensor 'lm_head.weight' is missing from the checkpoint in {index.folder}; "
                                  "the download is incomplete.")
        return "model.embed_tokens"
    return module


def _read_packed(index: TensorIndex, module: str, spec: QuantSpec, rows: int) -> dict[str, Tensor]:
    """qweight / scales / biases of a quantized module: ours (`.qweight`) or MLX's (packed `.weight`)."""
    if f"{module}.qweight" in index:
        out = {"qweight": index.read(f"{module}.qweight")}
    else:
        packed = index.read(f"{module}.weight")
        if packed.dtype.is_floating_point:
            raise CheckpointError(f"{module}.weight is stored as {packed.dtype} but its scales say it is quantized; "
                                  "the checkpoint is damaged.")
        out = {"qweight": packed.view(torch.uint8).reshape(rows, -1)}
    out["scales"] = index.read(f"{module}.scales", floating=True)
    if spec.has_bias:
        out["biases"] = index.read(f"{module}.biases", floating=True)
    return out


def _read_float(index: TensorIndex, module: str, part: str, shape: tuple[int, ...], stored: StoredSpec,
                reader: StoredReader | None = None, fp8: Fp8Spec | None = None) -> Tensor:
    """A full-precision tensor, dequantized when the file stores its module quantized (MLX's, a
    foreign quantization `reader` reads, or FP8 with the checkpoint's `fp8` layout)."""
    name = f"{module}.{part}"
    if reader is not None and part == "weight" and len(shape) == 2 and reader.holds(module):
        return reader.dense(module, *shape)
    if fp8 is not None and part == "weight" and name in index and index.info(name).dtype == torch.float8_e4m3fn:
        check_fp8_weight(index, name, shape, fp8)
        scale = index.read(f"{module}.{fp8.scale_name}")
        return dequantize_fp8(index.read(name), scale, fp8)
    if part != "weight" or f"{module}.scales" not in index:
        return index.read(name, expected_shape=shape, floating=True)
    spec = stored(module)
    if spec is None:
        raise CheckpointError(f"{module} is stored quantized but config.json does not say how; fix the config.")
    q = _read_packed(index, module, spec, shape[0])
    return dequantize(q["qweight"], q["scales"], q.get("biases"), spec).view(shape)


def _load_quantized(module: QuantLinear | QuantEmbedding, source: str, index: TensorIndex, stored: StoredSpec,
                    device: torch.device, reader: StoredReader | None = None,
                    fp8: Fp8Spec | None = None) -> dict[str, Tensor]:
    """The packed parts of a quantized module: as stored, or quantized now from full precision
    (FP8: the e4m3 bytes and the scale grid as the checkpoint stores them)."""
    if reader is not None and reader.holds(source):
        return reader.parts(source, module.qweight.shape[0], module.qweight.shape[1] * 8 // module.spec.bits)
    if isinstance(module.spec, Fp8Spec):
        rows, cols = module.qweight.shape
        check_fp8_weight(index, f"{source}.weight", (rows, cols), module.spec)
        scale = index.read(f"{source}.{module.spec.scale_name}").to(torch.float32)
        return {"qweight": index.read(f"{source}.weight").view(torch.uint8),
                "scales": scale.reshape(module.scales.shape)}
    if f"{source}.qweight" in index or f"{source}.scales" in index:
        held = stored(source) if f"{source}.qweight" not in index else module.spec
        if held != module.spec:
            raise CheckpointError(f"{source} is stored as {held.name if held else 'full precision'}, "
                                  f"not {module.spec.name}; load it in its own format.")
        return _read_packed(index, source, module.spec, module.qweight.shape[0])
    shape = ((module.out_features, module.in_features) if isinstance(module, QuantLinear)
             else (module.num_embeddings, module.embedding_dim))
    return quantize(_read_float(index, source, "weight", shape, stored, reader, fp8).to(device), module.spec).parts()


def load_dense_weights(model: nn.Module, index: TensorIndex, config: ModelConfig, device: torch.device,
                       dtype: torch.dtype, stored: StoredSpec = lambda path: None,
                       reader: StoredReader | None = None, fp8: Fp8Spec | None = None) -> None:
    """Fill every parameter of `model` (built on the meta device) from `index`, checking shapes
    (`reader`: a foreign quantization's modules; `fp8`: the checkpoint's FP8 layout, whose
    float8_e4m3fn weights FP8 modules take as stored and the others dequantize)."""
    for path, module in model.named_modules():
        params = dict(module.named_parameters(recurse=False))
        if not params:
            continue
        source = _module_source(path, config, index)
        quant = isinstance(module, (QuantLinear, QuantEmbedding))
        parts = _load_quantized(module, source, index, stored, device, reader, fp8) if quant else {}
        for name, param in params.items():
            if name in parts:
                tensor = parts[name]
                if tuple(tensor.shape) != tuple(param.shape) or tensor.dtype != param.dtype:
                    raise CheckpointError(f"tensor {source}.{name} is {tensor.dtype} {list(tensor.shape)} but the model "
                                          f"expects {param.dtype} {list(param.shape)}; the checkpoint does not match.")
                tensor = tensor.to(device)
            else:
                tensor = _read_float(index, source, name, tuple(param.shape), stored, reader, fp8).to(
                    device=device, dtype=parameter_dtype(module, name, dtype))
            setattr(module, name, nn.Parameter(tensor, requires_grad=False))
        if isinstance(module, QuantEmbedding):
            module.dtype = dtype
