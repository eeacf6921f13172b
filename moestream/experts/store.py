"""The expert store: where every routed expert lives off the device, read one expert at a time.

Three layouts on disk, one interface (`read_into(layer, expert, fmt, out)`):

  CheckpointExpertStore  Hugging Face per-expert tensors (`...experts.E.gate_proj.weight`), full
                         precision: read by byte range, then written into the asked format in place
                         (same bytes) or through `ExpertFormat.encode` (a dtype change, quantize-on-load);
                         or GPT-OSS's stacked tensors (`...experts.gate_up_proj` (E, H, 2I), gate and
                         up columns interleaved, + biases): expert e is one byte range of each,
                         de-interleaved and transposed through `encode`; or transformers v5's own
                         stacking (Gemma 4: `experts.gate_up_proj` (E, 2I, H) gate rows first,
                         `experts.down_proj` (E, H, I)): one byte range each, the dense slot layout
  Fp8ExpertStore         FP8 checkpoints' per-expert tensors (`...experts.E.gate_proj.weight`
                         float8_e4m3fn + `.weight_scale_inv` / `.weight_scale` float32 or bf16):
                         the bytes and the scales read as they are into the FP8 format's slots
  MLXExpertStore         MLX's stacked quantized tensors (`...switch_mlp.gate_proj.weight` (E, N, ·)
                         uint32 + scales + biases): expert e is one byte range of each, read as it is
  PackedExpertStore      `moestream convert` output: per layer one file, each expert one contiguous
                         4 KiB-aligned record of all its tensors, read with one preadv and checked
                         against its CRC-32 the first time it is read

A pre-quantized store (`native` formats per layer) can only fill slots of exactly that format.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor

from moestream.archs.spec import ArchSpec, ModelConfig
from moestream.checkpoint.packed import PackedLayout
from moestream.checkpoint.safetensors_index import OpenFiles, TensorIndex, check_floating, read_exactly
from moestream.errors import CheckpointError
from moestream.experts.format import ExpertFormat, ExpertShape
from moestream.quant import QuantSpec
from moestream.quant.fp8 import Fp8Spec, dequantize_fp8
from moestream.quant.mlx import mlx_spec


def read_workers() -> int:
    """Threads for parallel preads and digests (os.preadv and hashlib release the GIL)."""
    return max(2, min(16, (os.cpu_count() or 2)))


class ExpertStore:
    """What every layout shares: shapes, layers, parallel bulk reads."""

    native: dict[int, QuantSpec | Fp8Spec] | None = None   # per MoE layer, the spec the bytes are stored in (pre-quantized)

    def __init__(self, index: TensorIndex, config: ModelConfig, spec: ArchSpec):
        self.index, self.config, self.spec = index, config, spec
        self.shape = ExpertShape.of(config)
        self.num_experts = config.num_experts
        self.moe_layers = [i for i, is_moe in enumerate(config.moe_layers) if is_moe]
        self.dtype = torch.float32   # the stored float dtype (full-precision layouts)

    def read_into(self, layer: int, expert: int, fmt: ExpertFormat, out: Mapping[str, Tensor]) -> None:
        raise NotImplementedError

    def read_many(self, layer: int, experts: list[int], fmt: ExpertFormat, out: Mapping[str, Tensor]) -> None:
        """Read experts[i] into row i of the stacked CPU tensors `out`, with parallel preads."""
        def one(i: int) -> None:
            self.read_into(layer, experts[i], fmt, {name: t[i] for name, t in out.items()})

        with ThreadPoolExecutor(read_workers()) as pool:
            list(pool.map(one, range(len(experts))))

    def _check_native(self, layer: int, fmt: ExpertFormat) -> None:
        stored = self.native[layer]
        if getattr(fmt, "spec", None) != stored:
            raise CheckpointError(f"layer {layer}'s experts are stored as {stored.name}, not {fmt.name}; "
                                  "load them in their own format.")


class CheckpointExpertStore(ExpertStore):
    """Full-precision experts of a Hugging Face checkpoint, in the layout the ArchSpec names
    (`expert_layout`): per-expert tensors, or stacked ones (GPT-OSS: transformers' GptOssExperts
    parameters as saved, `gate_up_proj` (E, H, 2I) with gate and up columns interleaved,
    `gate_up_proj_bias` (E, 2I), `down_proj` (E, I, H), `down_proj_bias` (E, H))."""

    def __init__(self, index: TensorIndex, config: ModelConfig, spec: ArchSpec):
        super().__init__(index, config, spec)
        self.stacked = spec.expert_layout in ("stacked", "stacked_rows")
        self.rows = spec.expert_layout == "stacked_rows"   # (E, 2I, H) / (E, H, I): no transposes, no biases
        self.dtype = self._check_and_dtype()

    def _expected(self, layer: int, expert: int) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every checkpoint tensor holding part of one expert (stacked: whole stacks)."""
        I, H, E = self.shape.intermediate, self.shape.hidden, self.num_experts
        if not self.stacked:
            return list(zip(self.spec.expert_tensor_names(layer, expert), ((I, H), (I, H), (H, I))))
        names = self.spec.stacked_expert_names(layer)
        base = names["gate_up"]
        if f"{base}_blocks" in self.index or f"{base}_scales" in self.index:
            raise CheckpointError(f"{base} is stored MXFP4-quantized (blocks and scales) but config.json does not say "
                                  "so; add quantization_config with quant_method 'mxfp4' as the published gpt-oss "
                                  "config has it.")
        if self.rows:
            return [(names["gate_up"], (E, 2 * I, H)), (names["down"], (E, H, I))]
        return [(names["gate_up"], (E, H, 2 * I)), (names["gate_up_bias"], (E, 2 * I)),
                (names["down"], (E, I, H)), (names["down_bias"], (E, H))]

    def _check_and_dtype(self) -> torch.dtype:
        """Validate every expert tensor's presence and shape up front: fail before loading, not midway."""
        dtypes = set()
        for layer in self.moe_layers:
            for e in range(1 if self.stacked else self.num_experts):   # a stack holds every expert
                for name, shape in self._expected(layer, e):
                    info = self.index.info(name)
                    if info.shape != shape:
                        raise CheckpointError(
                            f"tensor {name!r} has shape {list(info.shape)} but config.json implies {list(shape)}; "
                            "the config does not match the weights."
                        )
                    check_floating(info)
                    dtypes.add(info.dtype)
        if len(dtypes) > 1:
            raise CheckpointError(f"expert tensors mix dtypes {sorted(map(str, dtypes))}; re-convert the checkpoint to one dtype.")
        return dtypes.pop() if dtypes else torch.float32

    def _read_row(self, name: str, expert: int, shape: tuple[int, ...]) -> Tensor:
        """Row `expert` of a stacked tensor: one byte range."""
        row = torch.empty(shape, dtype=self.dtype)
        return self.index.read_into(self.index.info(name), row, start=expert * row.numel() * row.element_size())

    def read_raw(self, layer: int, expert: int) -> tuple[Tensor, Tensor, Tensor]:
        """gate (I, H), up (I, H), down (H, I) of one expert, in the checkpoint's dtype."""
        I, H = self.shape.intermediate, self.shape.hidden
        if self.rows:   # W @ x layout, gate rows first: a row of each stack is the expert as it is
            names = self.spec.stacked_expert_names(layer)
            gate_up = self._read_row(names["gate_up"], expert, (2 * I, H))
            return gate_up[:I], gate_up[I:], self._read_row(names["down"], expert, (H, I))
        if self.stacked:   # x @ W layout: gate_up (H, 2I), gate columns even, up columns odd; down (I, H)
            names = self.spec.stacked_expert_names(layer)
            gate_up = self._read_row(names["gate_up"], expert, (H, 2 * I))
            down = self._read_row(names["down"], expert, (I, H))
            return gate_up[:, 0::2].t(), gate_up[:, 1::2].t(), down.t()
        out = (torch.empty((I, H), dtype=self.dtype), torch.empty((I, H), dtype=self.dtype),
               torch.empty((H, I), dtype=self.dtype))
        for name, t in zip(self.spec.expert_tensor_names(layer, expert), out):
            self.index.read_into(self.index.info(name), t)
        return out

    def read_raw_biases(self, layer: int, expert: int) -> tuple[Tensor, Tensor, Tensor] | None:
        """gate (I,), up (I,) and down (H,) biases of one expert (stacked layout), else None."""
        if not self.stacked or self.rows:
            return None
        names = self.spec.stacked_expert_names(layer)
        gate_up = self._read_row(names["gate_up_bias"], expert, (2 * self.shape.intermediate,))
        return gate_up[0::2], gate_up[1::2], self._read_row(names["down_bias"], expert, (self.shape.hidden,))

    def read_into(self, layer: int, expert: int, fmt: ExpertFormat, out: Mapping[str, Tensor]) -> None:
        views = None if self.stacked else fmt.raw_views(out, self.dtype)
        if views is None:
            fmt.encode(*self.read_raw(layer, expert), out, biases=self.read_raw_biases(layer, expert))
            return
        for name, view in zip(self.spec.expert_tensor_names(layer, expert), views):
            self.index.read_into(self.index.info(name), view)


