"""The plan: what a checkpoint and a configuration will take, decided before any weight is read.

`plan_load` resolves the checkpoint, detects the arch, reads config.json, picks the device, dtype,
context and expert format, and sizes the bank with `plan_memory`; `moestream check` prints it and
the build path follows it. `plan_memory` is the one function that turns a budget into a capacity
(or checks a given capacity): everything the engine takes on the device counts, namely the
always-resident weights, the cache for the context, the activation workspace of a prefill chunk,
the bank, its slot maps and the transient staging area long prompts stream missing experts through.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from moestream.archs import ARCHS, ArchSpec, ModelConfig, detect_arch, model_config_from_hf
from moestream.checkpoint import read_config, resolve_checkpoint
from moestream.checkpoint.gguf_file import GGUFCheckpoint, is_gguf, open_gguf
from moestream.checkpoint.gguf_index import GGUFIndex
from moestream.engine.config import DTYPES, EngineConfig
from moestream.errors import BudgetError, DeviceError, InputError
from moestream.experts.format import (ExpertFormat, ExpertShape, Fp8Format, QuantizedFormat, dense_format,
                                      stored_format)
from moestream.experts.gguf_store import expert_formats as gguf_expert_formats
from moestream.experts.mxfp4_format import Mxfp4Format
from moestream.kernels.long_prompts import dequant_min_tokens, dequant_scratch_bytes
from moestream.checkpoint.packed import PackedLayout
from moestream.engine.weights import parameter_bytes
from moestream.model.decoder import MoECausalLM, attention_workspace_bytes, block_bytes, cache_bytes, pageable
from moestream.model.quant_linear import quantize_modules
from moestream.quant import QuantSpec
from moestream.quant.fp8 import Fp8Spec, fp8_quantization
from moestream.quant.gptq import IntQuant, affine_spec, fallback_spec, int_quantization
from moestream.quant.mlx import mlx_quantization, mlx_spec
from moestream.quant.mxfp4 import mxfp4_quantization
from moestream.quant.recipe import QuantRecipe, module_class
from moestream.sizes import dtype_size, format_bytes, parse_bytes

DEFAULT_PREFILL_CHUNK = 512           # prompt tokens a forward unless told (or `auto` keeps it)
AUTO_PREFILL_CHUNKS = (4096, 2048, 1024)   # what `--prefill-chunk auto` tries for a bounded bank, longest first
AUTO_CHUNK_KEEPS = 0.9                # ... keeping at least this share of the bank's slots at the default chunk

# cuBLAS/cuDNN workspaces (one per stream: compute and copy), CUDA-graph pools of the decode
# steps, allocator rounding and small tensors (routing, sampling). Measured on an H100: the
# rest of the plan was 70 MB short of torch.cuda.max_memory_allocated with a 64 MiB slack,
# and 200 MB short with 256 MiB once a fetch bank captured its decode segments.
SLACK_BYTES = 384 * 2**20


Precision = Callable[[str], QuantSpec | None]   # dense module path → its quantization (None: full precision)


def dense_weight_bytes(config: ModelConfig, dtype: torch.dtype, precision: Precision | None = None,
                       spec: ArchSpec | None = None) -> int:
    """Every always-resident tensor, counted on the module tree itself (built on the meta device):
    embeddings, LM head, attention, norms, routers, shared and dense MLPs, each at its precision."""
    with torch.device("meta"):
        model = MoECausalLM(config, spec or ARCHS[config.arch])
    if precision is not None:
        quantize_modules(model, precision)
    return parameter_bytes(model, dtype)


def workspace_bytes(config: ModelConfig, dtype: torch.dtype, batch: int, prefill_chunk: int, max_context: int,
                    spec: ArchSpec | None = None) -> int:
    """Peak activations: a prefill chunk through one layer (the largest live set) plus the logits. Its
    attention holds the chunk's mask and bias over the whole context and whatever scores its mixers
    keep (`attention_workspace_bytes`: none where SDPA attends)."""
    e = dtype_size(dtype)
    T = max(prefill_chunk, batch)
    H, I, k = config.hidden_size, config.moe_intermediate, config.top_k
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden = 6 * T * H * e + T * (q + 2 * kv) * e * 2
    moe = T * k * (2 * I * 4 + I * e + H * 4) + T * k * 16   # gate_up fp32, activation, fp32 partials, indices
    attention = attention_workspace_bytes(config, spec or ARCHS[config.arch], T, max_context, dtype)
    logits = batch * config.vocab_size * 4 * 3
    return hidden + max(moe, attention) + logits


@dataclass(frozen=True)
class MemoryPlan:
    budget: int | None
    dense_bytes: int
    kv_bytes: int
    workspace_bytes: int
    layer_slot_bytes: tuple[int, ...]   # bytes of one slot (one expert in that layer's format), per MoE layer
    staging_formats: int                # distinct expert formats: each has its own staging buffers
    num_experts: int
    top_k: int
    capacity: int
    staging_slots: int
    prefix_cache_bytes: int = 0         # finished conversations' KV kept for reuse (the server's prefix cache)
    kv_rows: int = 1                    # sequences the cache holds at full context (plus, above one, the
                                        # scratch row padded decode graphs write to)
    kv_blocks: int = 0                  # a paged cache's blocks, the null block included (0: one row per sequence)
    kv_block_size: int = 0              # positions per block
    min_capacity: int = 0               # the fewest slots a layer may have (0: top_k; the hybrid miss
                                        # policy serves any miss off the device, so it needs only one)
    slack_bytes: int = SLACK_BYTES      # CUDA's own workspaces and graph pools (none on the CPU)
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK   # prompt tokens a forward, whose activations `workspace_bytes` holds

    @property
    def paged(self) -> bool:
        return self.kv_blocks > 0

    @property
    def moe_layers(self) -> int:
        return len(self.layer_slot_bytes)

    @property
    def slot_bytes(self) -> int:
        return max(self.layer_slot_bytes, default=0)

    @property
    def fixed_bytes(self) -> int:
        slot_maps = self.moe_layers * (self.num_experts + 1) * 4
        return (self.dense_bytes + self.kv_bytes + self.prefix_cache_bytes + self.workspace_bytes + slot_maps
                + self.slack_bytes)

    @property
    def bank_bytes(self) -> int:
        return self.capacity * sum(self.layer_slot_bytes)

    @property
    def staging_bytes(self) -> int:
        return self.staging_slots * self.slot_bytes * self.staging_formats

    @property
    def total_bytes(self) -> int:
        return self.fixed_bytes + self.bank_bytes + self.staging_bytes

    @property
    def least_capacity(self) -> int:
        return self.min_capacity or self.top_k

    @property
    def minimum_bytes(self) -> int:
        staging = staging_slots_for(self.least_capacity, self.num_experts, self.top_k)
        return (self.fixed_bytes + self.least_capacity * sum(self.layer_slot_bytes)
                + staging * self.slot_bytes * self.staging_formats)

    @property
    def fully_resident(self) -> bool:
        return self.capacity >= self.num_experts

    @property
    def expert_fraction(self) -> float:
        return self.capacity / self.num_experts if self.num_experts else 1.0

    def explain(self) -> str:
        lines = [f"budget            {format_bytes(self.budget) if self.budget else 'unbounded'}",
                 f"dense weights     {format_bytes(self.dense_bytes)}",
                 f"KV cache          {format_bytes(self.kv_bytes)}" + (
                     f" (paged: {self.kv_blocks - 1} blocks × {self.kv_block_size} positions, shared by every "
                     f"sequence and the prefix cache)" if self.paged else ""),
                 *([f"prefix cache      {format_bytes(self.prefix_cache_bytes)}"] if self.prefix_cache_bytes else []),
                 f"workspace         {format_bytes(self.workspace_bytes + self.slack_bytes)}",
                 f"prefill chunk     {self.prefill_chunk} tokens a forward",
                 f"bank              {format_bytes(self.bank_bytes)} = {self.capacity} slots × {self.moe_layers} layers × {format_bytes(self.slot_bytes)}"
                 + (" (largest)" if len(set(self.layer_slot_bytes)) > 1 else ""),
                 f"staging           {format_bytes(self.staging_bytes)} ({self.staging_slots} slots)",
                 f"total             {format_bytes(self.total_bytes)}",
                 f"capacity          {self.capacity}/{self.num_experts} experts per layer ({self.expert_fraction:.0%})",
                 f"minimum budget    {format_bytes(self.minimum_bytes)} ({self.least_capacity} slots per layer)"]
        return "\n".join(lines)


def staging_slots_for(capacity: int, num_experts: int, top_k: int) -> int:
    """Two buffers of max(top_k, 8) slots stream missing experts of long prompts; none when all fit."""
    if capacity >= num_experts:
        return 0
    return 2 * min(num_experts - capacity, max(top_k, 8))


def paged_gather_bytes(config: ModelConfig, dtype: torch.dtype, max_context: int) -> int:
    """A paged cache's prefill chunk gathers its row's keys and values into one tensor per layer
    (up to the whole context) before attending: that transient copy. A rows cache of full keys and
    values does the same when a resident model's prompt chunk replays as a graph (its row read by a
    device index: `runtime/cuda_graphs.py: PromptGraphs`); a plan counts it for every rows cache of full
    keys and values, on any device and bank, so that a plan is the same wherever it runs."""
    return 2 * max_context * config.num_kv_heads * config.head_dim * dtype_size(dtype)


def paged_blocks(config: ModelConfig, spec: ArchSpec, dtype: torch.dtype, block_size: int, max_context: int,
                 rows: int, prefix_cache_bytes: int, kv_cache_bytes: int | None) -> int:
    """Blocks of a paged cache, the null block included: `kv_cache_bytes` worth, else what the rows
    layout would reserve (`rows` full contexts) plus the prefix cache's bytes, which the pool then
    shares. Never fewer than one whole context: the oldest sequence must always be able to grow."""
    per_block = block_bytes(config, spec, block_size, dtype)
    context_blocks = -(-max_context // block_size)
    if kv_cache_bytes is not None:
        blocks = kv_cache_bytes // per_block
        if blocks < context_blocks:
            raise BudgetError(f"a KV cache of {format_bytes(kv_cache_bytes)} holds {blocks * block_size} positions, "
                              f"fewer than one context of {max_context}; raise --kv-cache-memory to at least "
                              f"{format_bytes(context_blocks * per_block)} or lower --max-context.")
    else:
        blocks = rows * context_blocks + prefix_cache_bytes // per_block
    return blocks + 1


def dequant_workspace_bytes(config: ModelConfig, dtype: torch.dtype, formats: dict[int, ExpertFormat],
                            tokens: int) -> int:
    """What a chunk of `tokens` adds when it takes the quantized experts' long prompts' path
    (`kernels/long_prompts.py`): a dequantized copy of one group of a layer's slots (32 at most,
    `dequant_group_slots`); 0 where chunks stay shorter than that path's threshold."""
    specs = [fmt.spec for fmt in formats.values() if isinstance(fmt, QuantizedFormat)]
    if not specs or tokens < min(dequant_min_tokens(spec) for spec in specs):
        return 0
    return dequant_scratch_bytes(config.num_experts, config.hidden_size, config.moe_intermediate, dtype)


