"""The expert store of GPTQ, AWQ and compressed-tensors pack-quantized checkpoints.

Their experts are per-expert modules (`...experts.E.gate_proj.qweight`, ...), each read through
`IntQuantReader`: repacked at load into the affine format that holds the same weights bit for bit
(`native`: the bank, host tier and staging keep 2/3/4/8-bit codes with their scales and biases), or,
where no affine format does (act-order groups, a group size none of ours divides), dequantized and
encoded into the plan's fallback format (int8 for 2-4-bit checkpoints, the compute dtype for
8-bit ones: `fallback_spec`), announced once when the store opens.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

from torch import Tensor

from moestream.archs.spec import ArchSpec, ModelConfig
from moestream.checkpoint.int_quantized import MARKER, IntQuantReader
from moestream.checkpoint.safetensors_index import TensorIndex
from moestream.errors import CheckpointError
from moestream.experts.format import ExpertFormat
from moestream.experts.store import ExpertStore
from moestream.quant.gptq import fallback_spec

PROJECTIONS = ("gate", "up", "down")


class IntQuantExpertStore(ExpertStore):
    def __init__(self, index: TensorIndex, config: ModelConfig, spec: ArchSpec, reader: IntQuantReader):
        super().__init__(index, config, spec)
        if spec.expert_layout != "per_expert":
            raise CheckpointError(f"{spec.name}'s experts are stacked tensors, which moestream reads from "
                                  f"{reader.quant.method} checkpoints only per expert; use a bf16 export.")
        self.reader = reader
        I, H = self.shape.intermediate, self.shape.hidden
        self.sizes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
        for layer in self.moe_layers:   # every expert stored quantized: fail before loading, not midway
            for e in range(self.num_experts):
                for path in self._paths(layer, e).values():
                    if not reader.holds(path):
                        raise CheckpointError(f"tensor '{path}.{MARKER[reader.quant.method]}' is missing from the "
                                              f"checkpoint in {index.folder}; the download is incomplete or the "
                                              f"experts are not {reader.quant.method}-quantized.")
        if reader.spec is not None:
            self.native = {layer: reader.spec for layer in self.moe_layers}
        else:
            held = fallback_spec(reader.quant)
            how = (f"requantized to {held.name} at load (about 0.6% relative weight error on top of the checkpoint's "
                   "own, twice the bytes of 4-bit codes)" if held is not None else
                   "dequantized to the compute dtype at load (twice the bytes of the 8-bit codes)")
            print(f"[moestream] {reader.quant.name} has no exact form in moestream's affine formats (its groups are "
                  f"permuted by act-order, or not a multiple of 32 columns), so its experts are {how}.", file=sys.stderr)

    def _paths(self, layer: int, expert: int) -> dict[str, str]:
        names = self.spec.expert_tensor_names(layer, expert)
        return {proj: name.removesuffix(".weight") for proj, name in zip(PROJECTIONS, names)}

    def read_into(self, layer: int, expert: int, fmt: ExpertFormat, out: Mapping[str, Tensor]) -> None:
        paths = self._paths(layer, expert)
        if self.native is None:
            fmt.encode(*(self.reader.dense(paths[p], *self.sizes[p]) for p in PROJECTIONS), out)
            return
        self._check_native(layer, fmt)
        I = self.shape.intermediate
        for proj in PROJECTIONS:
            parts = self.reader.parts(paths[proj], *self.sizes[proj])
            for part, t in parts.items():
                dest = out[f"down.{part}"] if proj == "down" else \
                    out[f"gate_up.{part}"][:I] if proj == "gate" else out[f"gate_up.{part}"][I:]
                dest.copy_(t)
