"""Expert formats: how one routed expert is stored, in the bank's slots, the host tier and snapshots.

A format names the tensors of one expert (name, shape, dtype), so every place that holds experts
(store reads, host tier, bank slots, prepacked snapshots, the memory plan) allocates and counts
them from the format instead of assuming a `(gate_up, down)` pair of one dtype. It also says how
to turn one expert's projection weights as read from a checkpoint into its tensors (`encode`), and
which dispatch runs over a layer's slots (`dispatch`: the fused kernel on CUDA, its plain-torch
reference elsewhere).

The dense formats (bf16 / fp16 / fp32): `gate_up (2I, H)` with the gate rows first and
`down (H, I)`, as transformers v5 and vLLM stack them, and for experts with biases (GPT-OSS,
`ExpertShape.bias`) `gate_up_bias (2I,)` and `down_bias (H,)` beside them. The quantized formats
(affine int8/4/3/2, normal-float nf4/nf3, any group size of `moestream.quant`): each projection as
`<proj>.qweight` (packed uint8), `<proj>.scales` and, for affine specs, `<proj>.biases` (the
quantization's offsets, not a layer bias); they hold plain SwiGLU experts without biases only.
The FP8 format (`Fp8Format`, e4m3 as FP8 checkpoints ship it: `moestream.quant.fp8`) keeps the same
names: `<proj>.qweight` (N, K) uint8 holding the float8_e4m3fn bits and `<proj>.scales` float32 per
block of the checkpoint's grid, gate_up's being the gate's grid then the up's.
gpt-oss's MXFP4 experts (biases, clamped SwiGLU) have their own format: mxfp4_format.py.

The expert's activation (`ExpertShape.activation`: SwiGLU, or GPT-OSS's clamped SwiGLU with its
parameters) travels with the shape into `dispatch`.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from moestream.archs.spec import ModelConfig
from moestream.errors import InputError
from moestream.kernels.moe_reference import Activation
from moestream.quant import QuantSpec, quantize
from moestream.quant.fp8 import Fp8Spec, quantize_fp8
from moestream.quant.mxfp4 import Mxfp4Spec
from moestream.sizes import dtype_size

# (hidden (T, H), slot tensors of one layer by name, slot ids (T, k), routing weights (T, k)) -> (T, H);
# with `reduce=False`, the (T, k, H) fp32 row of every pair instead (zero where unrouted), which
# the format's `pair_sum` turns into the (T, H) a single call would have given, bit for bit. With
# `slot_map` (a layer's (E + 1,) expert → slot table), the ids are expert ids looked up in it (by
# the kernels themselves where they can: one launch fewer on the hot path).
Dispatch = Callable[..., Tensor]

# (hidden (T, H) on the CPU, a layer's stacked host-tier tensors, expert ids (T, k) with -1 for
# pairs served elsewhere, routing weights (T, k)) -> the (T, H) fp32 sum of those pairs.
HostDispatch = Callable[[Tensor, Mapping[str, Tensor], Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class ExpertShape:
    """What every format is laid out from: the model's hidden size and an expert's width, whether
    its projections carry biases, and its activation (which the dispatch applies)."""

    hidden: int
    intermediate: int
    bias: bool = False
    activation: Activation = Activation()

    @property
    def plain(self) -> bool:
        """SwiGLU without biases: the only experts the quantized formats (and their kernels) hold."""
        return not self.bias and self.activation.name == "swiglu"

    @classmethod
    def of(cls, config: ModelConfig) -> ExpertShape:
        """The routed experts of a model: sizes, biases and activation, as config.json gives them."""
        activation = Activation(config.expert_activation)
        if config.expert_activation == "swiglu_clamped":
            activation = Activation("swiglu_clamped", config.swiglu_alpha, config.swiglu_limit)
        return cls(config.hidden_size, config.moe_intermediate, config.expert_bias, activation)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = dtype_size(self.dtype)
        for d in self.shape:
            n *= d
        return n


class ExpertFormat(ABC):
    """One way of storing an expert. Subclasses are small and stateless (one instance per name)."""

    name: str
    dtype: torch.dtype   # what the expert computes in (its weights' dtype, or what they dequantize to)

    @abstractmethod
    def tensors(self, shape: ExpertShape) -> tuple[TensorSpec, ...]:
        """The tensors of one expert, in a fixed order (slots stack each with a leading slot axis)."""

    def nbytes(self, shape: ExpertShape) -> int:
        """Bytes of one expert: everything a slot holds (weights, scales, biases)."""
        return sum(t.nbytes for t in self.tensors(shape))

    def empty(self, shape: ExpertShape, count: int | None = None, device: torch.device | str = "cpu",
              pin: bool = False) -> dict[str, Tensor]:
        """Uninitialised tensors for one expert (count None) or `count` stacked experts."""
        lead = () if count is None else (count,)
        return {t.name: torch.empty((*lead, *t.shape), dtype=t.dtype, device=device, pin_memory=pin)
                for t in self.tensors(shape)}

    @abstractmethod
    def raw_views(self, expert: Mapping[str, Tensor], source_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor] | None:
        """Views of one expert's tensors where the checkpoint's gate, up and down weights can be read
        in place (same bytes, no conversion), or None when they must go through `encode`."""

    @abstractmethod
    def encode(self, gate: Tensor, up: Tensor, down: Tensor, out: Mapping[str, Tensor],
               biases: tuple[Tensor, Tensor, Tensor] | None = None) -> None:
        """Write one expert, given as its gate (I, H), up (I, H) and down (H, I) weights (and, for
        experts with biases, the gate (I,), up (I,) and down (H,) biases), into `out`."""

    @abstractmethod
    def dispatch(self, device: torch.device, shape: ExpertShape | None = None,
                 layer_experts: int | None = None) -> Dispatch:
        """The MoE dispatch over this format's slots on `device` (fused kernel or reference), for
        experts of `shape` (its biases and activation; None: plain SwiGLU). `layer_experts`: the
        slots hold some of a layer of that many experts (a bank): the kernels size their tiles for
        the layer's rows per expert, as a call over the whole layer would."""

    def uses_kernels(self, device: torch.device, shape: ExpertShape | None = None) -> bool:
        """Whether `dispatch` on `device` is the Triton kernels (else the plain-torch reference)."""
        return False

    def host_dispatch(self, shape: ExpertShape) -> HostDispatch:
        """How hybrid misses compute experts where they sit in host RAM: the plain-torch reference
        over the host tier's stacked tensors, its pair rows summed in fp32."""
        run = self.dispatch(torch.device("cpu"), shape)

        def host(hidden: Tensor, stack: Mapping[str, Tensor], expert_ids: Tensor, weights: Tensor) -> Tensor:
            return run(hidden, stack, expert_ids, weights, reduce=False).sum(dim=1)
        return host

    def dispatch_syncs(self, device: torch.device, shape: ExpertShape | None = None) -> bool:
        """Whether `dispatch` reads from the device (the plain-torch reference on CUDA groups its
        pairs on the host): such a dispatch cannot run inside a CUDA graph capture."""
        return device.type == "cuda" and not self.uses_kernels(device, shape)

    def pair_sum(self, device: torch.device, shape: ExpertShape | None = None) -> Callable[[Tensor, torch.dtype], Tensor]:
        """How `dispatch` ends, for pair rows gathered over several `reduce=False` calls (a bank
        computing resident and streamed experts apart): the same sum, so the same bits as one call."""
        from moestream import kernels

        return functools.partial(kernels.sum_pairs, fused=self.uses_kernels(device, shape))

    def describe(self, shape: ExpertShape) -> dict:
        """JSON-ready layout (snapshots compare it to know a saved bank fits)."""
        return {"format": self.name,
                "tensors": {t.name: [list(t.shape), str(t.dtype).removeprefix("torch.")] for t in self.tensors(shape)}}


