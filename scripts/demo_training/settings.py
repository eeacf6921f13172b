"""The run's settings: the model shape and its byte budget, corpus and training settings, the command line."""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


import torch



EOS_TOKEN = "<|endoftext|>"
SIZE_BUDGET_BYTES = 36_000_000
"""Hard cap for everything the output directory holds (decimal MB, the stricter reading)."""
NON_WEIGHT_RESERVE_BYTES = 1_300_000
"""Room kept for tokenizer files, held-out sample, configs, card and stats."""
SAFETENSORS_HEADER_BYTES_PER_TENSOR = 160
"""Generous per-tensor estimate of the safetensors JSON header (per-expert tensors are many)."""
CHANCE_NOTE = "chance = k/E"

_T0 = time.time()


def log(message: str) -> None:
    """Progress line with wall-clock offset; flushed so remote runs show it live."""
    print(f"[{time.time() - _T0:7.1f}s] {message}", flush=True)


# ---------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """Architecture of the demo model; every field maps 1:1 onto Qwen3MoeConfig."""

    vocab_size: int = 8192
    hidden_size: int = 128
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    num_experts: int = 128
    top_k: int = 8
    moe_intermediate_size: int = 48
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    def param_counts(self) -> dict[str, int]:
        """Exact parameter counts by group (untied embeddings, all layers sparse)."""
        h, hd = self.hidden_size, self.head_dim
        attn = h * self.num_heads * hd * 2 + h * self.num_kv_heads * hd * 2 + 2 * hd
        norms = 2 * h
        router = self.num_experts * h
        one_expert = 3 * h * self.moe_intermediate_size
        per_layer = attn + norms + router + self.num_experts * one_expert
        embed = self.vocab_size * h
        total = 2 * embed + self.num_layers * per_layer + h
        inactive = self.num_layers * (self.num_experts - self.top_k) * one_expert
        return {
            "total": total,
            "active_per_token": total - inactive,
            "active_per_token_excluding_embeddings": total - inactive - 2 * embed,
            "embedding_and_lm_head": 2 * embed,
            "attention_per_layer": attn,
            "router_per_layer": router,
            "one_expert": one_expert,
            "experts_per_layer": self.num_experts * one_expert,
        }

    def num_tensors(self) -> int:
        """Tensors in the saved checkpoint (per-expert layout)."""
        per_layer = 4 + 2 + 2 + 1 + 3 * self.num_experts  # q,k,v,o + q/k norm + 2 norms + router + experts
        return 2 + 1 + self.num_layers * per_layer

    def weight_file_bytes(self) -> int:
        """Estimated size of model.safetensors in bf16 (exact tensor bytes + header estimate)."""
        return 2 * self.param_counts()["total"] + SAFETENSORS_HEADER_BYTES_PER_TENSOR * self.num_tensors()

    def check_budget(self) -> int:
        """Refuse shapes whose files could not ship within SIZE_BUDGET_BYTES; returns the estimate."""
        estimate = self.weight_file_bytes() + NON_WEIGHT_RESERVE_BYTES
        if estimate > SIZE_BUDGET_BYTES:
            raise SystemExit(
                f"shape {self} needs ~{estimate / 1e6:.2f} MB (weights {self.weight_file_bytes() / 1e6:.2f} MB + "
                f"{NON_WEIGHT_RESERVE_BYTES / 1e6:.1f} MB other files) > budget {SIZE_BUDGET_BYTES / 1e6:.0f} MB"
            )
        if self.num_heads % self.num_kv_heads:
            raise SystemExit("num_heads must be a multiple of num_kv_heads")
        # grouped GEMM kernels want 16-byte aligned rows in bf16
        if self.hidden_size % 8 or self.moe_intermediate_size % 8:
            raise SystemExit("hidden_size and moe_intermediate_size must be multiples of 8")
        return estimate