def plan_memory(config: ModelConfig, dtype: torch.dtype, budget: int | str | None = None, capacity: int | None = None,
                max_context: int = 4096, batch: int = 1, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                expert_formats: dict[int, ExpertFormat] | None = None, spec: ArchSpec | None = None,
                precision: Precision | None = None, prefix_cache_bytes: int = 0, kv_blocks: int = 0,
                kv_block_size: int = 16, min_capacity: int = 0, slack_bytes: int = SLACK_BYTES,
                gathers_rows: bool = False) -> MemoryPlan:
    """Capacity from the budget (or the budget a given capacity needs); refuse below the minimum.
    `min_capacity`: the fewest slots per layer (0: top_k, which a fetching bank needs at once).

    `expert_formats` (per MoE layer; default: the compute dtype's dense format) size the slots,
    `precision` the always-resident tensors. `kv_blocks` > 0: the cache is paged, that many blocks
    of `kv_block_size` positions (`paged_blocks`), and holds the prefix cache too. `slack_bytes`: what
    CUDA takes beyond the tensors (SLACK_BYTES; 0 for a plan of CPU memory). `gathers_rows`: a rows
    cache whose prompt chunks may gather their row as a paged one does (`paged_gather_bytes`)."""
    E, k = config.num_experts, config.top_k
    spec = spec or ARCHS[config.arch]
    if kv_blocks:
        kv_bytes = kv_blocks * block_bytes(config, spec, kv_block_size, dtype)
        prefix_cache_bytes = 0
    else:
        kv_bytes = cache_bytes(config, spec, batch + (batch > 1), max_context, dtype)
    budget_bytes = parse_bytes(budget) if budget is not None else None
    least = min(min_capacity or k, E)
    if capacity is not None and capacity > E:
        raise BudgetError(f"capacity {capacity} is more slots than the model's {E} experts per layer; give at most "
                          f"{E} (every expert resident).")
    if capacity is not None and not least <= capacity <= E:
        why = (f"a layer needs at least its top-{k} experts" if least == k
               else f"a layer needs at least {least} slot{'s' if least > 1 else ''}")
        raise BudgetError(f"capacity {capacity} is outside {least}..{E}: {why} and has only {E}; pick a capacity "
                          f"in that range{' (or --miss-policy hybrid, which takes any capacity from 1)' if least == k else ''}.")
    formats = expert_formats or {layer: dense_format(dtype) for layer, moe in enumerate(config.moe_layers) if moe}
    shape = ExpertShape.of(config)   # with the experts' biases (GPT-OSS) and activation
    long_prompt = dequant_workspace_bytes(config, dtype, formats, max(prefill_chunk, batch))
    base = dict(budget=budget_bytes, dense_bytes=dense_weight_bytes(config, dtype, precision, spec),
                kv_bytes=kv_bytes, prefix_cache_bytes=prefix_cache_bytes, kv_rows=batch, kv_blocks=kv_blocks,
                kv_block_size=kv_block_size if kv_blocks else 0,
                workspace_bytes=workspace_bytes(config, dtype, batch, prefill_chunk, max_context, spec) + long_prompt
                + (paged_gather_bytes(config, dtype, max_context) if kv_blocks or gathers_rows else 0),
                layer_slot_bytes=tuple(formats[layer].nbytes(shape) for layer in sorted(formats)),
                staging_formats=len({fmt.name for fmt in formats.values()}), num_experts=E, top_k=k,
                min_capacity=min_capacity, slack_bytes=slack_bytes, prefill_chunk=prefill_chunk)
    if capacity is None and budget_bytes is None:
        capacity = E
    if capacity is None:
        capacity = E
        for cap in range(E, least - 1, -1):
            plan = MemoryPlan(**base, capacity=cap, staging_slots=staging_slots_for(cap, E, k))
            if plan.total_bytes <= budget_bytes:
                capacity = cap
                break
        else:
            capacity = least
    plan = MemoryPlan(**base, capacity=capacity, staging_slots=staging_slots_for(capacity, E, k))
    if budget_bytes is not None and plan.total_bytes > budget_bytes:
        if plan.minimum_bytes > budget_bytes:
            raise BudgetError(f"a budget of {format_bytes(budget_bytes)} is below the minimum of "
                              f"{format_bytes(plan.minimum_bytes)} this model needs ({least} slots per layer plus "
                              f"{format_bytes(plan.fixed_bytes)} of weights, KV cache and workspace); raise the budget "
                              "or lower --max-context.")
        raise BudgetError(f"capacity {capacity} needs {format_bytes(plan.total_bytes)}, more than the budget of "
                          f"{format_bytes(budget_bytes)}; lower --capacity or raise the budget.")
    return plan


