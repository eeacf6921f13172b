"""The one build path: checkpoint → store → bank → model → runtime → engine, following a LoadPlan.

Order matters for a warm start: the bank's slots are allocated empty, then either restored from a
prepacked snapshot, or filled with the experts a profile or a router-only discovery pass ranks
first (pins before anything else); only then does the model get its routed experts, the engine
warm up, and a snapshot get saved for the next start.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from moestream.checkpoint import TensorIndex
from moestream.checkpoint.resolve import has_tokenizer
from moestream.engine.config import EngineConfig
from moestream.checkpoint.gguf_index import GGUFIndex
from moestream.checkpoint.gguf_tokenizer import load_gguf_tokenizer
from moestream.checkpoint.int_quantized import IntQuantReader
from moestream.engine.plan import LoadPlan, plan_load, read_model
from moestream.engine.ranks import check_world, rank_budget, rank_counts, with_budget
from moestream.engine.weights import load_dense_weights
from moestream.errors import CheckpointError, InputError
from moestream.experts.bank import ExpertBank
from moestream.experts.format import stored_format
from moestream.experts.host_tier import make_host_tier
from moestream.experts.hybrid import check_hybrid
from moestream.experts.gguf_store import GGUFExpertStore
from moestream.experts.int_store import IntQuantExpertStore
from moestream.experts.mxfp4_store import Mxfp4ExpertStore
from moestream.experts.store import (CheckpointExpertStore, ExpertStore, Fp8ExpertStore, MLXExpertStore,
                                     PackedExpertStore)
from moestream.kernels import cpu_moe
from moestream.model.decoder import MoECausalLM
from moestream.model.mla import set_absorbed
from moestream.model.quant_linear import quantize_modules
from moestream.quant import QuantSpec
from moestream.quant.mlx import mlx_spec
from moestream.experts.sharded import Placement, ShardedExperts, ShardStore
from moestream.runtime.distributed import DistributedRunner, RankGroup, checkpoint_digest, rank_config, share_tokens
from moestream.runtime.blocks import BlockManager
from moestream.runtime.model_runner import ModelRunner, PagedLayout
from moestream.runtime.prefix_cache import PrefixCache
from moestream.warmstart.discovery import DEFAULT_PROMPT, Discovery, discover_routing
from moestream.warmstart.prepack import load_snapshot, save_snapshot, snapshot_key
from moestream.warmstart.profile import apply_profile, prepare_profile, profile_seed

FOLLOWER = "moestream.engine.follower"   # the module each follower process runs (it builds that rank's engine)


@dataclass
class PrepackStatus:
    folder: Path
    loaded: bool      # the bank came from the snapshot
    reason: str       # why it did not (rebuilt and to be saved after warm-up)
    seconds: float
    key: dict


def load_tokenizer(folder: Path):
    """The checkpoint's tokenizer, or None when it has no tokenizer files; damaged files are named."""
    if not has_tokenizer(folder):
        return None
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        path = folder / name
        if path.exists():
            try:
                json.loads(path.read_bytes())
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"{path} is not valid JSON ({type(exc).__name__}); re-download the tokenizer "
                                      "files or remove them to pass token ids.") from None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:   # tokenizers raises its own exception types for malformed content
        raise CheckpointError(f"the tokenizer files in {folder} cannot be loaded ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:120] if str(exc) else 'no detail'}); re-download them.") from None


def build_model(plan: LoadPlan, index: TensorIndex) -> MoECausalLM:
    """The module tree on the meta device, quantized modules swapped in, then every dense parameter
    read by its checkpoint name."""
    with torch.device("meta"):
        model = MoECausalLM(plan.config, plan.spec)
    stored = _stored_precision(plan, index)
    reader = index if plan.kind == "gguf" else int_reader(plan, index)
    if reader is not None:   # each module as its tensors say: affine where exact, else dequantized
        stored = reader.stored_spec
    quantize_modules(model, stored if plan.kind in ("mlx", "int", "gguf") else plan.precision)
    load_dense_weights(model, index, plan.config, plan.device, plan.dtype, stored, reader, plan.fp8)
    return model.eval()