@dataclass(frozen=True)
class CorpusSettings:
    """Deterministic corpus recipe (recorded verbatim in the model card)."""

    max_total_bytes: int = 150_000_000
    heldout_permille: int = 20
    min_file_bytes: int = 256
    max_file_bytes: int = 200_000
    max_line_chars: int = 1000
    tokenizer_train_bytes: int = 40_000_000
    sample_target_bytes: int = 250_000
    sample_max_bytes: int = 300_000
    sample_max_file_bytes: int = 40_000
    excluded_dir_names: tuple[str, ...] = (
        "__pycache__",
        "test",
        "tests",
        "idle_test",
        "site-packages",
        "dist-packages",
    )


@dataclass(frozen=True)
class TrainSettings:
    """Optimization settings.  Steps are derived from the wall-clock budget unless max_steps is set."""

    seed: int = 1234
    minutes: float = 10.0
    total_minutes: float | None = None
    final_reserve_s: float = 90.0
    seq_len: int = 1024
    batch_seqs: int = 64
    micro_batch_seqs: int = 32  # for the dense/loop expert kernels; grouped runs the whole batch at once
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 150
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    router_aux_loss_coef: float = 0.01
    init_std: float = 0.02
    max_steps: int | None = None
    eval_windows: int = 48
    evals_per_run: int = 20
    patience: int = 5
    min_delta: float = 0.002
    log_every: int = 25
    experts_impl: str = "auto"


# ---------------------------------------------------------------------------------------------
# Corpus
# ---------------------------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--out", type=Path, default=Path("moestream/demo_model"), help="output directory (replaced atomically)"
    )
    p.add_argument("--minutes", type=float, default=10.0, help="wall-clock budget of the training loop")
    p.add_argument(
        "--total-minutes", type=float, default=None, help="cap for the whole run; shrinks the training budget"
    )
    p.add_argument("--aux-coef", type=float, default=None, help="load-balancing loss coefficient (default 0.01)")
    p.add_argument("--smoke", action="store_true", help="tiny corpus and few steps: end-to-end pipeline test (CPU OK)")
    p.add_argument("--device", default=None, help="cuda / cpu (default: cuda if available)")
    p.add_argument("--seed", type=int, default=TrainSettings.seed)
    p.add_argument("--max-steps", type=int, default=None, help="fixed step count instead of the time-derived one")
    p.add_argument("--experts-impl", choices=("auto", "grouped", "dense", "loop"), default="auto")
    p.add_argument("--corpus-mb", type=float, default=None, help="override the corpus byte cap")
    return p.parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> tuple[ModelShape, CorpusSettings, TrainSettings]:
    shape = ModelShape()
    corpus = CorpusSettings()
    train_settings = TrainSettings(
        seed=args.seed,
        minutes=args.minutes,
        total_minutes=args.total_minutes,
        max_steps=args.max_steps,
        experts_impl=args.experts_impl,
    )
    if args.aux_coef is not None:
        train_settings = dataclasses.replace(train_settings, router_aux_loss_coef=args.aux_coef)
    if args.smoke:
        corpus = dataclasses.replace(
            corpus,
            max_total_bytes=2_000_000,
            tokenizer_train_bytes=2_000_000,
            sample_target_bytes=6_000,
            sample_max_bytes=8_000,
            sample_max_file_bytes=4_000,
            heldout_permille=50,
        )
        train_settings = dataclasses.replace(
            train_settings,
            seq_len=128,
            batch_seqs=4,
            micro_batch_seqs=4,
            max_steps=args.max_steps or 12,
            warmup_steps=3,
            eval_windows=2,
            evals_per_run=2,
            log_every=4,
            final_reserve_s=0.0,
        )
    if args.corpus_mb is not None:
        corpus = dataclasses.replace(corpus, max_total_bytes=int(args.corpus_mb * 1e6))
    return shape, corpus, train_settings


def training_budget_s(settings: TrainSettings) -> float:
    """--minutes, shrunk so that --total-minutes (if given) still leaves time to export and evaluate."""
    budget = settings.minutes * 60
    if settings.total_minutes is not None:
        budget = min(budget, settings.total_minutes * 60 - (time.time() - _T0) - settings.final_reserve_s)
    if budget < 30:
        raise SystemExit(f"only {budget:.0f}s left for training; raise --total-minutes")
    return budget


def hardware_info(device: torch.device) -> dict[str, str]:
    import transformers

    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    )
    return {
        "device": name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
