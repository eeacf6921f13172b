"""Build a model from a checkpoint: resolve, detect the arch, check shapes, load weights, fill the bank."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from moestream.archs import ArchSpec, ModelConfig, detect_arch, model_config_from_hf
from moestream.checkpoint import TensorIndex, read_config, resolve_checkpoint
from moestream.errors import CheckpointError, DeviceError, InputError
from moestream.experts.bank import ExpertBank
from moestream.experts.store import ExpertStore
from moestream.model.decoder import MoECausalLM

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_device(device: str | torch.device) -> torch.device:
    name = str(device)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise DeviceError("--device cuda was asked for but no CUDA GPU is available; use --device cpu or auto.")
    if name.startswith("mps"):
        raise DeviceError("the mps device is not supported yet; use --device cpu.")
    try:
        return torch.device(name)
    except RuntimeError:
        raise DeviceError(f"unknown device {name!r}; use cpu, cuda, cuda:N or auto.") from None


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return DTYPES[dtype]
    except KeyError:
        raise InputError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(DTYPES)}.") from None


@dataclass
class LoadedModel:
    folder: Path
    spec: ArchSpec
    config: ModelConfig
    model: MoECausalLM
    bank: ExpertBank
    index: TensorIndex


def _load_dense_weights(model: MoECausalLM, index: TensorIndex, config: ModelConfig, device: torch.device,
                        dtype: torch.dtype) -> None:
    """Every parameter of the module tree is named as on disk: read each by name, check its shape."""
    modules = dict(model.named_modules())
    for name, param in list(model.named_parameters()):
        source = name
        if name == "lm_head.weight" and (config.tie_embeddings or name not in index):
            if not config.tie_embeddings and name not in index:
                raise CheckpointError(f"tensor 'lm_head.weight' is missing from the checkpoint in {index.folder}; the download is incomplete.")
            source = "model.embed_tokens.weight"
        tensor = index.read(source, expected_shape=tuple(param.shape))
        owner, _, attr = name.rpartition(".")
        modules[owner]._parameters[attr] = torch.nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False)


def load_model(model: str | Path, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    folder = resolve_checkpoint(model)
    raw = read_config(folder)
    spec = detect_arch(raw)
    config = model_config_from_hf(raw, spec)
    index = TensorIndex(folder)
    store = ExpertStore(index, config, spec)   # checks every expert tensor's shape before any load
    with torch.device("meta"):
        net = MoECausalLM(config, spec)
    _load_dense_weights(net, index, config, device, dtype)
    net.eval()
    bank = ExpertBank(store, device, dtype)
    for block in net.moe_blocks():
        block.bank = bank
    return LoadedModel(folder, spec, config, net, bank, index)
