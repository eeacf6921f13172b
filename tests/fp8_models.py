"""Tiny FP8 e4m3 checkpoints, written from an HF checkpoint the way FP8 exports store them: every
linear of the decoder layers (attention, experts, shared and dense MLPs) as float8_e4m3fn `.weight`
plus its scale grid, routers, norms, embeddings and the LM head left at full precision, and the
quantization_config of the method (`fp8` as DeepSeek/Qwen ship it, or compressed-tensors
`float-quantized`). Beside it, the same model in HF layout holding the dequantized weights, which
transformers runs as the oracle; those weights are dequantized by transformers' own FP8 code
where it has one for the layout, by the definition otherwise."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from moestream.quant.fp8 import Fp8Spec, quantize_fp8


def _reference_dequantize(q: torch.Tensor, scale: torch.Tensor, spec: Fp8Spec) -> torch.Tensor:
    if spec.block_n is not None and spec.block_k is not None:
        try:   # transformers' own block dequantization (5.2x); older releases lack it: the definition then
            from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
        except ImportError:
            n, k = q.shape
            grid = scale.to(torch.float32).repeat_interleave(spec.block_n, 0)[:n].repeat_interleave(spec.block_k, 1)[:, :k]
            return q.to(torch.float32) * grid
        return _dequantize_fp8_weight(q, scale, [spec.block_n, spec.block_k], torch.float32)
    return q.to(torch.float32) * scale.to(torch.float32)   # (N, 1) per channel, (1, 1) per tensor: broadcast


def quantization_config(spec: Fp8Spec) -> dict:
    """The config.json entry of `spec` (its scale name says which method)."""
    if spec.scale_name == "weight_scale_inv":
        out = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
        if spec.block_n is not None:
            out["weight_block_size"] = [spec.block_n, spec.block_k]
        return out
    strategy = {"fp8-channel": "channel", "fp8-tensor": "tensor"}.get(spec.name, "block")
    weights = {"type": "float", "num_bits": 8, "strategy": strategy, "symmetric": True, "dynamic": False,
               "block_structure": [spec.block_n, spec.block_k] if strategy == "block" else None}
    acts = {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True, "symmetric": True}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}}}


def make_fp8_checkpoint(hf_folder: Path, out: Path, reference: Path, spec: Fp8Spec, moe_prefix: str = "mlp",
                        scale_dtype: torch.dtype = torch.float32) -> None:
    from safetensors.torch import load_file, save_file

    source = load_file(str(hf_folder / "model.safetensors"))
    fp8, deq = {}, {}
    for name, w in source.items():
        path, _, part = name.rpartition(".")
        router = path.endswith(f"{moe_prefix}.gate") or path.endswith("shared_expert_gate")
        if (part != "weight" or w.dim() != 2 or "norm" in path or not name.startswith("model.layers.") or router):
            fp8[name] = deq[name] = w
            continue
        q, scale = quantize_fp8(w.float(), spec)
        if spec.name == "fp8-channel":
            scale = scale.reshape(-1, 1)
        elif spec.name == "fp8-tensor":
            scale = scale.reshape(1)
        fp8[name], fp8[f"{path}.{spec.scale_name}"] = q, scale.to(scale_dtype)
        deq[name] = _reference_dequantize(q, scale.to(scale_dtype).reshape(spec.scale_shape(*w.shape)), spec)
    config = json.loads((hf_folder / "config.json").read_text())
    for folder, tensors, extra in ((out, fp8, {"quantization_config": quantization_config(spec)}), (reference, deq, {})):
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps({**config, **extra}))
