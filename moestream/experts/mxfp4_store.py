"""The expert store of gpt-oss's MXFP4 checkpoints (`quantization_config.quant_method = "mxfp4"`).

Per MoE layer the experts are four stacked tensors and two biases, as transformers' GptOssExperts
saves them quantized: `gate_up_proj_blocks (E, 2I, H/32, 16)` and `gate_up_proj_scales (E, 2I, H/32)`
uint8 (rows = output features, gate and up interleaved: row 2j is gate j, row 2j + 1 up j),
`down_proj_blocks (E, H, I/32, 16)`, `down_proj_scales (E, H, I/32)`, `gate_up_proj_bias (E, 2I)`
(interleaved too) and `down_proj_bias (E, H)`. Expert e is one byte range of each; its gate/up rows
are de-interleaved on read (a row permutation: the bytes themselves are kept), so the slots hold
the MXFP4 format (experts/mxfp4_format.py) with the gate rows first.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from moestream.archs.spec import ArchSpec, ModelConfig
from moestream.checkpoint.safetensors_index import TensorIndex, check_floating
from moestream.errors import CheckpointError
from moestream.experts.format import ExpertFormat
from moestream.experts.mxfp4_format import Mxfp4Format
from moestream.experts.store import ExpertStore
from moestream.quant.mxfp4 import BLOCK_BYTES, GROUP, MXFP4


class Mxfp4ExpertStore(ExpertStore):
    def __init__(self, index: TensorIndex, config: ModelConfig, spec: ArchSpec):
        super().__init__(index, config, spec)
        if spec.expert_layout != "stacked":
            raise CheckpointError(f"config.json says the weights are MXFP4-quantized, which moestream reads for "
                                  f"gpt-oss's stacked experts only, not {spec.name}'s; use a bf16 export.")
        I, H, E = self.shape.intermediate, self.shape.hidden, self.num_experts
        Mxfp4Format(torch.float32).tensors(self.shape)   # widths in whole blocks, or one sentence
        self.sizes = {"gate_up": (2 * I, H), "down": (H, I)}
        experts = {f"{spec.stacked_expert_names(layer)[proj]}_{part}" for layer in self.moe_layers
                   for proj in self.sizes for part in ("blocks", "scales")}
        other = sorted(name for name in index.tensors if name.endswith(("_blocks", "_scales")) and name not in experts)
        if other:
            raise CheckpointError(f"tensor {other[0]!r} is MXFP4-quantized, but moestream reads MXFP4 for the routed "
                                  "experts only (the published gpt-oss checkpoints keep every other tensor in bf16); "
                                  "list that module in modules_to_not_convert and store it unquantized.")
        bias_dtypes = set()
        for layer in self.moe_layers:   # every expert tensor checked before anything loads
            names = spec.stacked_expert_names(layer)
            for proj, (n, k) in self.sizes.items():
                base = names[proj]
                if base in self.index and f"{base}_blocks" not in self.index:
                    raise CheckpointError(f"tensor {base!r} is stored unquantized although config.json says the "
                                          "experts are MXFP4; remove quantization_config or use the MXFP4 tensors.")
                want = {"blocks": (E, n, k // GROUP, BLOCK_BYTES), "scales": (E, n, k // GROUP)}
                for part, shape in want.items():
                    name = f"{base}_{part}"
                    if name not in self.index:
                        raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {index.folder}; "
                                              f"MXFP4 experts need both _blocks and _scales, so the download is "
                                              f"incomplete.")
                    info = self.index.info(name)
                    if info.shape != shape or info.dtype != torch.uint8:
                        raise CheckpointError(f"tensor {name!r} is {str(info.dtype).removeprefix('torch.')} of shape "
                                              f"{list(info.shape)} but MXFP4 experts of this config.json have uint8 "
                                              f"{part} of shape {list(shape)}; the checkpoint is damaged or does "
                                              f"not match its config.")
                bias = self.index.info(names[f"{proj}_bias"])
                if bias.shape != (E, n):
                    raise CheckpointError(f"tensor {bias.name!r} has shape {list(bias.shape)} but config.json "
                                          f"implies {[E, n]}; the config does not match the weights.")
                check_floating(bias)
                bias_dtypes.add(bias.dtype)
        if len(bias_dtypes) > 1:
            raise CheckpointError(f"expert biases mix dtypes {sorted(map(str, bias_dtypes))}; re-save the "
                                  "checkpoint with one dtype.")
        self.dtype = bias_dtypes.pop() if bias_dtypes else torch.bfloat16
        self.native = {layer: MXFP4 for layer in self.moe_layers}

    def _row(self, name: str, expert: int, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        row = torch.empty(shape, dtype=dtype)
        return self.index.read_into(self.index.info(name), row, start=expert * row.numel() * row.element_size())

    def read_raw_parts(self, layer: int, expert: int) -> dict[str, Tensor]:
        """One expert's MXFP4 tensors as the slots hold them: blocks (N, K/2) and scales (N, K/32)
        uint8 and the biases in the stored dtype, gate rows (and gate biases) first."""
        names = self.spec.stacked_expert_names(layer)
        out = {}
        for proj, (n, k) in self.sizes.items():
            blocks = self._row(f"{names[proj]}_blocks", expert, (n, k // 2), torch.uint8)
            scales = self._row(f"{names[proj]}_scales", expert, (n, k // GROUP), torch.uint8)
            bias = self._row(names[f"{proj}_bias"], expert, (n,), self.dtype)
            if proj == "gate_up":   # rows 2j gate, 2j + 1 up → gate rows, then up rows
                blocks, scales, bias = (torch.cat([t[0::2], t[1::2]]) for t in (blocks, scales, bias))
            out.update({f"{proj}.blocks": blocks, f"{proj}.scales": scales, f"{proj}_bias": bias})
        return out

    def read_into(self, layer: int, expert: int, fmt: ExpertFormat, out: Mapping[str, Tensor]) -> None:
        self._check_native(layer, fmt)
        for name, t in self.read_raw_parts(layer, expert).items():
            out[name].copy_(t)
