"""FP8 (e4m3) weights as checkpoints ship them: the layouts, their config.json entries, and the
plain-torch dequantization every FP8 kernel is checked against.

A weight is `<module>.weight` (N, K) float8_e4m3fn and a float32 (or bf16) scale tensor; the weight
it stands for is w[n, k] = fp8[n, k] · scale[n // bn, k // bk] (fp32 math), over blocks of bn rows
by bk columns, the last block of a row or column shorter when bn or bk does not divide N or K:

  block     `quantization_config.quant_method = "fp8"` with `weight_block_size` [bn, bk]
            (DeepSeek-V3/R1, Kimi-K2, Qwen3-*-FP8): scale `<module>.weight_scale_inv` of shape
            (⌈N/bn⌉, ⌈K/bk⌉) — multiplied, despite its name; or compressed-tensors'
            `float-quantized` with strategy "block" and `block_structure` [bn, bk], scale `weight_scale`
  channel   compressed-tensors, strategy "channel": one scale per output row, `weight_scale` (N, 1)
  tensor    compressed-tensors strategy "tensor", or "fp8" without a block size: one scale, (1,) or ()

`Fp8Spec` names one of them: block_n / block_k None mean "the whole dimension" (a channel spec is
(1, None), a tensor spec (None, None)). Activations are never quantized here: moestream computes
in the model's dtype with the dequantized weights, so checkpoints with *dynamic* activation scales
(computed per token at run time) read exactly; *static* activation scales (`input_scale` tensors)
would change the numbers the model was calibrated for and are refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from moestream.errors import CheckpointError

FP8_MAX = 448.0   # largest finite float8_e4m3fn


@dataclass(frozen=True)
class Fp8Spec:
    """How one FP8 weight is scaled: blocks of block_n rows × block_k columns (None: the whole dimension).

    `kind`, `bits` and `has_bias` let code written for `QuantSpec` ask the same questions of it."""

    block_n: int | None
    block_k: int | None
    scale_name: str = "weight_scale_inv"   # the checkpoint's name of the scale tensor beside `.weight`

    kind = "fp8"
    bits = 8
    has_bias = False
    scale_dtype = torch.float32

    @property
    def name(self) -> str:
        if self.block_n is None and self.block_k is None:
            return "fp8-tensor"
        if self.block_n == 1 and self.block_k is None:
            return "fp8-channel"
        return f"fp8-b{self.block_n}x{self.block_k}"

    def block(self, n: int, k: int) -> tuple[int, int]:
        """(rows, columns) of one scale's block in an (n, k) weight."""
        return self.block_n or n, self.block_k or k

    def scale_shape(self, n: int, k: int) -> tuple[int, int]:
        """The scale grid of an (n, k) weight: one float32 per block."""
        bn, bk = self.block(n, k)
        return -(-n // bn), -(-k // bk)

    def nbytes(self, n: int, k: int) -> int:
        """Bytes of one (n, k) weight: a byte a value plus its float32 scales."""
        sn, sk = self.scale_shape(n, k)
        return n * k + 4 * sn * sk


def dequantize_fp8(weight: Tensor, scale: Tensor, spec: Fp8Spec, dtype: torch.dtype = torch.float32) -> Tensor:
    """The (..., N, K) weight that FP8 values (float8_e4m3fn, or their bytes as uint8) and their
    (..., ⌈N/bn⌉, ⌈K/bk⌉) scales stand for, in `dtype` (math in fp32)."""
    if weight.dtype == torch.uint8:
        weight = weight.view(torch.float8_e4m3fn)
    *lead, n, k = weight.shape
    bn, bk = spec.block(n, k)
    sn, sk = spec.scale_shape(n, k)
    s = scale.to(torch.float32).reshape(*lead, sn, sk)
    s = s.repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return (weight.to(torch.float32) * s).to(dtype)


def quantize_fp8(weight: Tensor, spec: Fp8Spec) -> tuple[Tensor, Tensor]:
    """(N, K) float weight → (float8_e4m3fn values, float32 scales): each block's absolute maximum
    maps to 448 (what DeepSeek's and llm-compressor's converters do). For checkpoints written by
    tests and scripts, and for FP8 experts made from full-precision ones."""
    n, k = weight.shape
    bn, bk = spec.block(n, k)
    sn, sk = spec.scale_shape(n, k)
    w = weight.float()
    padded = w.new_zeros(sn * bn, sk * bk)
    padded[:n, :k] = w
    blocks = padded.view(sn, bn, sk, bk)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12)
    scale = amax / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(sn * bn, sk * bk)[:n, :k].contiguous(), scale.contiguous()


