"""The expert store of a GGUF checkpoint: llama.cpp's stacked `ffn_{gate,up,down}_exps` tensors.

Each stack is (E, N, K) in one ggml type, so expert e is one byte range of each (its N rows of
blocks; where gate and up share one fused (E, 2I, H) stack, expert e's gate rows then its up
rows, and gpt-oss's (E, 2I) fused bias stack likewise). `layer_spec` decides each layer's format
from the three types alone (the plan calls it before any weight is read): MXFP4 where all three
are (their codes and scales kept), the affine spec holding them exactly when there is one
(int4-g32 for Q4_0/Q4_1/Q4_K, int8-g32 for Q8_0/Q5_K and for a mix of exact types; scales and biases in fp16
where every type's are exact in it, Q4_0's 5 bits a weight, else fp32: `ggml.common_spec`),
int8-g32 requantized where a Q6_K tensor is among them (its error, measured on the first expert
read, printed once), the compute dtype where a float stack is among them (blocks dequantized).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Mapping

import torch
from torch import Tensor

from moestream.archs.spec import ArchSpec, ModelConfig
from moestream.checkpoint.gguf_file import GGUFCheckpoint, GGUFTensor
from moestream.checkpoint.gguf_index import GGUFReads, unsupported
from moestream.errors import CheckpointError
from moestream.experts.format import ExpertFormat, ExpertShape, QuantizedFormat, encode_biases
from moestream.experts.mxfp4_format import Mxfp4Format
from moestream.experts.store import ExpertStore
from moestream.quant import QuantSpec, ggml
from moestream.quant.mxfp4 import MXFP4, Mxfp4Spec
from moestream.quant.tensor import QuantizedTensor

PROJECTIONS = ("gate", "up", "down")


def layer_types(ckpt: GGUFCheckpoint, layer: int) -> tuple[str, str, str]:
    return tuple(ckpt.tensors[n].type_name for n in ckpt.expert_names(layer))


def layer_spec(types: tuple[str, ...]) -> QuantSpec | Mxfp4Spec | None:
    """The spec a layer's experts are held in: MXFP4 where all three stacks are, an affine spec
    where the block types have one, None for the compute dtype (float stacks, or MXFP4 beside
    other types: the blocks dequantized, exact)."""
    if set(types) == {"MXFP4"}:
        return MXFP4
    if any(t in ggml.FLOAT_TYPES or t in ggml.NATIVE or not ggml.readable(t) for t in types):
        return None   # (a type moestream does not read is refused by the store, naming it)
    return ggml.common_spec(types)


class GGUFExpertStore(ExpertStore):
    def __init__(self, ckpt: GGUFCheckpoint, config: ModelConfig, spec: ArchSpec, index):
        super().__init__(index, config, spec)
        self.ckpt, self.reads = ckpt, GGUFReads(ckpt)
        I, H, E = self.shape.intermediate, self.shape.hidden, self.num_experts
        want = {"gate": (E, I, H), "up": (E, I, H), "down": (E, H, I)}
        self.tensors, self.biases = {}, {}
        for layer in self.moe_layers:   # every stack present, of its shape and a type we read: before any load
            stacks = dict(zip(PROJECTIONS, (ckpt.tensors[n] for n in ckpt.expert_names(layer))))
            for proj, t in stacks.items():
                if not ggml.readable(t.type_name):
                    raise unsupported(t, ckpt.path.name)
                shape = (E, 2 * I, H) if _fused(t) else want[proj]
                if t.shape != shape:
                    raise CheckpointError(f"tensor {t.name!r} of {ckpt.path.name} has shape {list(t.shape)} but its "
                                          f"metadata implies {list(shape)}; the GGUF does not match its metadata.")
            self.tensors[layer] = stacks
            if self.shape.bias:   # gpt-oss: each stack's (E, N) float biases beside it (gate's and up's maybe fused)
                names = dict(zip(PROJECTIONS, ckpt.expert_bias_names(layer)))
                self.biases[layer] = {proj: self._bias_tensor(names[proj], (E, 2 * I) if _fused(names[proj]) else
                                                              want[proj][:2]) for proj in PROJECTIONS}
        self.dtype = torch.float32
        self._noted = threading.Lock()
        self._requant_error: float | None = None

    def _rows(self, layer: int, expert: int, proj: str) -> tuple[Tensor, str]:
        t = self.tensors[layer][proj]
        per = t.shape[1]
        if _fused(t):   # gate rows, then up rows
            half = per // 2
            return self.reads.rows(t, expert * per + (half if proj == "up" else 0), half)
        return self.reads.rows(t, expert * per, per)

    def _quantized(self, rows: Tensor, type_name: str, spec: QuantSpec) -> QuantizedTensor:
        """`rows` of one projection in `spec`: exact, or requantized (Q6_K, floats beside blocks)."""
        if type_name in ggml.EXACT:   # in the layer's spec: 4-bit codes widened to its 8-bit ones, fp16 scales
            return ggml.to_affine(rows, type_name, spec)   # held as fp32: the same weights
        q, error = ggml.requantize(rows, type_name, rows.shape[1] * 256 // ggml.REQUANTIZED[type_name][1])
        self._note(type_name, error)
        return q

    def _note(self, type_name: str, error: float) -> None:
        with self._noted:
            if self._requant_error is None:
                self._requant_error = error
                print(f"[moestream] {type_name} experts have no exact form in moestream's formats (two scales in "
                      f"every 32 values): they are requantized to int8-g32 at load, a relative weight error of "
                      f"{error:.2%} on the first one read (max |dw| / max |w|; {type_name}'s own rounding is up to "
                      "1.6%).", file=sys.stderr)

    def read_into(self, layer: int, expert: int, fmt: ExpertFormat, out: Mapping[str, Tensor]) -> None:
        self._read_weights(layer, expert, fmt, out)
        if self.shape.bias:   # gpt-oss: ffn_{gate,up,down}_exps.bias (or ffn_gate_up_exps.bias), (E, N) floats
            encode_biases(out, tuple(self._bias(layer, expert, proj) for proj in PROJECTIONS))

    def _bias_tensor(self, name: str, shape: tuple[int, int]) -> GGUFTensor:
        t = self.ckpt.tensors[name]
        if tuple(t.shape) != shape or not ggml.readable(t.type_name):
            raise CheckpointError(f"tensor {name!r} of {self.ckpt.path.name} is {list(t.shape)} {t.type_name} where "
                                  f"the experts need {list(shape)} floats; the GGUF does not match its metadata.")
        return t

    def _bias(self, layer: int, expert: int, proj: str) -> Tensor:
        t = self.biases[layer][proj]
        row, type_name = self.reads.rows(t, expert, 1)
        bias = self._dense(row, type_name, t.shape[-1])[0]
        if _fused(t.name):   # gate's biases, then up's
            half = t.shape[-1] // 2
            return bias[half:] if proj == "up" else bias[:half]
        return bias

    def _read_weights(self, layer: int, expert: int, fmt: ExpertFormat, out: Mapping[str, Tensor]) -> None:
        I = self.shape.intermediate
        rows = {p: self._rows(layer, expert, p) for p in PROJECTIONS}
        if isinstance(fmt, Mxfp4Format):   # the codes and scales as stored, gate's rows then up's
            for proj in PROJECTIONS:
                blocks, scales = ggml.to_mxfp4(rows[proj][0])
                stem = "down" if proj == "down" else "gate_up"
                part = slice(None) if proj == "down" else slice(None, I) if proj == "gate" else slice(I, None)
                out[f"{stem}.blocks"][part].copy_(blocks)
                out[f"{stem}.scales"][part].copy_(scales)
            return
        if not isinstance(fmt, QuantizedFormat):
            fmt.encode(*(self._dense(*rows[p], self.sizes(p)[1]) for p in PROJECTIONS), out)
            return
        for proj in PROJECTIONS:
            parts = self._quantized(*rows[proj], fmt.spec).parts()
            for part, t in parts.items():
                dest = out[f"down.{part}"] if proj == "down" else \
                    out[f"gate_up.{part}"][:I] if proj == "gate" else out[f"gate_up.{part}"][I:]
                dest.copy_(t.to(dest.dtype) if part != "qweight" else t)

    def sizes(self, proj: str) -> tuple[int, int]:
        I, H = self.shape.intermediate, self.shape.hidden
        return (H, I) if proj == "down" else (I, H)

    @staticmethod
    def _dense(rows: Tensor, type_name: str, k: int) -> Tensor:
        return rows if type_name in ggml.FLOAT_TYPES else ggml.dequantize_blocks(rows, type_name, k)


def _fused(t: GGUFTensor | str) -> bool:
    """Gate and up in one stack (the converter's --fuse-gate-up-exps): weights or biases."""
    return (t if isinstance(t, str) else t.name).endswith((".ffn_gate_up_exps.weight", ".ffn_gate_up_exps.bias"))


def expert_formats(ckpt: GGUFCheckpoint, config: ModelConfig, dtype: torch.dtype,
                   dense: ExpertFormat) -> dict[int, ExpertFormat]:
    """Per MoE layer, the format `layer_spec` gives its experts (`dense`: the compute dtype's, also
    for block types in a family whose experts the affine formats do not hold: biases or a clamped
    SwiGLU, as gpt-oss's; its MXFP4 experts keep their bytes)."""
    plain = ExpertShape.of(config).plain
    out = {}
    for layer, moe in enumerate(config.moe_layers):
        if moe:
            spec = layer_spec(layer_types(ckpt, layer))
            out[layer] = (Mxfp4Format(dtype) if spec == MXFP4 else QuantizedFormat(spec, dtype)
                          if spec is not None and plain else dense)
    return out