class Fp8ExpertStore(ExpertStore):
    """FP8 e4m3 experts of an FP8 checkpoint, per-expert tensors: each projection's `.weight` (N, K)
    float8_e4m3fn and its scale grid (`spec.scale_name`, float32 or bf16, `spec.scale_shape(N, K)`;
    a channel grid may be saved as (N,) and a tensor scale as () or (1,)). Every tensor's presence,
    dtype and shape is checked before any load; `read_into` copies the bytes and the scales into the
    FP8 format's slots (gate and up as the two halves of gate_up, scales likewise), or, for any other
    format, encodes the dequantized weights (`read_raw`: FP8 experts requantized to int4, say)."""

    def __init__(self, index: TensorIndex, config: ModelConfig, spec: ArchSpec, fp8: Fp8Spec):
        super().__init__(index, config, spec)
        if spec.expert_layout != "per_expert":
            raise CheckpointError(f"{spec.name}'s experts are stacked, and moestream reads FP8 experts stored one "
                                  "by one only; use a bf16 export of the model.")
        self.fp8 = fp8
        self.dtype = torch.float8_e4m3fn
        I, H = self.shape.intermediate, self.shape.hidden
        self.projections = ((I, H), (I, H), (H, I))
        for layer in self.moe_layers:
            for e in range(self.num_experts):
                for name, (n, k) in zip(self.spec.expert_tensor_names(layer, e), self.projections):
                    check_fp8_weight(index, name, (n, k), fp8)

    def read_raw(self, layer: int, expert: int) -> tuple[Tensor, Tensor, Tensor]:
        """gate (I, H), up (I, H), down (H, I) of one expert, dequantized to fp32 (`dequantize_fp8`)."""
        out = []
        for name in self.spec.expert_tensor_names(layer, expert):
            weight = self.index.read(name)
            scale = self.index.read(name.removesuffix("weight") + self.fp8.scale_name)
            out.append(dequantize_fp8(weight, scale, self.fp8))
        return out[0], out[1], out[2]

    def read_into(self, layer: int, expert: int, fmt: ExpertFormat, out: Mapping[str, Tensor]) -> None:
        if getattr(fmt, "spec", None) != self.fp8:   # another format: through its encode
            fmt.encode(*self.read_raw(layer, expert), out)
            return
        I = self.shape.intermediate
        gate_rows = self.fp8.scale_shape(I, self.shape.hidden)[0]
        gate_up, gate_up_scales = out["gate_up.qweight"], out["gate_up.scales"]
        dests = ((gate_up[:I], gate_up_scales[:gate_rows]), (gate_up[I:], gate_up_scales[gate_rows:]),
                 (out["down.qweight"], out["down.scales"]))
        for name, (weight, scale) in zip(self.spec.expert_tensor_names(layer, expert), dests):
            self.index.read_into(self.index.info(name), weight)
            info = self.index.info(name.removesuffix("weight") + self.fp8.scale_name)
            if info.dtype == torch.float32:
                self.index.read_into(info, scale)
            else:
                scale.copy_(self.index.read_into(info, torch.empty(scale.shape, dtype=info.dtype)))


