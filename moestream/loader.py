"""Build a model from a checkpoint: resolve, detect the arch, check shapes, load weights, fill the bank."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from moestream.archs import ArchSpec, ModelConfig, detect_arch, model_config_from_hf
from moestream.checkpoint import TensorIndex, read_config, resolve_checkpoint
from moestream.errors import CheckpointError, DeviceError, InputError
from moestream.experts.bank import ExpertBank
from moestream.experts.budget import MemoryPlan, parse_bytes, plan_memory
from moestream.experts.discovery import Discovery, discover_routing
from moestream.experts.prepack import load_snapshot, save_snapshot, snapshot_key
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
class BankOptions:
    """How the routed experts are kept: a budget or a capacity, and the policies for misses."""

    gpu_memory: int | str | None = None   # everything the engine may take on the device (RAM on CPU)
    capacity: int | None = None           # slots per layer; overrides the budget's choice
    host_memory: int | str | None = None  # pinned host RAM for the expert store; beyond it, read from disk
    host_tier: str = "auto"               # auto | pinned | disk
    miss_policy: str = "fetch"            # fetch (exact) | skip
    residency: str = "lcp"                # lcp | lru
    pinned: dict[int, list[int]] | None = None
    prefetch: bool = False                # next-layer prediction starts copies early (fetch policy); off: see BENCHMARKS.md
    discovery_ids: list[int] | None = None  # router-only pass over this prompt seeds the bank (capacity < E)
    seed: dict[int, object] | None = None   # per-layer expert frequencies (a profile) that seed the bank
    prepack: str | Path | None = None       # folder of a prepacked bank snapshot: loaded when it matches


@dataclass
class LoadedModel:
    folder: Path
    spec: ArchSpec
    config: ModelConfig
    model: MoECausalLM
    bank: ExpertBank
    index: TensorIndex
    plan: MemoryPlan
    discovery: Discovery | None = None
    prepack: PrepackStatus | None = None


@dataclass
class PrepackStatus:
    folder: Path
    loaded: bool      # the bank came from the snapshot
    reason: str       # why it did not (rebuilt and to be saved after warm-up)
    seconds: float
    key: dict


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


def default_device_budget(device: torch.device) -> int | None:
    """With no budget given on CUDA: free device memory less a 1 GiB headroom for the CUDA context and allocator."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return max(0, free - 2**30)


def load_model(model: str | Path, device: torch.device, dtype: torch.dtype, options: BankOptions | None = None,
               max_context: int | None = None) -> LoadedModel:
    options = options or BankOptions()
    folder = resolve_checkpoint(model)
    raw = read_config(folder)
    spec = detect_arch(raw)
    config = model_config_from_hf(raw, spec)
    context = min(max_context or config.max_position, config.max_position)
    budget = options.gpu_memory if options.gpu_memory is not None else (
        None if options.capacity is not None else default_device_budget(device))
    plan = plan_memory(config, dtype, budget, options.capacity, max_context=context)
    host_memory = parse_bytes(options.host_memory) if options.host_memory is not None else None
    index = TensorIndex(folder)
    store = ExpertStore(index, config, spec)   # checks every expert tensor's shape before any load
    with torch.device("meta"):
        net = MoECausalLM(config, spec)
    _load_dense_weights(net, index, config, device, dtype)
    net.eval()
    bank = ExpertBank(store, device, dtype, capacity=plan.capacity, miss_policy=options.miss_policy,
                      residency=options.residency, host_tier=options.host_tier, host_memory=host_memory,
                      staging_slots=plan.staging_slots, pinned=options.pinned, prefetch=options.prefetch, fill=False)
    prepack = _try_prepack(bank, folder, options.prepack) if options.prepack else None
    discovery = None
    if prepack is None or not prepack.loaded:
        seed = options.seed
        if options.discovery_ids and seed is None and plan.capacity < config.num_experts:
            discovery = discover_routing(net, options.discovery_ids, device, dtype)
            seed = {layer: f * discovery.tokens for layer, f in discovery.frequencies.items()}   # as counts
        for layer, frequencies in (seed or {}).items():
            bank.policy.seed(layer, frequencies)
        bank.fill()
    net.bank = bank
    for block in net.moe_blocks():
        block.bank = bank
    return LoadedModel(folder, spec, config, net, bank, index, plan, discovery, prepack)


def _try_prepack(bank: ExpertBank, folder: Path, directory: str | Path) -> PrepackStatus:
    """Restore the bank from a matching snapshot; any mismatch or damage means a rebuild, not an error."""
    t0 = time.perf_counter()
    directory = Path(directory).expanduser()
    key = snapshot_key(bank, folder)
    ok, reason = load_snapshot(bank, directory, key)
    return PrepackStatus(directory, ok, reason, time.perf_counter() - t0, key)


def save_prepack(loaded: LoadedModel) -> str | None:
    """Save the warmed bank when the start did not come from a snapshot; best effort (returns the
    failure as a sentence rather than stopping a running engine)."""
    status = loaded.prepack
    if status is None or status.loaded:
        return None
    try:
        status.folder.mkdir(parents=True, exist_ok=True)
        save_snapshot(loaded.bank, status.folder, status.key)
    except OSError as exc:
        return f"could not save the prepacked bank to {status.folder} ({exc.strerror or exc}); the next start rebuilds it."
    return None