def int_reader(plan: LoadPlan, index: TensorIndex) -> IntQuantReader | None:
    """The reader of a GPTQ / AWQ / compressed-tensors checkpoint's quantized modules, else None."""
    if plan.int_quant is None:
        return None
    return IntQuantReader(index, plan.int_quant)


def _stored_precision(plan: LoadPlan, index: TensorIndex):
    """For an MLX checkpoint, how each module is stored (its `.scales` dtype and config entry); else nothing."""
    if plan.mlx is None:
        return lambda path: None

    def stored(path: str) -> QuantSpec | None:
        if f"{path}.scales" not in index:
            return None
        return mlx_spec(plan.mlx, path, index.info(f"{path}.scales").dtype)
    return stored


def open_store(plan: LoadPlan, index: TensorIndex) -> ExpertStore:
    """The expert store of the checkpoint's layout; checks every expert tensor before any load."""
    if plan.kind == "packed":
        return PackedExpertStore(index, plan.config, plan.spec, plan.layout)
    if plan.kind == "mlx":
        return MLXExpertStore(index, plan.config, plan.spec, plan.mlx)
    if plan.kind == "int":
        return IntQuantExpertStore(index, plan.config, plan.spec, int_reader(plan, index))
    if plan.kind == "fp8":
        return Fp8ExpertStore(index, plan.config, plan.spec, plan.fp8)
    if plan.kind == "gguf":
        return GGUFExpertStore(plan.gguf, plan.config, plan.spec, index)
    if plan.kind == "mxfp4":
        return Mxfp4ExpertStore(index, plan.config, plan.spec)
    return CheckpointExpertStore(index, plan.config, plan.spec)


def build_bank(plan: LoadPlan, cfg: EngineConfig, store: ExpertStore, pinned: dict[int, list[int]] | None,
               sharded: bool = False) -> ExpertBank:
    memory = plan.memory
    formats = plan.expert_formats
    if store.native is not None:   # pre-quantized: the slots hold the stored format exactly
        formats = {layer: stored_format(spec, plan.dtype) for layer, spec in store.native.items()}
    tier = None if memory.fully_resident else make_host_tier(cfg.bank.host_tier, store, formats,
                                                             plan.device, plan.host_memory)
    cpu_moe.use_share(*cfg.runtime.host_share)   # an expert-parallel rank's team: cores of its own on its host
    if plan.device.type == "cpu":   # no thread drives a GPU here: the kernel's team takes every core torch uses
        cpu_moe.want_threads(torch.get_num_threads())
    cpu_work = cfg.bank.cpu_misses or cfg.bank.prompt_cpu_misses
    if cpu_work and not memory.fully_resident:   # before the miss costs are measured on them
        if cfg.bank.cpu_threads is not None:
            torch.set_num_threads(cfg.bank.cpu_threads)
        if cpu_moe.load() is not None:
            cpu_moe.set_threads(cfg.bank.cpu_threads)
    if (cfg.bank.cpu_misses and cfg.bank.miss_policy in ("fetch", "auto") and not memory.fully_resident
            and getattr(tier, "layers", None) is None):
        raise InputError("--cpu-misses computes missed experts from host RAM, but the experts are read from disk "
                         "here; add --host-tier pinned (and the host memory it needs) or leave --cpu-misses out.")
    if cfg.bank.prompt_cpu_misses and not memory.fully_resident and getattr(tier, "layers", None) is None:
        raise InputError("--prompt-cpu-misses computes a prompt's missed experts from host RAM, but the experts are "
                         "read from disk here; add --host-tier pinned (and the host memory it needs) or leave "
                         "--prompt-cpu-misses out.")
    policy, note = cfg.bank.miss_policy, None
    if policy == "auto":
        why_not = hybrid_refusal(plan, cfg, store, formats, tier, sharded)
        policy = "hybrid" if why_not is None else "fetch"
        if why_not is not None and not memory.fully_resident:
            note = f"miss policy: fetch (auto: {why_not})"
    return ExpertBank(store, formats, plan.device, memory.capacity, tier, miss_policy=policy,
                      residency=cfg.bank.residency, staging_slots=memory.staging_slots, pinned=pinned,
                      prefetch=cfg.bank.prefetch, cpu_misses=cfg.bank.cpu_misses, cpu_threads=cfg.bank.cpu_threads,
                      policy_note=note, layer_experts=plan.config.num_experts,
                      prompt_cpu_misses=cfg.bank.prompt_cpu_misses)


