"""One configuration for a loaded engine, in three sections, checked once before anything loads.

`EngineConfig` is what `moestream.load(...)` and every CLI command build (from keywords or flags)
and what the build path reads: the runtime (device, dtype, context, batching), the bank (a budget
or a capacity, host tier, policies) and the warm start (discovery, profile, pins, snapshot,
warm-up). Values travel from here to the plan and the bank in one pass; nothing is repacked.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from moestream.errors import InputError
from moestream.experts.bank import MISS_POLICIES
from moestream.experts.host_tier import HOST_TIERS
from moestream.experts.residency import POLICIES
from moestream.quant.recipe import QuantRecipe
from moestream.runtime.distributed import torchrun_env
from moestream.sizes import parse_bytes

DIST_BACKENDS = ("auto", "nccl", "gloo")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def _typed(section: object, rules: dict[str, tuple[type, ...]]) -> None:
    """Each named field holds one of its types (None allowed where the rule lists type(None));
    bools are not integers here."""
    for name, kinds in rules.items():
        value = getattr(section, name)
        if isinstance(value, bool) and bool not in kinds:
            ok = False
        else:
            ok = isinstance(value, kinds)
        if not ok:
            names = " or ".join("None" if k is type(None) else k.__name__ for k in kinds)
            raise InputError(f"option {name} must be {names}, got {value!r}.")


INT, OPT_INT, SIZE = (int,), (int, type(None)), (int, str, type(None))
KV_LAYOUTS = ("auto", "paged", "rows")
OVERLAP_MODES = ("auto", "on", "off")


@dataclass
class RuntimeConfig:
    device: str = "auto"                  # cpu | cuda | cuda:N | auto
    dtype: str | torch.dtype = "auto"     # auto = bf16 on CUDA, fp32 on CPU
    max_context: int | None = None        # KV positions per sequence (default: the model's maximum)
    prefill_chunk: int | str = "auto"     # prompt tokens per forward and per step: a longer prompt is prefilled over
                                          # several steps (cancellable between them, others decoding meanwhile); the
                                          # memory plan sizes the activations for it, and with a bounded bank each
                                          # forward streams the experts it lacks, so larger is faster where it fits;
                                          # "auto" (default): the longest of 4096/2048/1024 that costs a bounded bank
                                          # at most a tenth of its slots (plan.auto_prefill_chunk), else 512
    max_batch: int = 64                   # sequences decoded together; more wait their turn
    pack_prompts: bool = True             # the prompt chunks of one step in one forward (each layer's experts once
                                          # for all of them: a bank copies a missing expert once a step); False:
                                          # one forward per chunk (for comparison)
    cuda_graphs: bool = True
    overlap: str = "auto"                 # launch the next decode step before reading this one's tokens: auto (where
                                          # a step reads nothing back on the GPU) | on (everywhere) | off
    prefix_cache_memory: int | str | None = None   # device bytes of finished sequences' KV kept for reuse (off)
    kv_rows: int = 1                      # sequences whose full-context KV the memory plan reserves (a server: max_batch)
    kv_layout: str = "auto"               # paged (blocks shared by sequences and the prefix cache) | rows (one
                                          # full-context row per sequence) | auto (paged where every layer can be)
    kv_block_size: int = 16               # positions per block of a paged cache
    kv_cache_memory: int | str | None = None   # device bytes of a paged cache (default: kv_rows full contexts
                                          # plus prefix_cache_memory)
    devices: list[str] | None = None      # expert parallel: one rank per device, each holding 1/N of the experts
    rank_timeout_s: float = 120.0         # a rank silent this long (start-up, a collective) ends the group
    mla_absorbed: bool = False            # MLA models: attend in latent space, W_UK/W_UV absorbed (model/mla.py)
    dist_backend: str = "auto"            # auto (NCCL on CUDA, gloo on CPU) | nccl | gloo; gloo lets two ranks
                                          # share one GPU (testing the dispatch on CUDA tensors, debugging)
    ranks_on_device: int = 1              # set per rank by the group: ranks sharing this device split its free memory
    host_share: tuple[int, int] = (0, 1)  # set per rank by the group: (its index, ranks on its host); the CPU
                                          # expert kernel's team takes that share of the host's cores

    def validate(self) -> None:
        _typed(self, {"device": (str, torch.device), "dtype": (str, torch.dtype), "max_context": OPT_INT,
                      "prefill_chunk": (int, str), "max_batch": INT, "pack_prompts": (bool,), "cuda_graphs": (bool,), "overlap": (str,),
                      "prefix_cache_memory": SIZE, "kv_rows": INT, "devices": (list, type(None)),
                      "kv_layout": (str,), "kv_block_size": INT, "kv_cache_memory": SIZE,
                      "rank_timeout_s": (int, float), "mla_absorbed": (bool,), "dist_backend": (str,),
                      "ranks_on_device": INT, "host_share": (tuple,)})
        if self.ranks_on_device < 1:
            raise InputError(f"ranks_on_device must be at least 1, got {self.ranks_on_device}.")
        index, count = self.host_share
        if not 0 <= index < count:
            raise InputError(f"host_share must be (index, ranks) with 0 <= index < ranks, got {self.host_share}.")
        if self.dist_backend not in DIST_BACKENDS:
            raise InputError(f"dist_backend {self.dist_backend!r} is unknown; use one of {', '.join(DIST_BACKENDS)}.")
        if self.rank_timeout_s <= 0:
            raise InputError(f"rank_timeout_s must be positive, got {self.rank_timeout_s}.")
        if self.devices is not None:
            self._check_devices()
        if self.kv_rows < 1:
            raise InputError(f"kv_rows must be at least 1, got {self.kv_rows}.")
        self.prefix_cache_bytes   # parses (and so checks) the sizes
        self.kv_cache_bytes
        if self.overlap not in OVERLAP_MODES:
            raise InputError(f"overlap {self.overlap!r} is unknown; use one of {', '.join(OVERLAP_MODES)}.")
        if self.kv_layout not in KV_LAYOUTS:
            raise InputError(f"kv_layout {self.kv_layout!r} is unknown; use one of {', '.join(KV_LAYOUTS)}.")
        if not 1 <= self.kv_block_size <= 1024:
            raise InputError(f"kv_block_size must be 1..1024 positions, got {self.kv_block_size}.")
        if self.max_context is not None and self.max_context < 2:
            raise InputError(f"max_context must be at least 2, got {self.max_context}.")
        if self.prefill_chunk != "auto" and (isinstance(self.prefill_chunk, str) or self.prefill_chunk < 1):
            raise InputError(f"prefill_chunk must be a number of tokens, at least 1, or \"auto\"; got "
                             f"{self.prefill_chunk!r}.")
        if self.max_batch < 1:
            raise InputError(f"max_batch must be at least 1, got {self.max_batch}.")
        if not isinstance(self.dtype, torch.dtype) and self.dtype != "auto" and self.dtype not in DTYPES:
            raise InputError(f"unknown dtype {self.dtype!r}; use one of auto, {', '.join(DTYPES)}.")

    def _check_devices(self) -> None:
        devices = self.devices
        if len(devices) < 2 or not all(isinstance(d, str) and d for d in devices):
            raise InputError(f"devices must list at least two devices (e.g. cuda:0,cuda:1 or cpu,cpu), got {devices!r}.")
        if self.device != "auto":
            raise InputError("give either device or devices, not both (devices places one rank on each).")
        kinds = {torch.device(d).type for d in devices}
        if len(kinds) > 1:
            raise InputError(f"devices must all be CUDA devices or all be cpu, got {', '.join(devices)}.")
        cuda = [torch.device(d) for d in devices if torch.device(d).type == "cuda"]
        named = [d if d.index is not None else torch.device("cuda", 0) for d in cuda]
        if not cuda and self.dist_backend == "nccl":
            raise InputError("dist_backend nccl needs CUDA devices; CPU ranks reduce over gloo.")
        # NCCL refuses two ranks on one GPU; gloo allows it (both ranks then share the GPU's memory).
        shared = len(set(named)) != len(named) and torchrun_env() is None   # under torchrun ranks span hosts
        if shared and self.dist_backend != "gloo":
            raise InputError(f"devices names the same GPU twice ({', '.join(devices)}); give each rank its own "
                             "(or, to test on one GPU, dist_backend gloo: the ranks then share its memory).")
        if cuda:
            count = torch.cuda.device_count()
            missing = [str(d) for d in named if d.index >= count]
            if missing:
                raise InputError(f"{', '.join(missing)} does not exist (this machine has {count} CUDA devices).")

    @property
    def kv_cache_bytes(self) -> int | None:
        if self.kv_cache_memory is None:
            return None
        size = parse_bytes(self.kv_cache_memory)
        if size <= 0:
            raise InputError(f"kv_cache_memory must be more than 0 bytes, got {self.kv_cache_memory!r}.")
        return size

    @property
    def prefix_cache_bytes(self) -> int:
        size = parse_bytes(self.prefix_cache_memory) if self.prefix_cache_memory is not None else 0
        if size < 0:
            raise InputError(f"prefix_cache_memory must be 0 or more bytes, got {self.prefix_cache_memory!r}.")
        return size


@dataclass
class BankConfig:
    gpu_memory: int | str | None = None   # everything the engine may take on the device (RAM on CPU)
    capacity: int | None = None           # slots per layer; instead of a budget
    host_memory: int | str | None = None  # pinned host RAM for experts off the device; beyond it, disk
    host_tier: Any = "auto"               # auto | pinned | disk, or a host tier of this checkpoint to share
    miss_policy: str = "auto"             # auto (hybrid where it runs, else fetch) | fetch (exact) |
    #                                       hybrid (exact, CPU and PCIe at once) | skip (approximate)
    residency: str = "lcp"                # lcp | lru
    prefetch: bool = False                # next-layer prediction copies ahead (fetch); see BENCHMARKS.md
    pinned: dict[int, list[int]] | None = None   # experts kept resident for good, per MoE layer
    cpu_misses: float | str | None = None  # decode misses computed on the CPU from host RAM (exact): a share, or
    #                                        "auto"; None: none with fetch, the hybrid policy's default share
    cpu_threads: int | None = None        # threads those CPU experts run on (None: torch's default, all cores)
    prompt_cpu_misses: float | str = 0.0  # a streamed prompt chunk's missing experts computed on the CPU while the
    #                                       rest stream in: a share, or "auto" (by measured costs); 0: none

    def validate(self) -> None:
        _typed(self, {"gpu_memory": SIZE, "capacity": OPT_INT, "host_memory": SIZE, "miss_policy": (str,),
                      "residency": (str,), "prefetch": (bool,), "pinned": (dict, type(None)),
                      "cpu_misses": (int, float, str, type(None)), "cpu_threads": OPT_INT,
                      "prompt_cpu_misses": (int, float, str)})
        if isinstance(self.prompt_cpu_misses, str) and self.prompt_cpu_misses != "auto":
            raise InputError(f"prompt_cpu_misses is a share from 0 to 1 or 'auto', got {self.prompt_cpu_misses!r}.")
        if isinstance(self.prompt_cpu_misses, (int, float)) and not 0 <= self.prompt_cpu_misses <= 1:
            raise InputError(f"prompt_cpu_misses is a share of a prompt's misses, from 0 to 1; got "
                             f"{self.prompt_cpu_misses}.")
        if self.prompt_cpu_misses and self.miss_policy == "skip":
            raise InputError("--prompt-cpu-misses computes a prompt's misses exactly on the CPU; it needs "
                             "--miss-policy fetch or hybrid.")
        if isinstance(self.cpu_misses, str) and self.cpu_misses != "auto":
            raise InputError(f"cpu_misses is a share from 0 to 1 or 'auto', got {self.cpu_misses!r}.")
        if isinstance(self.cpu_misses, (int, float)) and not 0 <= self.cpu_misses <= 1:
            raise InputError(f"cpu_misses is a share of the misses, from 0 to 1; got {self.cpu_misses}.")
        if self.cpu_misses and self.miss_policy == "skip":
            raise InputError("cpu_misses computes exact misses on the CPU; it needs --miss-policy fetch or hybrid.")
        if self.prefetch and self.miss_policy == "hybrid":
            raise InputError("--prefetch copies predicted experts ahead for the fetch policy; the hybrid policy "
                             "serves misses where they are. Leave --prefetch out or use --miss-policy fetch.")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise InputError(f"cpu_threads must be at least 1, got {self.cpu_threads}.")
        if (self.cpu_threads is not None and not self.cpu_misses and not self.prompt_cpu_misses
                and self.miss_policy not in ("hybrid", "auto")):
            raise InputError("cpu_threads sets the threads of CPU-computed misses; give --cpu-misses or "
                             "--miss-policy hybrid too, or leave it out.")
        if self.capacity is not None and self.capacity < 1:
            raise InputError(f"capacity must be at least 1, got {self.capacity}.")
        checks = [("miss policy", self.miss_policy, ("auto", *MISS_POLICIES)),
                  ("residency policy", self.residency, tuple(POLICIES))]
        if isinstance(self.host_tier, str):
            checks.append(("host tier", self.host_tier, HOST_TIERS))
        for name, value, valid in checks:
            if value not in valid:
                raise InputError(f"{name} {value!r} is unknown; use one of {', '.join(valid)}.")


@dataclass
class WarmStartConfig:
    discovery: bool | str | list[int] = True   # router-only pass over a prompt seeds a bounded bank
    profile: Any = None                         # a Profile or the path of one (`moestream profile`)
    pin_top_k: int | None = None                # with a profile: pin its K most used experts per layer
    pin_threshold: float | None = None          # with a profile: pin experts above this share of tokens
    prepack: str | Path | None = None           # folder of a warmed-bank snapshot: loaded or saved
    warmup_tokens: int = 0                      # tokens generated before the first request

    def validate(self) -> None:
        _typed(self, {"discovery": (bool, str, list), "pin_top_k": OPT_INT, "pin_threshold": (int, float, type(None)),
                      "prepack": (str, Path, type(None)), "warmup_tokens": INT})
        if self.warmup_tokens < 0:
            raise InputError(f"warmup_tokens must be 0 or more, got {self.warmup_tokens}.")


@dataclass
class EngineConfig:
    model: str | Path
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    bank: BankConfig = field(default_factory=BankConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    quant: QuantRecipe = field(default_factory=QuantRecipe)   # precision per tensor class (quantize on load)

    def validate(self) -> EngineConfig:
        self.runtime.validate()
        self.bank.validate()
        self.warm_start.validate()
        self.quant.validate()
        return self

    @classmethod
    def from_kwargs(cls, model: str | Path, **kwargs: Any) -> EngineConfig:
        """The flat keywords of `moestream.load` sorted into their sections (`memory` is an alias of
        `gpu_memory` that names no device)."""
        if kwargs.get("memory") is not None:
            if kwargs.get("gpu_memory") is not None:
                raise InputError("give either gpu_memory or memory (they are the same budget), not both.")
            kwargs["gpu_memory"] = kwargs["memory"]
        kwargs.pop("memory", None)
        sections = {section: {} for section in ("runtime", "bank", "warm_start", "quant")}
        owners = {f.name: section for section, kind in (("runtime", RuntimeConfig), ("bank", BankConfig),
                                                          ("warm_start", WarmStartConfig), ("quant", QuantRecipe))
                  for f in fields(kind)}
        for key, value in kwargs.items():
            if key not in owners:
                raise InputError(f"unknown option {key!r}; the options are {', '.join(sorted(owners))}.")
            sections[owners[key]][key] = value
        return cls(model, RuntimeConfig(**sections["runtime"]), BankConfig(**sections["bank"]),
                   WarmStartConfig(**sections["warm_start"]), QuantRecipe(**sections["quant"])).validate()
