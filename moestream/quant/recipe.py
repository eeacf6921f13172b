"""Mixed precision: which quantization each class of tensor gets, with per-layer overrides.

Classes: `experts` (routed experts), `shared` (shared experts and the dense FFN of layers kept
dense), `attention` (q/k/v/o projections), `embeddings` (token embeddings and the LM head). Routers
and norms always stay at full precision. A class set to None stays in the compute dtype. A layer
override (`layer_formats`: layer index → format, negative indices counting from the end) replaces the
format of every quantized class in that layer, e.g. the first and last layers at 8 bits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moestream.errors import InputError
from moestream.quant.spec import QuantSpec, parse_quant

CLASSES = ("experts", "shared", "attention", "embeddings")
FULL = ("bf16", "fp16", "fp32", "none", "auto")   # names that mean "not quantized"


def _spec(name: str | None, scale_dtype: torch.dtype) -> QuantSpec | None:
    if name is None or str(name).lower() in FULL:
        return None
    return parse_quant(name, scale_dtype)


@dataclass(frozen=True)
class QuantRecipe:
    experts: str | None = None
    shared: str | None = None
    attention: str | None = None
    embeddings: str | None = None
    layer_formats: dict[int, str] = field(default_factory=dict)
    scale_dtype: torch.dtype = torch.bfloat16

    def validate(self, num_layers: int | None = None) -> QuantRecipe:
        """Parse every name once (unknown formats are refused here, before anything loads)."""
        for cls in CLASSES:
            _spec(getattr(self, cls), self.scale_dtype)
        for layer, name in self.layer_formats.items():
            if not isinstance(layer, int):
                raise InputError(f"layer override {layer!r} is not a layer index; write it like 0=int8 or -1=int8.")
            if num_layers is not None and not -num_layers <= layer < num_layers:
                raise InputError(f"layer override {layer} is outside the model's {num_layers} layers; "
                                 f"use 0..{num_layers - 1} or a negative index from the end.")
            _spec(name, self.scale_dtype)
        return self

    def check_dtype(self, dtype: torch.dtype) -> None:
        """A class named with a full-precision dtype must name the compute dtype (nothing converts it)."""
        names = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
        for cls, name in [(c, getattr(self, c)) for c in CLASSES] + [(f"layer {k}", v) for k, v in self.layer_formats.items()]:
            if name in names and names[name] != dtype:
                raise InputError(f"{cls} as {name} need the model to compute in {name} too; pass --dtype {name} "
                                 f"or quantize them (e.g. int8).")

    @property
    def quantized(self) -> bool:
        return any(_spec(getattr(self, c), self.scale_dtype) is not None for c in CLASSES)

    def spec(self, cls: str, layer: int | None = None, num_layers: int | None = None) -> QuantSpec | None:
        """The spec of class `cls` (in `layer`, if the class lives in layers), None for full precision."""
        base = _spec(getattr(self, cls), self.scale_dtype)
        if base is None or layer is None:
            return base
        for key, name in self.layer_formats.items():
            if key == layer or (num_layers is not None and key < 0 and key + num_layers == layer):
                return _spec(name, self.scale_dtype)
        return base

    def spec_for(self, path: str, num_layers: int) -> QuantSpec | None:
        """The spec of the dense module at `path` (a model parameter path without `.weight`)."""
        cls, layer = module_class(path)
        return self.spec(cls, layer, num_layers) if cls is not None else None

    def as_dict(self) -> dict:
        return {**{c: getattr(self, c) for c in CLASSES}, "layer_formats": {str(k): v for k, v in sorted(self.layer_formats.items())},
                "scale_dtype": str(self.scale_dtype).removeprefix("torch.")}

    @classmethod
    def from_dict(cls, data: dict) -> QuantRecipe:
        return cls(**{c: data.get(c) for c in CLASSES}, layer_formats={int(k): v for k, v in data.get("layer_formats", {}).items()},
                   scale_dtype=getattr(torch, data.get("scale_dtype", "bfloat16")))


_DENSE_FFN = ("gate_proj", "up_proj", "down_proj")


def module_class(path: str) -> tuple[str | None, int | None]:
    """(tensor class, layer) of a dense module path: embeddings, attention, shared, or (None, None)."""
    if path in ("model.embed_tokens", "lm_head"):
        return "embeddings", None
    parts = path.split(".")
    if len(parts) < 5 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
        return None, None
    layer, block = int(parts[2]), parts[3]
    if block in ("self_attn", "attention", "linear_attn"):
        return "attention", layer
    if "shared_expert" in parts or "shared_experts" in parts or (len(parts) == 5 and parts[4] in _DENSE_FFN):
        return "shared", layer
    return None, None


def parse_layer_formats(items: list[str] | None) -> dict[int, str]:
    """`--layer-format 0=int8 --layer-format -1=int8` → {0: "int8", -1: "int8"}."""
    out = {}
    for item in items or []:
        layer, sep, name = str(item).partition("=")
        try:
            index = int(layer)
        except ValueError:
            index = None
        if not sep or index is None or not name:
            raise InputError(f"--layer-format {item!r} does not parse; write LAYER=FORMAT, e.g. 0=int8 or -1=int8.")
        out[index] = name
    return out