def auto_prefill_chunk(plan_at: Callable[[int], MemoryPlan], max_context: int, rows: int = 1) -> MemoryPlan:
    """`--prefill-chunk auto`: the plan of the longest chunk that costs a bounded bank at most a tenth of
    its slots. With a bounded bank every chunk of a prompt copies (or computes on the CPU) nearly every
    expert it lacks in each layer, so a long prompt's expert traffic falls with the chunk's length, and
    llama.cpp's own prompt at `--n-cpu-moe` ran 3.7× faster in 4,096-token ubatches than in 512-token
    ones; the price is the chunk's activations (and, for quantized experts, the dequantized path's
    scratch), taken from the bank. A fully resident model copies nothing and keeps the default chunk.
    `rows`: the sequences whose prompts one step can pack (a server's KV rows): a chunk past one
    sequence's context still fills when several prompts arrive together, and each expert then streams
    once for all of them."""
    base = plan_at(DEFAULT_PREFILL_CHUNK)
    if base.fully_resident:
        return base
    for chunk in AUTO_PREFILL_CHUNKS:
        if chunk > max_context * rows:   # a chunk no step of prompts fills only reserves memory
            continue
        try:
            plan = plan_at(chunk)
        except BudgetError:
            continue
        if plan.capacity >= AUTO_CHUNK_KEEPS * base.capacity:
            return plan
    return base