def hybrid_fits(plan: LoadPlan, cfg: EngineConfig, store: ExpertStore, formats, tier, sharded: bool) -> bool:
    """Whether `--miss-policy auto` takes the hybrid policy (`hybrid_refusal` finds nothing against it)."""
    return hybrid_refusal(plan, cfg, store, formats, tier, sharded) is None


def hybrid_refusal(plan: LoadPlan, cfg: EngineConfig, store: ExpertStore, formats, tier, sharded: bool) -> str | None:
    """Why `--miss-policy auto` does not take the hybrid policy, or None where it does: it needs a
    bounded bank on a GPU, every expert in pinned host RAM in a format the CPU worker reads
    (bf16/fp32, 8/4/2-bit, NF4: not FP8 or MXFP4 yet), the worker's kernel built, one device (several
    take it only when asked for), and no
    fetch-only option asked for (prefetch). Elsewhere auto is the fetch policy (`--stats` says why)."""
    if plan.memory.fully_resident:
        return "every expert is resident"
    if plan.device.type != "cuda":
        return "the hybrid policy runs on a GPU"
    if sharded:
        return "expert parallel takes the fetch policy unless --miss-policy hybrid is given"
    if cfg.bank.prefetch:
        return "--prefetch takes the fetch policy"
    if getattr(tier, "layers", None) is None:
        return "the experts are read from disk, not held in pinned host RAM"
    try:
        check_hybrid(formats, store.shape, tier.layers)
    except InputError as exc:
        return str(exc).split(";")[0].removeprefix("--miss-policy hybrid's ")
    return None


def discovery_ids(discovery: bool | str | list[int], tokenizer) -> list[int] | None:
    if discovery is False or discovery is None:
        return None
    if discovery is True:
        return tokenizer(DEFAULT_PROMPT).input_ids if tokenizer is not None else None
    if isinstance(discovery, str):
        if tokenizer is None:
            raise InputError("a discovery prompt given as text needs tokenizer files; pass token ids instead.")
        return tokenizer(discovery).input_ids
    return [int(t) for t in discovery]


def _try_prepack(bank: ExpertBank, folder: Path, directory: str | Path) -> PrepackStatus:
    """Restore the bank from a matching snapshot; any mismatch or damage means a rebuild, not an error."""
    t0 = time.perf_counter()
    directory = Path(directory).expanduser()
    key = snapshot_key(bank, folder)
    ok, reason = load_snapshot(bank, directory, key)
    return PrepackStatus(directory, ok, reason, time.perf_counter() - t0, key)


def save_prepack(bank: ExpertBank, status: PrepackStatus | None) -> str | None:
    """Save the warmed bank when the start did not come from a snapshot; best effort (returns the
    failure as a sentence rather than stopping a running engine)."""
    if status is None or status.loaded:
        return None
    try:
        status.folder.mkdir(parents=True, exist_ok=True)
        save_snapshot(bank, status.folder, status.key)
    except OSError as exc:
        return f"could not save the prepacked bank to {status.folder} ({exc.strerror or exc}); the next start rebuilds it."
    return None