def check_fp8_weight(index: TensorIndex, name: str, shape: tuple[int, int], fp8: Fp8Spec) -> None:
    """An FP8 weight `name` (`<module>.weight`) of `shape` with its scale grid: present, of the right
    dtypes and shapes, and no static activation scale beside it; else one sentence saying which."""
    info = index.info(name)
    if info.shape != shape:
        raise CheckpointError(f"tensor {name!r} has shape {list(info.shape)} but config.json implies "
                              f"{list(shape)}; the config does not match the weights.")
    if info.dtype != torch.float8_e4m3fn:
        stored = str(info.dtype).removeprefix("torch.")
        raise CheckpointError(f"tensor {name!r} is stored as {stored} where config.json's FP8 quantization_config "
                              "implies float8_e4m3fn; the checkpoint mixes formats, use a consistent export.")
    module = name.removesuffix(".weight")
    scale_name = f"{module}.{fp8.scale_name}"
    if scale_name not in index:
        raise CheckpointError(f"tensor {name!r} is FP8 but its scale {scale_name!r} is missing from the "
                              f"checkpoint in {index.folder}; the download is incomplete, re-download it.")
    scale = index.info(scale_name)
    want = fp8.scale_shape(*shape)
    squeezed = tuple(d for d in scale.shape if d != 1)
    if squeezed != tuple(d for d in want if d != 1) or scale.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise CheckpointError(f"the scale {scale_name!r} is {str(scale.dtype).removeprefix('torch.')} "
                              f"{list(scale.shape)} but a {list(shape)} weight in {fp8.name} needs float32 "
                              f"{list(want)}; the checkpoint is damaged or its quantization_config is wrong.")
    if f"{module}.input_scale" in index:
        raise CheckpointError(f"{module} has a static activation scale ({module}.input_scale), which moestream "
                              "does not apply; use a checkpoint with dynamic activation scaling or a bf16 export.")


