"""The packed checkpoint `moestream convert` writes, described by its layout.json.

    config.json, tokenizer files      copied from the source checkpoint
    model.safetensors                 every tensor but the routed experts: full precision in the
                                      compute dtype, or `<module>.qweight/.scales/.biases` when the
                                      recipe quantizes its class
    experts/layer-NNN.bin             per MoE layer: expert e's tensors back to back in one record at
                                      byte e·stride (stride = record size rounded up to 4 KiB)
    layout.json                       written last: format and version, the recipe, per layer the
                                      expert format, each tensor's offset in a record, and one CRC-32
                                      per record

A packed checkpoint is found by its layout.json; everything in it is checked when it is opened
(format, sizes of every layer file) and each record's checksum the first time it is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moestream.errors import CheckpointError
from moestream.quant import QuantSpec, parse_quant
from moestream.quant.fp8 import Fp8Spec, parse_fp8

LAYOUT_NAME = "layout.json"
FORMAT = "moestream-packed"
VERSION = 1
ALIGN = 4096


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int       # within a record
    nbytes: int


@dataclass(frozen=True)
class LayerRecords:
    file: str
    spec: QuantSpec | Fp8Spec   # an FP8 spec: the FP8 checkpoint's experts, bytes and scales as stored
    stride: int
    tensors: tuple[TensorEntry, ...]
    checksums: tuple[int, ...]

    def as_dict(self) -> dict:
        return {"file": self.file, "format": self.spec.name,
                "scale_dtype": str(self.spec.scale_dtype).removeprefix("torch."), "stride": self.stride,
                "tensors": [{"name": t.name, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                             "offset": t.offset, "nbytes": t.nbytes} for t in self.tensors],
                "checksums": list(self.checksums)}


def record_layout(specs: list[tuple[str, tuple[int, ...], torch.dtype]]) -> tuple[tuple[TensorEntry, ...], int]:
    """Tensors back to back (each at a 16-byte boundary); returns the entries and the record stride."""
    entries, offset = [], 0
    for name, shape, dtype in specs:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        entries.append(TensorEntry(name, tuple(shape), dtype, offset, nbytes))
        offset += -(-nbytes // 16) * 16
    return tuple(entries), -(-offset // ALIGN) * ALIGN


@dataclass
class PackedLayout:
    folder: Path
    recipe: dict[str, Any]
    dtype: torch.dtype
    num_experts: int
    layers: dict[int, LayerRecords]
    source: dict[str, Any]

    def as_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "dtype": str(self.dtype).removeprefix("torch."),
                "recipe": self.recipe, "source": self.source, "num_experts": self.num_experts,
                "layers": {str(k): v.as_dict() for k, v in sorted(self.layers.items())}}

    @staticmethod
    def present(folder: Path) -> bool:
        return (folder / LAYOUT_NAME).is_file()

    @classmethod
    def load(cls, folder: Path) -> PackedLayout:
        """Read and check layout.json and the sizes of every layer file it names."""
        path = folder / LAYOUT_NAME
        redo = "re-run `moestream convert` to rebuild this checkpoint"
        try:
            data = json.loads(path.read_text())
            if data.get("format") != FORMAT:
                raise ValueError("not a moestream layout")
            if data.get("version") != VERSION:
                raise CheckpointError(f"{path} is layout version {data.get('version')}, this moestream reads "
                                      f"version {VERSION}; {redo}.")
            E = int(data["num_experts"])
            layers = {}
            for key, rec in data["layers"].items():
                spec = parse_fp8(rec["format"]) or parse_quant(rec["format"], getattr(torch, rec["scale_dtype"]))
                tensors = tuple(TensorEntry(t["name"], tuple(int(d) for d in t["shape"]), getattr(torch, t["dtype"]),
                                            int(t["offset"]), int(t["nbytes"])) for t in rec["tensors"])
                checksums = tuple(int(c) for c in rec["checksums"])
                if len(checksums) != E:
                    raise ValueError(f"layer {key} lists {len(checksums)} checksums for {E} experts")
                layers[int(key)] = LayerRecords(str(rec["file"]), spec, int(rec["stride"]), tensors, checksums)
            layout = cls(folder, dict(data["recipe"]), getattr(torch, data["dtype"]), E, layers,
                         dict(data.get("source", {})))
        except CheckpointError:
            raise
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{path} is not a valid packed-checkpoint layout ({exc}); {redo}.") from None
        for layer, rec in layout.layers.items():
            file = folder / rec.file
            want = rec.stride * E
            try:
                size = file.stat().st_size
            except OSError:
                raise CheckpointError(f"{file} (layer {layer}'s experts) is missing; {redo}.") from None
            if size != want:
                last = min(E - 1, size // rec.stride)
                raise CheckpointError(f"{file.name} holds {size} bytes but layer {layer}'s {E} expert records need "
                                      f"{want}: truncated from expert {last} on; {redo}.")
        return layout