# ---- the whole plan of a load ----------------------------------------------------------------
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


def default_device_budget(device: torch.device) -> int | None:
    """With no budget given on CUDA: free device memory less a 1 GiB headroom for the CUDA context and allocator."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return max(0, free - 2**30)


def device_budget(cfg: EngineConfig, device: torch.device,
                  free_memory: Callable[[torch.device], int | None] = default_device_budget) -> int | None:
    """The budget `cfg` plans against on `device`: the one given, none with a capacity, else the
    device's free memory (`free_memory`) shared by the ranks placed on it (expert parallel)."""
    bank = cfg.bank
    if bank.gpu_memory is not None:
        return parse_bytes(bank.gpu_memory)
    if bank.capacity is not None:
        return None
    free = free_memory(device)
    return None if free is None else free // cfg.runtime.ranks_on_device


@dataclass(frozen=True)
class LoadPlan:
    folder: Path
    spec: ArchSpec
    config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    context: int                 # positions per sequence
    kind: str                    # "hf" (full precision), "packed" (moestream convert), "mlx" (MLX-quantized),
                                 # "int" (GPTQ / AWQ / compressed-tensors pack-quantized),
                                 # "fp8" (FP8 e4m3 weights with scales: quant/fp8.py), "mxfp4" (gpt-oss)
                                 # or "gguf" (llama.cpp's)
    recipe: QuantRecipe          # the precision of every tensor class (asked for, or what the checkpoint holds)
    precision: Precision         # dense module path → its quantization
    expert_formats: dict[int, ExpertFormat]   # per MoE layer
    memory: MemoryPlan
    host_memory: int | None      # bytes of pinned host RAM the expert store may take (None: 60% of available)
    layout: PackedLayout | None = None        # a packed checkpoint's layout.json
    mlx: dict | None = None                   # an MLX checkpoint's quantization block
    int_quant: IntQuant | None = None         # a GPTQ / AWQ / compressed-tensors checkpoint's quantization
    fp8: Fp8Spec | None = None                # an FP8 checkpoint's layout
    gguf: GGUFCheckpoint | None = None        # a GGUF checkpoint (folder is then its first file)