class MLXExpertStore(ExpertStore):
    """MLX's stacked `switch_mlp` tensors: expert e is row e of each (E, N, ·) tensor."""

    PARTS = ("weight", "scales", "biases")

    def __init__(self, index: TensorIndex, config: ModelConfig, spec: ArchSpec, quantization: dict):
        super().__init__(index, config, spec)
        self.native = {}
        I, H, E = self.shape.intermediate, self.shape.hidden, self.num_experts
        for layer in self.moe_layers:
            specs = set()
            for proj, (n, k) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                scales = self.index.info(f"{self._base(layer)}.{proj}.scales")
                qspec = mlx_spec(quantization, f"{self._base(layer)}.{proj}", scales.dtype)
                if qspec is None:
                    raise CheckpointError(f"{self._base(layer)}.{proj} is not quantized in this MLX checkpoint; "
                                          "moestream reads MLX experts that are quantized.")
                want = {"weight": (E, n, k * qspec.bits // 32), "scales": (E, n, k // qspec.group),
                        "biases": (E, n, k // qspec.group)}
                for part, shape in want.items():
                    info = self.index.info(f"{self._base(layer)}.{proj}.{part}")
                    if info.shape != shape:
                        raise CheckpointError(f"tensor {info.name!r} has shape {list(info.shape)} but config.json "
                                              f"implies {list(shape)}; the config does not match the weights.")
                specs.add(qspec)
            if len(specs) != 1:
                raise CheckpointError(f"layer {layer}'s expert projections are quantized differently; moestream "
                                      "needs one format per layer's experts.")
            self.native[layer] = specs.pop()

    def _base(self, layer: int) -> str:
        return f"model.layers.{layer}.{self.spec.moe_prefix}.switch_mlp"

    def read_into(self, layer: int, expert: int, fmt: ExpertFormat, out: Mapping[str, Tensor]) -> None:
        self._check_native(layer, fmt)
        I = self.shape.intermediate
        for ours, mlx in (("qweight", "weight"), ("scales", "scales"), ("biases", "biases")):
            gate_up = out[f"gate_up.{ours}"]
            for proj, dest in (("gate_proj", gate_up[:I]), ("up_proj", gate_up[I:]), ("down_proj", out[f"down.{ours}"])):
                info = self.index.info(f"{self._base(layer)}.{proj}.{mlx}")
                self.index.read_into(info, dest, start=expert * dest.numel() * dest.element_size())


class PackedExpertStore(ExpertStore):
    """Records of a packed checkpoint: one preadv per expert, CRC-checked on first read."""

    def __init__(self, index: TensorIndex, config: ModelConfig, spec: ArchSpec, layout: PackedLayout):
        super().__init__(index, config, spec)
        self.layout = layout
        self.native = {layer: layout.layers[layer].spec for layer in self.moe_layers}
        self.files = OpenFiles()
        self._verified: set[tuple[int, int]] = set()

    def read_into(self, layer: int, expert: int, fmt: ExpertFormat, out: Mapping[str, Tensor]) -> None:
        self._check_native(layer, fmt)
        record = self.layout.layers[layer]
        path = self.layout.folder / record.file
        offset = expert * record.stride
        fd = self.files.fd(path, "re-run `moestream convert`")
        verify = (layer, expert) not in self._verified
        crc = 0
        for entry in record.tensors:
            dest = out[entry.name].view(-1).view(torch.uint8)
            read_exactly(fd, dest, offset + entry.offset, path, f"expert {expert} of layer {layer}")
            if verify:
                crc = zlib.crc32(memoryview(dest.numpy()), crc)
        if verify:
            if crc != record.checksums[expert]:
                raise CheckpointError(f"expert {expert} of layer {layer} in {path.name} fails its checksum (the file "
                                      "is damaged); re-run `moestream convert`.")
            self._verified.add((layer, expert))