def build(cfg: EngineConfig, rank: int = 0, world: int = 1, gather: Callable[[int | None], list] | None = None):
    """Load a checkpoint as `cfg` says and return a ready Engine (warmed up and snapshot saved when asked).

    With `cfg.runtime.devices` this process becomes rank 0 of an expert-parallel group and starts the
    others (`runtime/distributed.py`); `rank` / `world` are given to the followers' builds, with
    `gather`, which hands this rank's budget to the group and returns every rank's."""
    group = None
    if cfg.runtime.devices:
        _check_expert_parallel(cfg, plan_load(rank_config(cfg, 0)).config.num_experts)
        group = RankGroup(cfg, FOLLOWER)
        world = group.world
        try:
            cfg = rank_config(cfg, 0)
            engine = _build(cfg, 0, world, group, group.gather_budgets)
            graph_safe = group.wait_ready(checkpoint_digest(engine.plan.folder))
            # Graphs (NCCL only) capture the all-reduces: whole steps where a rank's bank reads nothing
            # back, else segments split at each router; either way every rank reduces in the same order.
            engine.runner.set_cuda_graphs(engine.runner.cuda_graphs and graph_safe)
        except BaseException:
            group.close()
            raise
        engine.group = group
        if cfg.warm_start.warmup_tokens > 0:
            engine.warm_up(cfg.warm_start.warmup_tokens)
        return engine
    return _build(cfg, rank, world, None, gather)


def share_host_threads(cfg: EngineConfig, device: torch.device) -> int | None:
    """A CPU rank of an expert-parallel group on a host with others: torch's threads on this rank's share
    of the cores (`host_share`), as its expert kernel's team already is; returns the count set (None:
    left alone). Every rank taking a thread per core oversubscribes the host, and each all-reduce then
    waits on threads that spin for a core (a 12-token generate on two CPU ranks took 1-11 s, 0.2 s
    with a thread each). `OMP_NUM_THREADS` or `cpu_threads`, when given, decide instead."""
    index, count = cfg.runtime.host_share
    if device.type != "cpu" or count <= 1 or cfg.bank.cpu_threads is not None or os.environ.get("OMP_NUM_THREADS"):
        return None
    threads = len(cpu_moe.cpu_share(cpu_moe.process_cpus(), index, count))
    torch.set_num_threads(threads)
    return threads


def _check_expert_parallel(cfg: EngineConfig, num_experts: int) -> None:
    """What expert parallel cannot do (or not yet), refused by name before any process starts."""
    check_world(len(cfg.runtime.devices), num_experts)
    unsupported = [(cfg.runtime.prefix_cache_bytes > 0, "a prefix cache"), (cfg.bank.miss_policy == "skip", "--miss-policy skip"),
                   (cfg.runtime.kv_layout == "paged", "--kv-layout paged"),
                   (cfg.bank.prefetch, "--prefetch"), (cfg.warm_start.prepack is not None, "--prepack")]
    for present, what in unsupported:
        if present:
            raise InputError(f"{what} is not supported with several devices yet; leave it out or use one device.")