def read_model(cfg: EngineConfig) -> tuple[Path, dict, ArchSpec, ModelConfig]:
    """The checkpoint's folder (a GGUF's first file), raw config.json (a GGUF's, built from its
    metadata), arch and model configuration (nothing else read)."""
    if is_gguf(cfg.model):
        ckpt = open_gguf(cfg.model)
        raw = ckpt.hf_config()
        spec = detect_arch(raw)
        return ckpt.path, raw, spec, model_config_from_hf(raw, spec)
    folder = resolve_checkpoint(cfg.model)
    raw = read_config(folder)
    spec = detect_arch(raw)
    return folder, raw, spec, model_config_from_hf(raw, spec)


PREFIX_CACHE_MOST = 2**30   # the server's default prefix cache never exceeds this


def default_prefix_cache_bytes(cfg: EngineConfig, rows: int) -> int:
    """The server's prefix cache when none is asked for: the KV of `rows` full contexts, at most
    PREFIX_CACHE_MOST, so a small model does not hold a cache sized for a large one."""
    _, _, spec, config = read_model(cfg)
    dtype = resolve_dtype(cfg.runtime.dtype, resolve_device(cfg.runtime.device))
    context = min(cfg.runtime.max_context or config.max_position, config.max_position)
    return min(PREFIX_CACHE_MOST, cache_bytes(config, spec, rows, context, dtype))