def encode_biases(out: Mapping[str, Tensor], biases: tuple[Tensor, Tensor, Tensor] | None) -> None:
    """Write an expert's (gate, up, down) biases into its `gate_up_bias` (gate rows first) and
    `down_bias` tensors; nothing for experts without biases."""
    if biases is None:
        return
    gate_bias, up_bias, down_bias = biases
    I = gate_bias.shape[0]
    out["gate_up_bias"][:I].copy_(gate_bias)
    out["gate_up_bias"][I:].copy_(up_bias)
    out["down_bias"].copy_(down_bias)


class DenseFormat(ExpertFormat):
    """Unquantized experts: `gate_up (2I, H)` (gate rows first) and `down (H, I)` in one float dtype,
    plus `gate_up_bias (2I,)` and `down_bias (H,)` when the experts have biases."""

    def __init__(self, name: str, dtype: torch.dtype):
        self.name, self.dtype = name, dtype

    def tensors(self, shape: ExpertShape) -> tuple[TensorSpec, ...]:
        H, I = shape.hidden, shape.intermediate
        weights = (TensorSpec("gate_up", (2 * I, H), self.dtype), TensorSpec("down", (H, I), self.dtype))
        if not shape.bias:
            return weights
        return weights + (TensorSpec("gate_up_bias", (2 * I,), self.dtype), TensorSpec("down_bias", (H,), self.dtype))

    def raw_views(self, expert, source_dtype):
        if source_dtype != self.dtype:
            return None
        gate_up = expert["gate_up"]
        I = gate_up.shape[0] // 2
        return gate_up[:I], gate_up[I:], expert["down"]

    def encode(self, gate, up, down, out, biases=None):
        I = gate.shape[0]
        out["gate_up"][:I].copy_(gate)
        out["gate_up"][I:].copy_(up)
        out["down"].copy_(down)
        encode_biases(out, biases)

    def uses_kernels(self, device: torch.device, shape: ExpertShape | None = None) -> bool:
        """The Triton kernels on CUDA (biases, GPT-OSS's clamped SwiGLU and Gemma 4's GeGLU included)
        for activations they implement; elsewhere, without Triton, or for an activation without a
        kernel, the plain-torch reference, which groups pairs on the host (`dispatch_syncs`)."""
        from moestream import kernels
        from moestream.kernels.moe_reference import FUSED_ACTIVATIONS

        if shape is not None and shape.activation.name not in FUSED_ACTIVATIONS:
            return False
        return device.type == "cuda" and kernels.fused_moe_available()

    def dispatch(self, device: torch.device, shape: ExpertShape | None = None,
                 layer_experts: int | None = None) -> Dispatch:
        from moestream import kernels

        activation = shape.activation if shape is not None else Activation()
        fused = self.uses_kernels(device, shape)
        run = (functools.partial(kernels.fused_moe, layer_experts=layer_experts) if fused
               else kernels.moe_reference)

        def dispatch(hidden: Tensor, slots: Mapping[str, Tensor], slot_ids: Tensor, weights: Tensor,
                     reduce: bool = True, slot_map: Tensor | None = None, host=None) -> Tensor:
            return run(hidden, slots["gate_up"], slots["down"], slot_ids, weights, activation,
                       slots.get("gate_up_bias"), slots.get("down_bias"), reduce=reduce, slot_map=slot_map, host=host)
        return dispatch

    def host_dispatch(self, shape: ExpertShape) -> HostDispatch:
        """The C kernel (`kernels/cpu_moe.py`: each weight row read once, at memory bandwidth) where
        it builds and handles the dtype and activation; the plain-torch reference otherwise."""
        from moestream.kernels import cpu_moe

        if not cpu_moe.supports(self.dtype, shape.activation) or cpu_moe.load() is None:
            return super().host_dispatch(shape)
        return functools.partial(_cpu_kernel, activation=shape.activation)

    def __repr__(self) -> str:
        return f"DenseFormat({self.name})"


