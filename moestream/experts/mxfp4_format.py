"""The MXFP4 expert format: gpt-oss's experts kept in the bytes they ship in (4.25 bits a weight).

One expert is `gate_up.blocks (2I, H/2)` uint8 (two fp4 codes a byte, quant/mxfp4.py's layout) with
`gate_up.scales (2I, H/32)` uint8 (e8m0), gate rows first as every format has them; `down.blocks
(H, I/2)` and `down.scales (H, I/32)`; and the experts' biases `gate_up_bias (2I,)` and `down_bias
(H,)` in the compute dtype. The bank, the host tier and snapshots hold these bytes; the dispatch
dequantizes as it computes (kernels/mxfp4_moe.py), and hybrid misses (`host_dispatch`, the CPU
worker) read them where they sit in host RAM with the C kernel of kernels/cpu_moe.c.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
from torch import Tensor

from moestream.errors import CheckpointError, InputError
from moestream.experts.format import Dispatch, ExpertFormat, ExpertShape, HostDispatch, TensorSpec, encode_biases
from moestream.kernels.moe_reference import Activation
from moestream.quant.mxfp4 import GROUP, MXFP4, quantize_mxfp4


class Mxfp4Format(ExpertFormat):
    """Experts stored MXFP4, computed in `dtype`; `spec` is what the store compares (`native`)."""

    spec = MXFP4
    name = "mxfp4"

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def tensors(self, shape: ExpertShape) -> tuple[TensorSpec, ...]:
        H, I = shape.hidden, shape.intermediate
        for what, k in (("hidden_size", H), ("intermediate_size", I)):
            if k % GROUP:
                raise CheckpointError(f"config.json has {what} = {k}, which MXFP4's {GROUP}-value blocks cannot "
                                      "split; the config does not match the weights.")
        out = (TensorSpec("gate_up.blocks", (2 * I, H // 2), torch.uint8),
               TensorSpec("gate_up.scales", (2 * I, H // GROUP), torch.uint8),
               TensorSpec("down.blocks", (H, I // 2), torch.uint8),
               TensorSpec("down.scales", (H, I // GROUP), torch.uint8))
        if shape.bias:
            out += (TensorSpec("gate_up_bias", (2 * I,), self.dtype), TensorSpec("down_bias", (H,), self.dtype))
        return out

    def raw_views(self, expert, source_dtype):
        return None

    def encode(self, gate: Tensor, up: Tensor, down: Tensor, out: Mapping[str, Tensor],
               biases: tuple[Tensor, Tensor, Tensor] | None = None) -> None:
        """Quantize full-precision weights into MXFP4 (tests and the random-checkpoint writer; the
        published checkpoints are read as their bytes are)."""
        for proj, weight in (("gate_up", torch.cat([gate, up])), ("down", down)):
            blocks, scales = quantize_mxfp4(weight)
            out[f"{proj}.blocks"].copy_(blocks.reshape(weight.shape[0], -1))
            out[f"{proj}.scales"].copy_(scales)
        encode_biases(out, biases)

    def uses_kernels(self, device: torch.device, shape: ExpertShape | None = None) -> bool:
        """The Triton kernels on CUDA for the activations they implement; the reference elsewhere."""
        from moestream import kernels
        from moestream.kernels.moe_reference import FUSED_ACTIVATIONS

        if shape is not None and shape.activation.name not in FUSED_ACTIVATIONS:
            return False
        return device.type == "cuda" and kernels.fused_moe_available()

    def dispatch_syncs(self, device: torch.device, shape: ExpertShape | None = None) -> bool:
        """The kernels read nothing back (decode steps can be captured as CUDA graphs); the reference
        reads the routing to find the slots it dequantizes."""
        return device.type == "cuda" and not self.uses_kernels(device, shape)

    def dispatch(self, device: torch.device, shape: ExpertShape | None = None,
                 layer_experts: int | None = None) -> Dispatch:
        """(`layer_experts` unused: the MXFP4 grouped kernels size their blocks by the call's pairs.)"""
        from moestream.kernels import mxfp4_moe

        activation = shape.activation if shape is not None else Activation()
        fused = self.uses_kernels(device, shape)

        def dispatch(hidden: Tensor, slots: Mapping[str, Tensor], slot_ids: Tensor, weights: Tensor,
                     reduce: bool = True, slot_map: Tensor | None = None, host=None) -> Tensor:
            if host is not None:
                raise InputError("MXFP4 experts are not read in place from host RAM; use --miss-policy fetch.")
            if slot_map is not None:
                slot_ids = slot_map[slot_ids.long()]
            run = mxfp4_moe.fused_mxfp4_moe if fused else mxfp4_moe.mxfp4_moe_reference
            return run(hidden, slots, slot_ids, weights, activation, reduce=reduce)
        return dispatch

    def host_dispatch(self, shape: ExpertShape) -> HostDispatch:
        """The C kernel (`kernels/cpu_moe.py`: the e2m1 codes and e8m0 scales decoded in registers, the
        biases and the clamped SwiGLU applied) where it builds and takes the dtype; the reference otherwise."""
        from moestream.kernels import cpu_moe

        if not cpu_moe.supports(self.dtype, shape.activation) or cpu_moe.load() is None:
            return super().host_dispatch(shape)
        return functools.partial(_cpu_kernel, activation=shape.activation)

    def describe(self, shape: ExpertShape) -> dict:
        return {**super().describe(shape), "bits": 4, "group": GROUP, "kind": "mxfp4"}

    def __repr__(self) -> str:
        return "Mxfp4Format()"


def _cpu_kernel(hidden: Tensor, stack: Mapping[str, Tensor], expert_ids: Tensor, weights: Tensor,
                activation: Activation) -> Tensor:
    from moestream.kernels import cpu_moe

    return cpu_moe.cpu_moe_quant(hidden, stack, expert_ids, weights, MXFP4, out_dtype=torch.float32,
                                 activation=activation)
