"""Tiny GPTQ / AWQ / compressed-tensors checkpoints, written from a tiny HF checkpoint: every linear
inside the decoder layers (attention, experts, shared experts, dense MLPs) quantized round-to-nearest
in the method's packing, routers and embeddings left at full precision, `quantization_config` in
config.json; and, beside it, the same model in plain HF layout holding the dequantized weights
(the oracle transformers runs)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from moestream.quant.gptq import IntWeight, dequantize_int, pack_awq, pack_compressed, pack_gptq, quantize_int


def act_order_weight(w: torch.Tensor, bits: int, group: int, sym: bool, seed: int) -> IntWeight:
    """GPTQ's act-order: the columns taken in a permuted order, group i = perm[i·g:(i+1)·g]."""
    perm = torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(seed))
    iw = quantize_int(w[:, perm], bits, group, sym)
    codes = torch.empty_like(iw.codes)
    codes[:, perm] = iw.codes
    g_idx = torch.empty(w.shape[1], dtype=torch.long)
    g_idx[perm] = torch.arange(w.shape[1]) // group
    return IntWeight(codes, iw.zeros, iw.scales, group, g_idx)


def quantization_config(method: str, bits: int, group: int, sym: bool, act_order: bool, v1: bool) -> dict:
    if method == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym, "desc_act": act_order,
                "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    if method == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
                "num_bits": bits, "type": "int", "symmetric": sym, "strategy": "channel" if group == -1 else "group",
                "group_size": None if group == -1 else group, "actorder": "group" if act_order else None}}},
            "ignore": ["lm_head"]}


def make_int_checkpoint(hf_folder: Path, out: Path, reference: Path, moe_prefix: str, method: str = "gptq",
                        bits: int = 4, group: int = 32, sym: bool = True, act_order: bool = False, v1: bool = True,
                        scale_dtype: torch.dtype = torch.float16, skip: tuple[str, ...] = ()) -> None:
    from safetensors.torch import load_file, save_file

    source = load_file(str(hf_folder / "model.safetensors"))
    stored, deq = {}, {}
    for i, (name, w) in enumerate(sorted(source.items())):
        path, _, part = name.rpartition(".")
        router = path.endswith(f"{moe_prefix}.gate") or path.endswith("shared_expert_gate")
        if (part != "weight" or w.dim() != 2 or not path.startswith("model.layers.") or router
                or w.shape[0] * bits % 32 or w.shape[1] * bits % 32   # too narrow to pack: quantizers skip them too
                or any(s in part or s in path for s in skip)):
            stored[name] = deq[name] = w
            continue
        if act_order:
            iw = act_order_weight(w.float(), bits, group, sym, seed=i)
        else:
            iw = quantize_int(w.float(), bits, w.shape[1] if group == -1 else group, sym, scale_dtype)
        if method == "gptq":
            if v1:   # v1 stores z - 1: keep every zero point at least 1
                iw.zeros.clamp_(min=1)
            parts = pack_gptq(iw, bits, v1)
            if not act_order:
                parts.pop("g_idx") if i % 2 else None   # g_idx is optional in order; write it for half the modules
        elif method == "awq":
            parts = pack_awq(iw)
        else:
            parts = pack_compressed(iw, bits, sym)
            if act_order:
                parts["weight_g_idx"] = iw.g_idx.to(torch.int32)
        stored.update({f"{path}.{k}": v for k, v in parts.items()})
        deq[name] = dequantize_int(iw)
    config = json.loads((hf_folder / "config.json").read_text())
    quant = {"quantization_config": quantization_config(method, bits, group, sym, act_order, v1),
             "torch_dtype": str(scale_dtype).removeprefix("torch.")}
    for folder, tensors, extra in ((out, stored, quant), (reference, deq, {})):
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps({**config, **extra}))