def _cpu_kernel(hidden: Tensor, stack: Mapping[str, Tensor], expert_ids: Tensor, weights: Tensor,
                activation: Activation) -> Tensor:
    from moestream.kernels import cpu_moe

    return cpu_moe.cpu_moe(hidden, stack, expert_ids, weights, activation, out_dtype=torch.float32)


def _cpu_quant_kernel(hidden: Tensor, stack: Mapping[str, Tensor], expert_ids: Tensor, weights: Tensor,
                      spec: QuantSpec) -> Tensor:
    from moestream.kernels import cpu_moe

    return cpu_moe.cpu_moe_quant(hidden, stack, expert_ids, weights, spec, out_dtype=torch.float32)


class QuantizedFormat(ExpertFormat):
    """Group-quantized experts: both projections packed per `spec`, computed in `dtype`.

    The slot tensors are what a packed checkpoint stores and what the dequantizing kernels read;
    `encode` quantizes full-precision weights into them (quantize-on-load and `moestream convert`).
    """

    PROJECTIONS = ("gate_up", "down")

    def __init__(self, spec: QuantSpec, dtype: torch.dtype):
        self.spec, self.dtype, self.name = spec, dtype, spec.name

    def projection_shapes(self, shape: ExpertShape) -> dict[str, tuple[int, int]]:
        return {"gate_up": (2 * shape.intermediate, shape.hidden), "down": (shape.hidden, shape.intermediate)}

    def tensors(self, shape: ExpertShape) -> tuple[TensorSpec, ...]:
        if not shape.plain:
            raise InputError(f"experts with biases or a {shape.activation.name} activation (GPT-OSS, Gemma 4) cannot be kept "
                             f"quantized ({self.name}) yet; load them unquantized (--experts bf16).")
        out = []
        for proj, (n, k) in self.projection_shapes(shape).items():
            self.spec.check_width(k, f"the {proj} input dimension")
            groups = self.spec.groups(k)
            out.append(TensorSpec(f"{proj}.qweight", (n, self.spec.packed_width(k)), torch.uint8))
            out.append(TensorSpec(f"{proj}.scales", (n, groups), self.spec.scale_dtype))
            if self.spec.has_bias:
                out.append(TensorSpec(f"{proj}.biases", (n, groups), self.spec.scale_dtype))
        return tuple(out)

    def raw_views(self, expert, source_dtype):
        return None   # checkpoint weights are full precision: always through encode

    def encode(self, gate, up, down, out, biases=None):
        if biases is not None:
            raise InputError(f"experts with biases cannot be quantized ({self.name}) yet; load them unquantized.")
        for proj, weight in (("gate_up", torch.cat([gate, up])), ("down", down)):
            for part, t in quantize(weight, self.spec).parts().items():
                out[f"{proj}.{part}"].copy_(t)

    def dispatch(self, device: torch.device, shape: ExpertShape | None = None,
                 layer_experts: int | None = None) -> Dispatch:
        from moestream import kernels

        spec = self.spec
        if self.uses_kernels(device, shape):   # the kernels read the slot map themselves (one token)
            return functools.partial(kernels.fused_moe_quant, spec=spec, layer_experts=layer_experts)
        from moestream.kernels import cpu_moe

        cpu_kernel = device.type == "cpu" and cpu_moe.reads(spec)
        if cpu_kernel:
            from moestream.kernels.moe_reference import sum_pairs_reference

        def dispatch(hidden: Tensor, slots: Mapping[str, Tensor], slot_ids: Tensor, weights: Tensor,
                     reduce: bool = True, slot_map: Tensor | None = None, host=None) -> Tensor:
            if slot_map is not None:
                slot_ids = slot_map[slot_ids]
            if cpu_kernel and host is None and hidden.dtype in (torch.bfloat16, torch.float32):
                # the C kernel reads the packed slots in place, where the reference dequantizes every
                # routed slot in every call; its pair rows, summed as the reference sums them, give
                # one call's bits however many calls computed them (a bounded bank equals residency)
                pairs = cpu_moe.cpu_moe_quant_pairs(hidden, slots, slot_ids, weights, spec)
                return sum_pairs_reference(pairs, hidden.dtype) if reduce else pairs
            return kernels.quant_moe_reference(hidden, slots, slot_ids, weights, spec, reduce=reduce, host=host)
        return dispatch

    def uses_kernels(self, device: torch.device, shape: ExpertShape | None = None) -> bool:
        from moestream import kernels

        return device.type == "cuda" and kernels.fused_moe_quant_available()

    def host_dispatch(self, shape: ExpertShape) -> HostDispatch:
        """The C kernel, unpacking the values in registers (a 4-bit expert is a quarter of the bytes a
        bf16 one reads, an FP8 one half), for the specs it reads; the plain-torch reference for the others."""
        from moestream.kernels import cpu_moe

        if not cpu_moe.supports_quant(self.spec) or cpu_moe.load() is None:
            return super().host_dispatch(shape)
        return functools.partial(_cpu_quant_kernel, spec=self.spec)

    def describe(self, shape: ExpertShape) -> dict:
        return {**super().describe(shape), "bits": self.spec.bits, "group": self.spec.group, "kind": self.spec.kind}

    def __repr__(self) -> str:
        return f"QuantizedFormat({self.name})"