def plan_load(cfg: EngineConfig, experts_here: int | None = None) -> LoadPlan:
    """Everything a load decides from config.json and the configuration alone (no weights read).

    `experts_here`: on a rank of an expert-parallel group, how many experts per layer it owns (its
    bank's capacity is planned against those)."""
    cfg.validate()
    folder, raw, spec, config = read_model(cfg)
    device = resolve_device(cfg.runtime.device)
    dtype = resolve_dtype(cfg.runtime.dtype, device)
    context = min(cfg.runtime.max_context or config.max_position, config.max_position)
    asked = cfg.quant.validate(config.num_layers)
    asked.check_dtype(dtype)
    layout = PackedLayout.load(folder) if PackedLayout.present(folder) else None
    # Which reader owns the quantization block: the integer reader (GPTQ / AWQ / compressed-tensors'
    # integer formats), else the FP8 reader (fp8, compressed-tensors' float-quantized), else MXFP4
    # (quant_method "mxfp4", gpt-oss), else MLX (whose test, bits and group_size, GPTQ's block would
    # also pass).
    int_quant = int_quantization(raw)
    ckpt = open_gguf(folder) if is_gguf(folder) else None
    fp8 = fp8_quantization(raw) if layout is None and int_quant is None and ckpt is None else None
    mxfp4 = layout is None and int_quant is None and fp8 is None and ckpt is None and mxfp4_quantization(raw)
    mlx = mlx_quantization(raw) if int_quant is None and fp8 is None and not mxfp4 and ckpt is None else None
    kind = ("gguf" if ckpt is not None else "packed" if layout is not None else "mlx" if mlx is not None
            else "int" if int_quant is not None else "fp8" if fp8 is not None else "mxfp4" if mxfp4 else "hf")
    if kind not in ("hf", "fp8") and (asked.quantized or asked.layer_formats):
        stored = ("a GGUF" if ckpt is not None else "a packed (moestream convert)" if layout is not None
                  else "an MLX-quantized" if mlx is not None else "an MXFP4-quantized" if mxfp4
                  else f"a {int_quant.method}-quantized")
        raise InputError(f"{folder} is {stored} checkpoint whose precision is fixed; drop --experts, --shared, "
                         "--attention, --embeddings and --layer-format.")
    L = config.num_layers
    if ckpt is not None:   # each linear and each layer's experts as their ggml types say (gguf_store.layer_spec)
        recipe = QuantRecipe()
        precision = GGUFIndex(ckpt, spec, config).stored_spec
        formats = gguf_expert_formats(ckpt, config, dtype, dense_format(dtype))
    elif layout is not None:
        recipe = QuantRecipe.from_dict(layout.recipe)
        precision = functools.partial(_recipe_precision, recipe, L)
        formats = {layer: stored_format(rec.spec, dtype) for layer, rec in layout.layers.items()}
    elif mlx is not None:
        recipe = QuantRecipe()
        scale_dtype = getattr(torch, str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"), torch.bfloat16)
        precision = functools.partial(mlx_spec, mlx, scale_dtype=scale_dtype)
        formats = {layer: QuantizedFormat(mlx_spec(mlx, f"model.layers.{layer}.{spec.moe_prefix}.switch_mlp.gate_proj",
                                                   scale_dtype), dtype)
                   for layer, moe in enumerate(config.moe_layers) if moe}
    elif int_quant is not None:
        recipe, precision, formats = _plan_int(int_quant, config, dtype)
    elif fp8 is not None:   # kept in their FP8 bytes, unless the recipe quantizes them from the dequantized weights
        recipe = asked
        precision = functools.partial(_fp8_precision, recipe, L, fp8_modules(folder), fp8)
        unpacked = str(recipe.experts).lower() in ("bf16", "fp16", "fp32")   # asked for by name: dequantized
        formats = {layer: (fmt if isinstance(fmt, QuantizedFormat) or unpacked else Fp8Format(fp8, dtype))
                   for layer, fmt in expert_formats(config, dtype, recipe).items()}
    elif mxfp4:   # the experts as they are stored (4.25 bits a weight); everything else is bf16 already
        recipe = QuantRecipe()
        precision = functools.partial(_recipe_precision, recipe, L)
        formats = {layer: Mxfp4Format(dtype) for layer, moe in enumerate(config.moe_layers) if moe}
    else:
        recipe = asked
        precision = functools.partial(_recipe_precision, recipe, L)
        formats = expert_formats(config, dtype, recipe)
    bank = cfg.bank
    budget = device_budget(cfg, device)
    planned, capacity = config, bank.capacity
    if experts_here is not None:   # this rank's bank only ever holds its own experts
        planned = dataclasses.replace(config, num_experts=experts_here, top_k=min(config.top_k, experts_here))
        capacity = min(capacity, experts_here) if capacity is not None else None
    runtime = cfg.runtime
    kv_blocks = 0
    if kv_layout(cfg, config, spec) == "paged":
        kv_blocks = paged_blocks(config, spec, dtype, runtime.kv_block_size, context, runtime.kv_rows,
                                 runtime.prefix_cache_bytes, runtime.kv_cache_bytes)
    def plan_at(chunk: int) -> MemoryPlan:
        return plan_memory(planned, dtype, budget, capacity, max_context=context, prefill_chunk=chunk,
                           expert_formats=formats, spec=spec, precision=precision,
                           prefix_cache_bytes=runtime.prefix_cache_bytes, batch=runtime.kv_rows, kv_blocks=kv_blocks,
                           kv_block_size=runtime.kv_block_size, min_capacity=1 if bank.miss_policy == "hybrid" else 0,
                           slack_bytes=SLACK_BYTES if device.type == "cuda" else 0,
                           gathers_rows=not kv_blocks and pageable(config, spec))
    if runtime.prefill_chunk != "auto":
        memory = plan_at(runtime.prefill_chunk)
    elif experts_here is not None:   # every rank splits a prompt as rank 0 does: one chunk length for all
        memory = plan_at(DEFAULT_PREFILL_CHUNK)
    else:
        memory = auto_prefill_chunk(plan_at, context, runtime.kv_rows if runtime.pack_prompts else 1)
    host_memory = parse_bytes(bank.host_memory) if bank.host_memory is not None else None
    return LoadPlan(folder, spec, config, device, dtype, context, kind, recipe, precision, formats, memory,
                    host_memory, layout, mlx, int_quant, fp8, ckpt)


def _plan_int(q: IntQuant, config: ModelConfig,
              dtype: torch.dtype) -> tuple[QuantRecipe, Precision, dict[int, ExpertFormat]]:
    """GPTQ / AWQ / compressed-tensors: experts in the affine spec that holds them exactly, else
    (act-order, or a group none of ours divides: the reason is printed once at load) requantized to
    int8 or dequantized (`fallback_spec`); attention and shared experts planned in the exact spec
    (the build follows what each module's tensors say; without an exact form they dequantize)."""
    spec = affine_spec(q)
    held = spec or fallback_spec(q)

    def precision(path: str) -> QuantSpec | None:
        return spec if module_class(path)[0] in ("attention", "shared") and not q.skips(path) else None
    formats = {layer: QuantizedFormat(held, dtype) if held is not None else dense_format(dtype)
               for layer, moe in enumerate(config.moe_layers) if moe}
    return QuantRecipe(), precision, formats


def kv_layout(cfg: EngineConfig, config: ModelConfig, spec: ArchSpec) -> str:
    """"paged" or "rows". `auto` pages the cache wherever every layer keeps full keys and values (the
    decode kernel reads each row to its own length, so paging costs a single stream nothing). The
    ranks of an expert-parallel group keep rows (`rank_config` says so)."""
    layout = cfg.runtime.kv_layout
    can_page = pageable(config, spec)
    if layout == "paged" and not can_page:
        raise InputError(f"--kv-layout paged is not available here: {spec.name}'s layers do not all keep full keys "
                         "and values (sliding-window, recurrent or latent caches); use --kv-layout rows or auto.")
    if layout == "auto":
        return "paged" if can_page else "rows"
    return layout


def fp8_modules(folder: Path) -> frozenset[str]:
    """The modules whose `.weight` an FP8 checkpoint stores as float8_e4m3fn (safetensors headers only)."""
    from moestream.checkpoint import TensorIndex

    index = TensorIndex(folder)
    return frozenset(name.removesuffix(".weight") for name, info in index.tensors.items()
                     if name.endswith(".weight") and info.dtype == torch.float8_e4m3fn)


def _fp8_precision(recipe: QuantRecipe, num_layers: int, stored: frozenset[str], fp8: Fp8Spec,
                   path: str) -> QuantSpec | Fp8Spec | None:
    """A dense module's precision in an FP8 checkpoint: the recipe's where it names one (quantized from
    the dequantized weight), else FP8 where the checkpoint stores it so (the LM head tied to the
    embedding reads the embedding's precision, which FP8 checkpoints keep full)."""
    return recipe.spec_for(path, num_layers) or (fp8 if path in stored else None)


def _recipe_precision(recipe: QuantRecipe, num_layers: int, path: str) -> QuantSpec | None:
    return recipe.spec_for(path, num_layers)


def expert_formats(config: ModelConfig, dtype: torch.dtype, recipe: QuantRecipe) -> dict[int, ExpertFormat]:
    """The expert format of every MoE layer under `recipe` (dense in the compute dtype when not quantized)."""
    out = {}
    for layer, moe in enumerate(config.moe_layers):
        if moe:
            spec = recipe.spec("experts", layer, config.num_layers)
            out[layer] = QuantizedFormat(spec, dtype) if spec is not None else dense_format(dtype)
    return out