def parse_fp8(name: str) -> Fp8Spec | None:
    """`fp8-b128x128`, `fp8-channel`, `fp8-tensor` (the names `Fp8Spec.name` gives) → the spec; None
    for any other name (benchmarks and tools that take a format name)."""
    text = str(name).strip().lower()
    if text == "fp8-channel":
        return Fp8Spec(1, None, "weight_scale")
    if text == "fp8-tensor":
        return Fp8Spec(None, None, "weight_scale")
    m = re.fullmatch(r"fp8-b(\d+)x(\d+)", text)
    return Fp8Spec(int(m.group(1)), int(m.group(2))) if m and int(m.group(1)) and int(m.group(2)) else None


# ---- config.json ----------------------------------------------------------------------------
def fp8_quantization(raw: dict[str, Any]) -> Fp8Spec | None:
    """The FP8 layout config.json's `quantization_config` declares, or None when it declares none
    (or another method, which is not this module's to judge). Refuses, in one sentence, what reads
    differently from the weights alone: static activation scales and e5m2 values."""
    q = raw.get("quantization_config")
    if not isinstance(q, dict):
        return None
    method = q.get("quant_method")
    if method == "fp8":
        return _fp8_method(q)
    if method == "compressed-tensors" and _compressed_format(q) == "float-quantized":
        return _compressed_tensors(q)
    return None


def _fp8_method(q: dict[str, Any]) -> Fp8Spec:
    """transformers' / DeepSeek's `quant_method: fp8`."""
    if str(q.get("fmt", "e4m3")).lower() != "e4m3":
        raise CheckpointError(f"config.json's quantization_config has fmt = {q.get('fmt')!r}; moestream reads "
                              "FP8 e4m3 weights only, so use an e4m3 or bf16 export of the model.")
    if str(q.get("activation_scheme", "dynamic")).lower() != "dynamic":
        raise CheckpointError("this FP8 checkpoint has static activation scales (activation_scheme = "
                              f"{q.get('activation_scheme')!r}), which moestream does not apply; use a checkpoint "
                              "with dynamic activation scaling or a bf16 export.")
    block = q.get("weight_block_size")
    if block is None:
        return Fp8Spec(None, None)
    return Fp8Spec(*_block(block, "weight_block_size"))


def _compressed_format(q: dict[str, Any]) -> str | None:
    formats = {g.get("format") for g in (q.get("config_groups") or {}).values() if isinstance(g, dict)} - {None}
    return q.get("format") or (formats.pop() if len(formats) == 1 else None)


def _compressed_tensors(q: dict[str, Any]) -> Fp8Spec:
    """llm-compressor's `float-quantized` compressed-tensors: one weight scheme for every group."""
    groups = [g for g in (q.get("config_groups") or {}).values() if isinstance(g, dict)]
    if not groups:
        raise CheckpointError("config.json's compressed-tensors quantization_config has no config_groups; the "
                              "config is incomplete, re-download it.")
    specs = set()
    for group in groups:
        weights = group.get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise CheckpointError(f"a compressed-tensors group quantizes weights as {weights.get('type')!r} with "
                                  f"{weights.get('num_bits')} bits; moestream reads its float-quantized form as FP8 "
                                  "e4m3 only, so use a bf16 export of the model.")
        acts = group.get("input_activations")
        if isinstance(acts, dict) and not acts.get("dynamic", False):
            raise CheckpointError("this FP8 checkpoint has static activation scales (input_activations.dynamic = "
                                  "false), which moestream does not apply; use a checkpoint with dynamic activation "
                                  "scaling (FP8-dynamic, FP8-block) or a bf16 export.")
        strategy = weights.get("strategy")
        if strategy == "channel":
            specs.add(Fp8Spec(1, None, "weight_scale"))
        elif strategy == "tensor":
            specs.add(Fp8Spec(None, None, "weight_scale"))
        elif strategy == "block":
            specs.add(Fp8Spec(*_block(weights.get("block_structure"), "block_structure"), "weight_scale"))
        else:
            raise CheckpointError(f"compressed-tensors weight strategy {strategy!r} is not one moestream reads for "
                                  "FP8 (it reads channel, tensor and block); use a bf16 export of the model.")
    if len(specs) != 1:
        raise CheckpointError("this compressed-tensors checkpoint quantizes weight groups differently; moestream "
                              "reads one FP8 scheme per checkpoint, so use a bf16 export of the model.")
    return specs.pop()


def _block(block: Any, key: str) -> tuple[int, int]:
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise CheckpointError(f"config.json's quantization_config has {key} = {block!r}; it must be two positive "
                              "integers [rows, columns], fix the config.")
    return int(block[0]), int(block[1])