class Fp8Format(QuantizedFormat):
    """FP8 e4m3 experts, kept in the bytes an FP8 checkpoint stores (a byte a weight plus one float32
    per scale block): `<proj>.qweight` (N, K) uint8, the float8_e4m3fn bits (uint8, so every copy,
    pin and index of the bank handles them as plain bytes), and `<proj>.scales` float32, the grid of
    `spec.scale_shape`. gate_up's scales are the gate's grid stacked on the up's (2·⌈I/bn⌉ rows), so a
    block never straddles the two when bn does not divide I, and the checkpoint's scales are copied
    as they are. The dispatch is `QuantizedFormat`'s: the dequantizing Triton kernels on CUDA (their
    FP8 tiles: `kernels/moe_tiles.py`), `quant_moe_reference` elsewhere; hybrid misses (`host_dispatch`,
    the CPU worker) read the bytes and grids in host RAM with the C kernel (`kernels/cpu_moe.py`)."""

    def __init__(self, spec: Fp8Spec, dtype: torch.dtype):
        self.spec, self.dtype, self.name = spec, dtype, spec.name

    def tensors(self, shape: ExpertShape) -> tuple[TensorSpec, ...]:
        if not shape.plain:
            raise InputError(f"experts with biases or a {shape.activation.name} activation cannot be kept in "
                             f"{self.name} yet; use a bf16 export of the model.")
        H, I = shape.hidden, shape.intermediate
        gate_rows, gate_cols = self.spec.scale_shape(I, H)
        return (TensorSpec("gate_up.qweight", (2 * I, H), torch.uint8),
                TensorSpec("gate_up.scales", (2 * gate_rows, gate_cols), torch.float32),
                TensorSpec("down.qweight", (H, I), torch.uint8),
                TensorSpec("down.scales", self.spec.scale_shape(H, I), torch.float32))

    def encode(self, gate, up, down, out, biases=None):
        """Quantize full-precision weights to FP8, each projection on its own grid (tests, scripts)."""
        if biases is not None:
            raise InputError(f"experts with biases cannot be kept in {self.name} yet; use a bf16 export of the model.")
        rows = self.spec.scale_shape(gate.shape[0], gate.shape[1])[0]
        for proj, weight, first in (("gate_up", gate, 0), ("gate_up", up, 1), ("down", down, 0)):
            q, scale = quantize_fp8(weight, self.spec)
            n = weight.shape[0]
            out[f"{proj}.qweight"][first * n:(first + 1) * n].copy_(q.view(torch.uint8))
            out[f"{proj}.scales"][first * rows:first * rows + scale.shape[0]].copy_(scale)

    def describe(self, shape: ExpertShape) -> dict:
        return {**ExpertFormat.describe(self, shape), "kind": "fp8",
                "block": [self.spec.block_n, self.spec.block_k]}

    def __repr__(self) -> str:
        return f"Fp8Format({self.name})"


def stored_format(spec: QuantSpec | Fp8Spec | Mxfp4Spec, dtype: torch.dtype) -> ExpertFormat:
    """The format that holds experts stored pre-quantized in `spec` exactly (a store's `native` spec)."""
    if isinstance(spec, Mxfp4Spec):
        from moestream.experts.mxfp4_format import Mxfp4Format   # it builds on this module
        return Mxfp4Format(dtype)
    return Fp8Format(spec, dtype) if isinstance(spec, Fp8Spec) else QuantizedFormat(spec, dtype)


DENSE: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def dense_format(dtype: torch.dtype) -> ExpertFormat:
    """The unquantized format of a compute dtype (what the bank uses unless told otherwise)."""
    for name, dt in DENSE.items():
        if dt == dtype:
            return DenseFormat(name, dtype)
    raise InputError(f"experts cannot be kept as {dtype}; use one of {', '.join(DENSE)}.")