def _build(cfg: EngineConfig, rank: int, world: int, group, gather=None):
    from moestream.engine.engine import Engine

    sharded = world > 1
    warm = cfg.warm_start
    if sharded:   # this rank's share of the experts, from every rank's budget (heterogeneous cards differ)
        budget = rank_budget(cfg)
        counts = rank_counts(cfg, gather(budget))
        cfg = with_budget(cfg, budget)   # planned once, against what was measured and exchanged
        config = read_model(cfg)[3]
        profile, _ = prepare_profile(warm.profile, config, warm.pin_top_k, warm.pin_threshold, cfg.bank.pinned)
        placement = (Placement.balanced(rank, world, config.num_experts, profile_seed(profile), counts)
                     if profile is not None else Placement(rank, world, config.num_experts, counts=counts))
    plan = plan_load(cfg, experts_here=placement.count if sharded else None)
    share_host_threads(cfg, plan.device)
    profile, pinned = prepare_profile(warm.profile, plan.config, warm.pin_top_k, warm.pin_threshold, cfg.bank.pinned)
    tokenizer = (load_tokenizer(plan.folder) if plan.gguf is None   # a GGUF: the files beside it, else its metadata's
                 else load_tokenizer(plan.folder.parent) if has_tokenizer(plan.folder.parent)
                 else load_gguf_tokenizer(plan.gguf))
    index = GGUFIndex(plan.gguf, plan.spec, plan.config) if plan.gguf is not None else TensorIndex(plan.folder)
    store = open_store(plan, index)
    model = build_model(plan, index)
    if plan.device.type == "cuda":
        model.fuse_projections()
    if cfg.runtime.mla_absorbed and not set_absorbed(model):   # before any decode graph is captured
        raise InputError(f"mla_absorbed is for multi-head latent attention models (deepseek_v2, deepseek_v3, "
                         f"glm4_moe_lite); this one is {plan.spec.name}. Leave the option out.")
    if sharded:
        store, pinned = ShardStore(store, placement), placement.local_pins(pinned)
    bank = build_bank(plan, cfg, store, pinned, sharded)
    prepack = _try_prepack(bank, plan.folder, warm.prepack) if warm.prepack else None
    restored = prepack is not None and prepack.loaded
    discovery: Discovery | None = None
    if not restored:
        if profile is not None:
            seed = profile_seed(profile)   # the first fill then holds the profile's top experts
        else:
            ids = discovery_ids(warm.discovery, tokenizer) if not plan.memory.fully_resident else None
            if ids:
                discovery = discover_routing(model, ids, plan.device, plan.dtype)
            seed = ({layer: f * discovery.tokens for layer, f in discovery.frequencies.items()}   # as counts
                    if discovery is not None else {})
        for layer, frequencies in seed.items():
            bank.policy.seed(layer, placement.local_frequencies(layer, frequencies) if sharded else frequencies)
        bank.fill()
    experts = ShardedExperts(bank, placement) if sharded else None
    model.attach_experts(experts if sharded else bank)
    runner_class = DistributedRunner if group is not None else ModelRunner
    memory = plan.memory
    paged = PagedLayout(memory.kv_blocks, memory.kv_block_size) if memory.paged else None
    runner = runner_class(model, bank, plan.device, plan.dtype, plan.context, memory.prefill_chunk,
                          cfg.runtime.cuda_graphs, paged=paged, reserved_rows=memory.kv_rows)
    if group is not None:
        runner.group = group
    if sharded:
        runner.after_replay = experts.collectives.graph_replayed
        runner.before_decode = share_tokens   # every decode step's tokens come from rank 0 on the device
        runner.bank_ids = experts.bank_ids    # a bounded bank's segments make this rank's share resident
        runner.prompt_graphs = False          # prompt chunks stay eager on every rank, in step with rank 0's
    prefix_bytes = cfg.runtime.prefix_cache_bytes
    blocks = None
    if paged is not None:   # the blocks hold the prefix cache too
        blocks = BlockManager(paged.num_blocks, paged.block_size, prefix_caching=prefix_bytes > 0,
                              block_bytes=memory.kv_bytes // paged.num_blocks)
    engine = Engine(plan, model, bank, runner, tokenizer, max_batch=cfg.runtime.max_batch,
                    discovery=discovery, prepack=prepack,
                    prefix_cache=PrefixCache(prefix_bytes) if prefix_bytes and paged is None else None,
                    collectives=experts.collectives if sharded else None, blocks=blocks,
                    overlap=cfg.runtime.overlap, pack_prompts=cfg.runtime.pack_prompts)
    if profile is not None and restored:   # a restored bank keeps its experts; the profile seeds statistics
        apply_profile(bank, profile, refill=False)
    engine.reset_stats()   # filling and seeding are part of loading
    if warm.warmup_tokens > 0 and group is None and not sharded:   # a group warms up once every rank is ready
        engine.warm_up(warm.warmup_tokens, bank_is_warm=restored)
    engine.prepack_error = save_prepack(bank, prepack)
    return engine
