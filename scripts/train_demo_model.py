#!/usr/bin/env python3
"""Train the small demo Mixture-of-Experts model that ships inside moestream.

Why this exists: moestream needs a default model that is small enough to ship in the
repository (<= 36 MB on disk) yet *really trained*, so that its expert routing has
the structure real MoE models show (skewed expert popularity, strong token-to-token
reuse).  Caching and approximate modes are only meaningful against such a model, and
its held-out perplexity is the yardstick for their quality.

What it does, end to end (one command, deterministic recipe, seeded):

1. corpus: Python sources of this machine's standard library and site-packages,
   filtered, de-duplicated by content hash, capped, and split train / held-out by a
   seeded hash of each file's relative path;
2. tokenizer: a byte-level BPE (``tokenizers``) trained on the train split;
3. pre-tokenizes everything once (the ``tokenizers`` batch encoder uses all cores);
4. trains a ``qwen3_moe``-architecture model (128 experts, top-8, normalized top-k
   routing like Qwen3-30B-A3B) with a plain-torch module whose parameter names,
   layout and math are exactly those of ``transformers.Qwen3MoeForCausalLM``, so the
   fast training kernels (grouped GEMM / dense expert GEMMs) can be chosen freely;
5. exports through ``Qwen3MoeForCausalLM.save_pretrained`` (bf16, per-expert tensors),
   reloads the saved directory with transformers and checks the logits against the
   training module;
6. evaluates the *saved* bf16 weights upcast to fp32: sliding-window perplexity on
   ``heldout_sample.txt`` (``scripts/demo_perplexity.py``) and per-layer routing
   statistics, then writes ``MODEL_CARD.md`` and ``training_stats.json``.

Everything is written to a hidden temp directory next to ``--out`` and renamed into
place at the end, so a crash never leaves a half-written model behind.

Reproduce the shipped model (one H100):  see scripts/README.md.
Smoke test of the whole pipeline on CPU: ``python3 scripts/train_demo_model.py --smoke --out /tmp/demo_smoke``
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import platform
import random
import shutil
import site
import sys
import sysconfig
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")  # batch encoding on all cores
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never wait on a network call

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_perplexity import sliding_window_perplexity  # noqa: E402

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


@dataclass(frozen=True)
class Document:
    relpath: str
    text: str
    sha256: str


@dataclass
class Corpus:
    train: list[Document]
    heldout: list[Document]
    stats: dict[str, Any]


def stable_hash(seed: int, purpose: str, key: str) -> int:
    """Seeded 64-bit hash: the same file lands in the same split / order on every machine."""
    digest = hashlib.sha256(f"{seed}|{purpose}|{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def discover_roots() -> list[tuple[str, Path]]:
    """The standard library plus every site-packages directory this interpreter uses."""
    paths = sysconfig.get_paths()
    site_dirs = {Path(paths["purelib"]).resolve(), Path(paths["platlib"]).resolve()}
    if hasattr(site, "getsitepackages"):
        site_dirs.update(Path(p).resolve() for p in site.getsitepackages())
    roots = [("stdlib", Path(paths["stdlib"]).resolve())]
    roots += [("site", p) for p in sorted(site_dirs) if p.is_dir()]
    return roots


def list_candidates(roots: Sequence[tuple[str, Path]], settings: CorpusSettings) -> list[tuple[str, Path, int]]:
    """(relpath, path, size) of every .py file within the size limits, sorted by relpath.

    Test directories are skipped: they are full of fixtures and deliberately odd code,
    which makes them a poor sample of "ordinary" Python.  Nested roots (site-packages
    inside the stdlib directory of a pyenv/venv install) are walked only once.
    """
    root_paths = {path for _, path in roots}
    excluded = set(settings.excluded_dir_names)
    found: dict[str, tuple[str, Path, int]] = {}
    for label, root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            here = Path(dirpath)
            dirnames[:] = sorted(
                d for d in dirnames if d not in excluded and not d.startswith(".") and (here / d) not in root_paths
            )
            for name in sorted(filenames):
                if not name.endswith(".py"):
                    continue
                path = here / name
                try:
                    size = path.stat().st_size
                except OSError:
                    continue
                if settings.min_file_bytes <= size <= settings.max_file_bytes:
                    relpath = f"{label}/{path.relative_to(root).as_posix()}"
                    found.setdefault(relpath, (relpath, path, size))
    return [found[k] for k in sorted(found)]


def read_python_text(path: Path, settings: CorpusSettings) -> tuple[str | None, str]:
    """File text, or None with the reason it is unusable as training data."""
    try:
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None, "not utf-8"
    if "\x00" in text:
        return None, "nul byte"
    if EOS_TOKEN in text:
        return None, "contains EOS string"  # would be read as a document boundary
    if max((len(line) for line in text.splitlines()), default=0) > settings.max_line_chars:
        return None, "long line (generated/data file)"
    if not text.strip():
        return None, "empty"
    return text, "ok"


def load_corpus(settings: CorpusSettings, seed: int) -> Corpus:
    """Read files in seeded-hash order until the byte cap; de-duplicate; split by path hash.

    Reading in hash order (instead of reading everything and then sampling) keeps the
    corpus a uniform sample of all packages while touching only as many files as needed.
    """
    roots = discover_roots()
    candidates = list_candidates(roots, settings)
    candidates.sort(key=lambda c: (stable_hash(seed, "order", c[0]), c[0]))
    seen: set[str] = set()
    reasons: Counter[str] = Counter()
    train: list[Document] = []
    heldout: list[Document] = []
    total = 0
    for relpath, path, _size in candidates:
        if total >= settings.max_total_bytes:
            break
        text, reason = read_python_text(path, settings)
        if text is None:
            reasons[reason] += 1
            continue
        digest = hashlib.sha256(text.encode()).hexdigest()
        if digest in seen:
            reasons["duplicate content"] += 1
            continue
        seen.add(digest)
        doc = Document(relpath, text, digest)
        is_heldout = stable_hash(seed, "split", relpath) % 1000 < settings.heldout_permille
        (heldout if is_heldout else train).append(doc)
        total += len(text.encode())
    fingerprint = hashlib.sha256()
    for doc in train + heldout:
        fingerprint.update(f"{doc.relpath}\0{doc.sha256}\n".encode())
    stats = {
        "roots": [f"{label}: {path}" for label, path in roots],
        "candidate_files": len(candidates),
        "train_files": len(train),
        "heldout_files": len(heldout),
        "train_bytes": sum(len(d.text.encode()) for d in train),
        "heldout_bytes": sum(len(d.text.encode()) for d in heldout),
        "rejected": dict(sorted(reasons.items())),
        "fingerprint_sha256": fingerprint.hexdigest(),
        "python": platform.python_version(),
    }
    return Corpus(train, heldout, stats)


def build_heldout_sample(heldout: Sequence[Document], settings: CorpusSettings) -> tuple[str, list[str]]:
    """Concatenate held-out files (each followed by the EOS string) into the evaluation sample.

    Files keep the corpus' seeded-hash order; files larger than sample_max_file_bytes
    are skipped so the sample covers many packages.  The EOS string is a special token,
    so the sample tokenizes exactly like the training stream (docs separated by EOS).
    """
    parts: list[str] = []
    names: list[str] = []
    total = 0
    for doc in heldout:
        piece = doc.text + EOS_TOKEN
        size = len(piece.encode())
        if size > settings.sample_max_file_bytes or total + size > settings.sample_max_bytes:
            continue
        parts.append(piece)
        names.append(doc.relpath)
        total += size
        if total >= settings.sample_target_bytes:
            break
    return "".join(parts), names


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """Byte-level BPE (GPT-2 style pre-tokenization, no BOS, no prefix space), EOS = id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(texts), trainer=trainer)
    return tokenizer


def tokenizer_training_texts(train: Sequence[Document], max_bytes: int) -> list[str]:
    """A prefix (in seeded-hash order, i.e. a uniform sample) of the train split."""
    texts: list[str] = []
    total = 0
    for doc in train:
        if total >= max_bytes:
            break
        texts.append(doc.text)
        total += len(doc.text.encode())
    return texts


def wrap_hf_tokenizer(tokenizer, max_length: int):
    """transformers view of the tokenizer; saved as tokenizer.json + tokenizer_config.json."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )


_ENCODE_SHARED: dict[str, Any] = {}
"""Texts and tokenizer JSON handed to forked encoder processes (inherited, not pickled)."""
ENCODE_SHARD_DOCS = 256


def _encoder_process_init() -> None:
    # The parent's rayon pool has no threads after fork: encode serially in each process.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _encode_shard(bounds: tuple[int, int]) -> list[np.ndarray]:
    from tokenizers import Tokenizer

    if "tokenizer" not in _ENCODE_SHARED:
        _ENCODE_SHARED["tokenizer"] = Tokenizer.from_str(_ENCODE_SHARED["json"])
    texts = _ENCODE_SHARED["texts"][bounds[0] : bounds[1]]
    encodings = _ENCODE_SHARED["tokenizer"].encode_batch(texts, add_special_tokens=False)
    return [np.asarray(enc.ids, dtype=np.uint16) for enc in encodings]


def encode_texts(tokenizer, texts: list[str]) -> list[np.ndarray]:
    """Token ids of each text, using every CPU core.

    One process per core over shards of documents: measured here, the tokenizers batch
    encoder's own thread pool barely scaled on this corpus, while processes scale
    linearly.  Falls back to in-process batch encoding where fork is unavailable or
    CUDA is already initialized (forking then is unsafe).
    """
    import multiprocessing

    workers = min(os.cpu_count() or 1, max(1, len(texts) // ENCODE_SHARD_DOCS))
    can_fork = "fork" in multiprocessing.get_all_start_methods() and not torch.cuda.is_initialized()
    if workers < 2 or not can_fork:
        encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
        return [np.asarray(enc.ids, dtype=np.uint16) for enc in encode(texts, add_special_tokens=False)]
    shards = [(i, min(i + ENCODE_SHARD_DOCS, len(texts))) for i in range(0, len(texts), ENCODE_SHARD_DOCS)]
    _ENCODE_SHARED.update(json=tokenizer.to_str(), texts=texts)
    try:
        with multiprocessing.get_context("fork").Pool(workers, initializer=_encoder_process_init) as pool:
            parts = pool.map(_encode_shard, shards, chunksize=1)
    finally:
        _ENCODE_SHARED.clear()
    return [ids for part in parts for ids in part]


def encode_documents(tokenizer, docs: Sequence[Document], eos_id: int) -> np.ndarray:
    """One uint16 token stream: doc, EOS, doc, EOS, ... (document order preserved)."""
    eos = np.array([eos_id], dtype=np.uint16)
    pieces: list[np.ndarray] = []
    for ids in encode_texts(tokenizer, [d.text for d in docs]):
        pieces += [ids, eos]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint16)


# ---------------------------------------------------------------------------------------------
# Training module: Qwen3-MoE math and parameter names, with switchable expert kernels
# ---------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Qwen3MoeRMSNorm: normalize in fp32, cast back, then scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_tables(shape: ModelShape, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (positions x head_dim, fp32) of Qwen3's default rotary embedding."""
    dim = shape.head_dim
    inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))
    positions = torch.arange(shape.max_position_embeddings, dtype=torch.float, device=device)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """Qwen3 attention: per-head q/k RMSNorm before RoPE, GQA, causal SDPA."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        h, hd = shape.hidden_size, shape.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, hd
        self.q_proj = nn.Linear(h, shape.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, shape.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, shape.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(shape.num_heads * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, shape.rms_norm_eps)
        self.k_norm = RMSNorm(hd, shape.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(rep, dim=1)  # same head mapping as transformers' repeat_kv
        v = v.repeat_interleave(rep, dim=1)
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class Router(nn.Module):
    """Holds the router weight under the transformers name ``mlp.gate.weight``."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(shape.num_experts, shape.hidden_size))


class Experts(nn.Module):
    """Expert weights in transformers' fused in-memory layout.

    gate_up_proj: (E, 2I, H) with the gate rows first; down_proj: (E, H, I).
    save_pretrained splits them into per-expert gate/up/down tensors.
    """

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        e, h, i = shape.num_experts, shape.hidden_size, shape.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))


ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def experts_loop(
    x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Reference: transformers' eager per-expert loop (slow; used to validate the fast paths)."""
    out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float32, device=x.device)
    inter = down.shape[2]
    for e in torch.unique(idx).tolist():
        token, slot = torch.where(idx == e)
        h = F.linear(x[token], gate_up[e])
        y = F.linear(F.silu(h[:, :inter]) * h[:, inter:], down[e])
        out.index_add_(0, token, y.float() * w[token, slot, None].float())
    return out.to(x.dtype)


def experts_dense(
    x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Every expert on every token, unselected experts weighted by exactly zero.

    Same math as the sparse loop (the routing weight is applied before the linear down
    projection instead of after it), built from two large ordinary GEMMs: 16x the expert
    FLOPs, but no data-dependent shapes, so it is a robust fallback and fast on CPU.
    """
    n, hidden = x.shape
    e, two_i, _ = gate_up.shape
    inter = two_i // 2
    dense_w = torch.zeros(n, e, dtype=w.dtype, device=w.device).scatter(1, idx, w)
    h = F.linear(x, gate_up.reshape(e * two_i, hidden)).view(n, e, two_i)
    act = F.silu(h[..., :inter]) * h[..., inter:]
    act = act * dense_w.unsqueeze(-1).to(act.dtype)
    down_cat = down.permute(1, 0, 2).reshape(hidden, e * inter)
    return F.linear(act.reshape(n, e * inter), down_cat).to(x.dtype)


def expert_counts(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert without a host sync (CUDA bincount reads the max back to the host)."""
    flat = indices.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    fn = getattr(F, "grouped_mm", None) or torch._grouped_mm
    return fn(a, b, offs=offs)


def experts_grouped(
    x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Sparse experts with torch's grouped GEMM in bf16 (what transformers' grouped_mm path does).

    Token-expert pairs are sorted by expert, each expert multiplies only its rows,
    results are un-permuted and summed per token in fp32 (deterministic, no atomics).
    Weights are cast to bf16 here so fp32 master weights still hit the fast kernel.
    """
    n, hidden = x.shape
    k = idx.shape[1]
    e, two_i, _ = gate_up.shape
    inter = two_i // 2
    flat = idx.reshape(-1)
    sorted_experts, perm = torch.sort(flat, stable=True)
    token = perm // k
    offs = torch.cumsum(expert_counts(sorted_experts, e), 0).to(torch.int32)
    xs = x[token].to(torch.bfloat16)
    h = _grouped_mm(xs, gate_up.to(torch.bfloat16).transpose(-2, -1), offs)
    act = F.silu(h[:, :inter]) * h[:, inter:]
    y = _grouped_mm(act.contiguous(), down.to(torch.bfloat16).transpose(-2, -1), offs)
    y = y.float() * w.reshape(-1)[perm].float().unsqueeze(-1)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return y[inverse].view(n, k, hidden).sum(dim=1).to(x.dtype)


EXPERT_IMPLS: dict[str, ExpertsFn] = {"grouped": experts_grouped, "dense": experts_dense, "loop": experts_loop}


class SparseMoeBlock(nn.Module):
    """Qwen3MoeSparseMoeBlock: softmax router (fp32), top-k, renormalized weights."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.top_k = shape.top_k
        self.gate = Router(shape)
        self.experts = Experts(shape)
        self.impl = "dense"

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, hidden = x.shape
        flat = x.reshape(-1, hidden)
        with torch.autocast(x.device.type, enabled=False):
            router_logits = F.linear(flat.float(), self.gate.weight.float())
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        if torch.is_autocast_enabled(x.device.type):
            flat = flat.to(torch.get_autocast_dtype(x.device.type))
        out = EXPERT_IMPLS[self.impl](flat, top_i, top_w, self.experts.gate_up_proj, self.experts.down_proj)
        return out.view(b, t, hidden), router_logits, top_i


class DecoderLayer(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.self_attn = Attention(shape)
        self.mlp = SparseMoeBlock(shape)
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        moe_out, router_logits, top_i = self.mlp(self.post_attention_layernorm(x))
        return x + moe_out, router_logits, top_i


class Backbone(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)


@dataclass
class ForwardOutput:
    logits: torch.Tensor
    router_logits: list[torch.Tensor]
    top_indices: list[torch.Tensor]


class DemoMoeForCausalLM(nn.Module):
    """Plain-torch twin of Qwen3MoeForCausalLM: same state_dict keys, shapes and math."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.shape = shape
        self.model = Backbone(shape)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        cos, sin = rope_tables(shape, torch.device("cpu"))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def set_experts_impl(self, name: str) -> None:
        for layer in self.model.layers:
            layer.mlp.impl = name

    def forward(self, input_ids: torch.Tensor) -> ForwardOutput:
        t = input_ids.shape[1]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        x = self.model.embed_tokens(input_ids)
        router_logits, top_indices = [], []
        for layer in self.model.layers:
            x, logits, top_i = layer(x, cos, sin)
            router_logits.append(logits)
            top_indices.append(top_i)
        return ForwardOutput(self.lm_head(self.model.norm(x)), router_logits, top_indices)


def init_weights(model: DemoMoeForCausalLM, std: float) -> None:
    """Normal(0, std) like transformers; residual-output projections scaled by 1/sqrt(2 * layers)."""
    out_std = std / math.sqrt(2 * model.shape.num_layers)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.fill_(1.0)
            elif name.endswith(("o_proj.weight", "experts.down_proj")):
                param.normal_(0.0, out_std)
            else:
                param.normal_(0.0, std)


def load_balancing_loss(
    top_indices: Sequence[torch.Tensor], router_logits: Sequence[torch.Tensor], num_experts: int
) -> torch.Tensor:
    """Switch-Transformer load-balancing loss E * sum_e(f_e * P_e), per layer, averaged over layers.

    f_e = top-k assignments of expert e per token (sums to k), P_e = mean router
    probability; the loss equals k for perfectly uniform routing.  It is computed per
    MoE layer, as Switch Transformer and Megatron-LM define it.  transformers' load_balancing_loss_func
    pools f and P over all layers before multiplying, which leaves complementary
    per-layer collapse (each layer using its own few experts) unpenalized -- exactly the
    failure this demo model must avoid.  Only the gradient of P flows, as in both.
    """
    losses = []
    for top_i, logits in zip(top_indices, router_logits, strict=True):
        probs = torch.softmax(logits.float(), dim=-1)
        f = expert_counts(top_i, num_experts).float() / probs.shape[0]
        losses.append(num_experts * torch.sum(f * probs.mean(dim=0)))
    return torch.stack(losses).mean()


# ---------------------------------------------------------------------------------------------
# Expert-kernel selection
# ---------------------------------------------------------------------------------------------


def _run_experts(
    name: str, tensors: dict[str, torch.Tensor], autocast: bool
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = {k: v.detach().clone().requires_grad_(k != "idx" and v.is_floating_point()) for k, v in tensors.items()}
    device_type = leaves["x"].device.type
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
        x = leaves["x"].to(torch.bfloat16) if autocast else leaves["x"]
        out = EXPERT_IMPLS[name](x, leaves["idx"], leaves["w"], leaves["gate_up"], leaves["down"])
    out.float().pow(2).sum().backward()
    grads = [leaves[k].grad for k in ("x", "w", "gate_up", "down")]
    return out.detach().float(), grads


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / (b.float().norm() + 1e-12))


def random_expert_problem(shape: ModelShape, tokens: int, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    e, h, i = shape.num_experts, shape.hidden_size, shape.moe_intermediate_size
    x = torch.randn(tokens, h, generator=gen)
    logits = torch.randn(tokens, e, generator=gen) * 2.0
    top_w, idx = torch.topk(torch.softmax(logits, -1), shape.top_k, dim=-1)
    w = top_w / top_w.sum(-1, keepdim=True)
    gate_up = torch.randn(e, 2 * i, h, generator=gen) * 0.05
    down = torch.randn(e, h, i, generator=gen) * 0.05
    problem = {"x": x, "idx": idx, "w": w, "gate_up": gate_up, "down": down}
    return {k: v.to(device) for k, v in problem.items()}


def validate_expert_impls(shape: ModelShape, device: torch.device, autocast: bool) -> dict[str, Any]:
    """Check each fast path (forward and all gradients) against the eager reference loop."""
    problem = random_expert_problem(shape, tokens=512, device=device, seed=0)
    ref_out, ref_grads = _run_experts("loop", problem, autocast=False)
    report: dict[str, Any] = {}
    for name in ("grouped", "dense"):
        try:
            out, grads = _run_experts(name, problem, autocast=autocast or name == "grouped")
        except (RuntimeError, NotImplementedError, TypeError, AttributeError) as exc:  # kernel unavailable
            report[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        errors = [_rel_err(out, ref_out)] + [_rel_err(g, r) for g, r in zip(grads, ref_grads, strict=True)]
        report[name] = {"ok": max(errors) < 0.05, "max_rel_err": max(errors)}
    return report


def time_expert_impl(
    name: str, shape: ModelShape, tokens: int, device: torch.device, autocast: bool, reps: int = 3
) -> float:
    """Seconds per forward+backward of one MoE layer at the training micro-batch size."""
    problem = random_expert_problem(shape, tokens=tokens, device=device, seed=1)
    _run_experts(name, problem, autocast)  # warm-up (kernel selection, allocator)
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        _run_experts(name, problem, autocast)
    sync(device)
    return (time.perf_counter() - start) / reps


def choose_experts_impl(
    requested: str, shape: ModelShape, tokens: int, device: torch.device, autocast: bool
) -> tuple[str, dict[str, Any]]:
    """Validated and fastest expert kernel ('auto'), or the requested one after validation."""
    report = validate_expert_impls(shape, device, autocast)
    log(f"expert kernel validation vs eager loop: {report}")
    usable = [name for name in ("grouped", "dense") if report[name]["ok"]]
    if requested != "auto":
        if requested != "loop" and requested not in usable:
            raise SystemExit(f"experts impl {requested!r} failed validation: {report[requested]}")
        return requested, report
    if not usable:
        log("WARNING: no fast expert kernel validated; falling back to the slow eager loop")
        return "loop", report
    timings = {name: time_expert_impl(name, shape, tokens, device, autocast) for name in usable}
    report["timings_s_per_layer_fwd_bwd"] = timings
    choice = min(timings, key=timings.get)
    log(f"expert kernel timings (s per layer fwd+bwd, {tokens} tokens): {timings} -> {choice}")
    return choice, report


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class WindowSampler:
    """Epoch-shuffled, non-overlapping windows of seq_len + 1 tokens over the train stream.

    Each epoch shifts the window grid by a seeded random offset, so later epochs see
    different boundaries; the order is seeded per epoch, hence reproducible.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, seed: int) -> None:
        if tokens.numel() < 2 * (seq_len + 1):
            raise SystemExit(f"train stream too short ({tokens.numel()} tokens) for seq_len {seq_len}")
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.epoch = -1
        self.tokens_seen = 0
        self._order: torch.Tensor = torch.empty(0, dtype=torch.long)
        self._pos = 0
        self._offsets = torch.arange(seq_len + 1, device=tokens.device)

    def _new_epoch(self) -> None:
        self.epoch += 1
        gen = torch.Generator().manual_seed(self.seed * 1000 + self.epoch)
        offset = int(torch.randint(0, self.seq_len, (1,), generator=gen)) if self.epoch else 0
        count = (self.tokens.numel() - offset - 1) // self.seq_len
        starts = offset + torch.arange(count) * self.seq_len
        self._order = starts[torch.randperm(count, generator=gen)].to(self.tokens.device)
        self._pos = 0

    def next(self, batch: int) -> torch.Tensor:
        if self._pos + batch > self._order.numel():
            self._new_epoch()
        starts = self._order[self._pos : self._pos + batch]
        self._pos += batch
        self.tokens_seen += batch * self.seq_len
        return self.tokens[starts[:, None] + self._offsets].long()

    @property
    def epochs_done(self) -> float:
        per_epoch = max(1, (self.tokens.numel() - 1) // self.seq_len)
        return self.epoch + self._pos / per_epoch


def lr_at(step: int, total_steps: int, settings: TrainSettings, warmup: int) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio * lr at total_steps."""
    if step < warmup:
        return settings.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return settings.lr * (settings.min_lr_ratio + (1 - settings.min_lr_ratio) * cosine)


def make_optimizer(model: nn.Module, settings: TrainSettings, device: torch.device) -> torch.optim.Optimizer:
    """AdamW; no weight decay on norm scales (1-D parameters)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    extra = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=settings.lr, betas=(settings.beta1, settings.beta2), **extra)


def compute_losses(model: DemoMoeForCausalLM, batch: torch.Tensor, autocast: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean next-token cross-entropy, load-balancing aux loss) of a (B, T+1) token batch."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    with torch.autocast(batch.device.type, dtype=torch.bfloat16, enabled=autocast):
        out = model(inputs)
    ce = F.cross_entropy(out.logits.float().reshape(-1, out.logits.shape[-1]), targets.reshape(-1))
    aux = load_balancing_loss(out.top_indices, out.router_logits, model.shape.num_experts)
    return ce, aux


@torch.no_grad()
def heldout_loss(model: DemoMoeForCausalLM, windows: torch.Tensor, micro: int, autocast: bool) -> float:
    """Mean next-token loss over fixed held-out windows (the early-stopping signal)."""
    model.eval()
    total = 0.0
    for start in range(0, windows.shape[0], micro):
        ce, _ = compute_losses(model, windows[start : start + micro], autocast)
        total += float(ce) * windows[start : start + micro].shape[0]
    model.train()
    return total / windows.shape[0]


@dataclass
class TrainResult:
    best_state: dict[str, torch.Tensor]
    best_step: int
    best_heldout_loss: float
    steps: int
    tokens: int
    epochs: float
    seconds: float
    stop_reason: str
    curve: list[dict[str, float]] = field(default_factory=list)


def heldout_windows(tokens: np.ndarray, seq_len: int, count: int, device: torch.device) -> torch.Tensor:
    """`count` windows of seq_len + 1 tokens spread evenly over the held-out stream (fixed for the run)."""
    usable = min(count, (len(tokens) - 1) // seq_len)
    if usable < 1:
        raise SystemExit("held-out split too small for one evaluation window")
    t = torch.from_numpy(tokens.astype(np.int64))
    starts = torch.linspace(0, len(tokens) - seq_len - 1, usable).long()
    return t[starts[:, None] + torch.arange(seq_len + 1)].to(device)


@dataclass
class StepPlan:
    """Total steps, warm-up and evaluation interval.

    With --max-steps they are fixed.  Otherwise the total is first estimated after
    CALIBRATION_STEPS and re-estimated at every evaluation from the throughput measured
    so far, so that the cosine schedule ends when the wall-clock budget does.
    """

    total: int
    warmup: int
    eval_every: int | None

    CALIBRATION_STEPS = 30

    @classmethod
    def initial(cls, settings: TrainSettings) -> StepPlan:
        if settings.max_steps:
            warmup = min(settings.warmup_steps, max(1, settings.max_steps // 5))
            return cls(settings.max_steps, warmup, max(1, settings.max_steps // settings.evals_per_run))
        return cls(10**9, settings.warmup_steps, None)  # no evaluation before calibration

    def replan(self, step: int, elapsed: float, budget_s: float, settings: TrainSettings) -> None:
        if settings.max_steps or step < self.CALIBRATION_STEPS or step >= self.total:
            return  # fixed plan, too early to measure, or the schedule has already ended
        first = self.eval_every is None
        self.total = max(step + 1, int(step * budget_s / elapsed * (0.97 if first else 1.0)))
        if first:
            self.eval_every = max(25, self.total // settings.evals_per_run)
            self.warmup = min(settings.warmup_steps, max(1, self.total // 10))


def cpu_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def train(
    model: DemoMoeForCausalLM,
    train_tokens: np.ndarray,
    heldout_tokens: np.ndarray,
    settings: TrainSettings,
    device: torch.device,
    budget_s: float,
) -> TrainResult:
    """AdamW + warm-up/cosine under a wall-clock budget, keeping the best held-out weights.

    Stops at the step plan's end, at the time budget, or early when the held-out loss
    has not improved by min_delta for `patience` evaluations (levelled off / overfitting
    on repeated epochs).
    """
    autocast = device.type == "cuda"
    sampler = WindowSampler(torch.from_numpy(train_tokens.astype(np.int32)).to(device), settings.seq_len, settings.seed)
    eval_set = heldout_windows(heldout_tokens, settings.seq_len, settings.eval_windows, device)
    optimizer = make_optimizer(model, settings, device)
    accum = max(1, settings.batch_seqs // settings.micro_batch_seqs)
    micro = settings.batch_seqs // accum
    plan = StepPlan.initial(settings)
    start = time.time()
    best_loss, best_step, best_state, stale = float("inf"), 0, None, 0
    curve: list[dict[str, float]] = []
    running, running_n = torch.zeros(2, device=device), 0
    stop_reason = "planned steps done"
    step = 0
    model.train()
    while step < plan.total:
        lr = lr_at(step, plan.total, settings, plan.warmup)
        for group in optimizer.param_groups:
            group["lr"] = lr
        for _ in range(accum):
            ce, aux = compute_losses(model, sampler.next(micro), autocast)
            ((ce + settings.router_aux_loss_coef * aux) / accum).backward()
            running += torch.stack([ce.detach(), aux.detach()]) / accum
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        running_n += 1
        elapsed = time.time() - start
        if step == StepPlan.CALIBRATION_STEPS and plan.eval_every is None:
            plan.replan(step, elapsed, budget_s, settings)
            log(
                f"throughput {sampler.tokens_seen / elapsed:,.0f} tok/s -> planning {plan.total} steps, eval every {plan.eval_every}"
            )
        if step % settings.log_every == 0 or step == plan.total:
            ce_avg, aux_avg = (running / running_n).tolist()
            log(
                f"step {step}/{plan.total} loss {ce_avg:.4f} aux/k {aux_avg / model.shape.top_k:.4f} "
                f"lr {lr:.2e} tok {sampler.tokens_seen:,} ({sampler.epochs_done:.2f} ep) "
                f"{sampler.tokens_seen / elapsed:,.0f} tok/s"
            )
            running.zero_()
            running_n = 0
        out_of_time = elapsed >= budget_s
        if plan.eval_every and (step % plan.eval_every == 0 or step == plan.total or out_of_time):
            loss = heldout_loss(model, eval_set, micro, autocast)
            curve.append(
                {"step": step, "tokens": sampler.tokens_seen, "seconds": round(elapsed, 1), "heldout_loss": loss}
            )
            stale = 0 if loss < best_loss - settings.min_delta else stale + 1
            if loss < best_loss:
                best_loss, best_step, best_state = loss, step, cpu_state(model)
            log(
                f"eval step {step}: held-out loss {loss:.4f} (ppl {math.exp(loss):.2f}) best {best_loss:.4f} @ {best_step}"
            )
            plan.replan(step, time.time() - start, budget_s, settings)
            if stale >= settings.patience and step > plan.warmup:
                stop_reason = (
                    f"held-out loss levelled off (no gain > {settings.min_delta} in {settings.patience} evals)"
                )
                break
        if out_of_time:
            stop_reason = "time budget"
            break
    if best_state is None:  # stopped before the first evaluation
        best_loss, best_step, best_state = heldout_loss(model, eval_set, micro, autocast), step, cpu_state(model)
    return TrainResult(
        best_state,
        best_step,
        best_loss,
        step,
        sampler.tokens_seen,
        sampler.epochs_done,
        time.time() - start,
        stop_reason,
        curve,
    )


# ---------------------------------------------------------------------------------------------
# Export and verification through transformers
# ---------------------------------------------------------------------------------------------


def hf_config(shape: ModelShape, eos_id: int, aux_coef: float):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.moe_intermediate_size * shape.top_k,  # unused: every layer is sparse
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        hidden_act="silu",
        max_position_embeddings=shape.max_position_embeddings,
        initializer_range=0.02,
        rms_norm_eps=shape.rms_norm_eps,
        use_cache=True,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        attention_bias=False,
        use_sliding_window=False,
        attention_dropout=0.0,
        decoder_sparse_step=1,
        moe_intermediate_size=shape.moe_intermediate_size,
        num_experts_per_tok=shape.top_k,
        num_experts=shape.num_experts,
        norm_topk_prob=True,
        output_router_logits=False,
        router_aux_loss_coef=aux_coef,
        mlp_only_layers=[],
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=None,
    )


def expected_checkpoint_keys(shape: ModelShape) -> set[str]:
    """Key names of a per-expert Qwen3-MoE checkpoint (the Hugging Face hub layout)."""
    keys = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for layer in range(shape.num_layers):
        p = f"model.layers.{layer}"
        keys |= {f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight", f"{p}.mlp.gate.weight"}
        keys |= {f"{p}.self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
        for e in range(shape.num_experts):
            keys |= {f"{p}.mlp.experts.{e}.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
    return keys


def export_model(
    state: dict[str, torch.Tensor], shape: ModelShape, eos_id: int, aux_coef: float, out_dir: Path
) -> None:
    """bf16 weights via Qwen3MoeForCausalLM.save_pretrained (which writes per-expert tensors)."""
    from transformers import GenerationConfig, Qwen3MoeForCausalLM

    config = hf_config(shape, eos_id, aux_coef)
    hf = Qwen3MoeForCausalLM(config)
    hf.load_state_dict(state, strict=True)
    hf.to(torch.bfloat16)
    hf.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=eos_id, pad_token_id=eos_id)
    hf.save_pretrained(out_dir)
    verify_checkpoint_keys(out_dir / "model.safetensors", shape)


def verify_checkpoint_keys(path: Path, shape: ModelShape) -> None:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        dtypes = {f.get_slice(k).get_dtype() for k in keys}
    expected = expected_checkpoint_keys(shape)
    if keys != expected:
        missing, extra = sorted(expected - keys)[:5], sorted(keys - expected)[:5]
        raise RuntimeError(f"unexpected checkpoint layout: missing {missing} extra {extra}")
    if dtypes != {"BF16"}:
        raise RuntimeError(f"checkpoint dtypes {dtypes}, expected only BF16")
    log(f"checkpoint layout verified: {len(keys)} tensors, per-expert gate/up/down, bf16")


def load_saved_model(model_dir: Path, device: torch.device):
    """The saved bf16 checkpoint, upcast to fp32, through transformers' reference (eager) experts."""
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32, experts_implementation="eager")
    return model.to(device).eval()


def saved_weights_as_training_state(hf_model) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu() for k, v in hf_model.state_dict().items()}


@torch.no_grad()
def verify_against_training_module(hf_model, shape: ModelShape, ids: Sequence[int], device: torch.device) -> float:
    """Max |logit difference| between transformers and the training module on the same fp32 weights.

    Proves the training module's math and parameter layout are those of Qwen3MoeForCausalLM.
    """
    twin = DemoMoeForCausalLM(shape)
    twin.load_state_dict(saved_weights_as_training_state(hf_model), strict=True)
    twin.to(device).eval()
    twin.set_experts_impl("loop")
    x = torch.tensor([list(ids)], device=device)
    ours = twin(x).logits.float()
    theirs = hf_model(input_ids=x).logits.float()
    diff = float((ours - theirs).abs().max())
    scale = float(theirs.abs().max())
    if diff > 1e-3 * max(1.0, scale):
        raise RuntimeError(f"training module and transformers disagree: max |dlogit| {diff:.3e} (scale {scale:.1f})")
    log(f"transformers vs training module (fp32, {len(ids)} tokens): max |dlogit| {diff:.2e}")
    return diff


def verify_tokenizer(model_dir: Path, eos_id: int, probe: str) -> dict[str, Any]:
    """AutoTokenizer loads the saved files, adds no BOS/EOS, and round-trips text losslessly."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(probe, add_special_tokens=True).input_ids
    plain = tok(probe, add_special_tokens=False).input_ids
    if ids != plain:
        raise RuntimeError("tokenizer adds special tokens; expected a BOS-free tokenizer")
    if tok.eos_token_id != eos_id or tok.eos_token != EOS_TOKEN:
        raise RuntimeError(f"tokenizer eos {tok.eos_token!r}/{tok.eos_token_id} != {EOS_TOKEN!r}/{eos_id}")
    if tok.decode(plain) != probe:
        raise RuntimeError("tokenizer does not round-trip text")
    log(
        f"AutoTokenizer verified: {type(tok).__name__}, vocab {len(tok)}, {len(probe.encode()) / len(plain):.2f} bytes/token"
    )
    return {"class": type(tok).__name__, "vocab": len(tok), "bytes_per_token_probe": len(probe.encode()) / len(plain)}


# ---------------------------------------------------------------------------------------------
# Final evaluation: perplexity and routing statistics on heldout_sample.txt
# ---------------------------------------------------------------------------------------------


class RoutingRecorder:
    """model_fn for sliding_window_perplexity that also records every token's selected experts.

    Forward hooks read the router's own top-k indices (output 2 of Qwen3MoeTopKRouter),
    so the statistics describe exactly what transformers executes.  Windows start every
    `stride` tokens (the perplexity algorithm's grid); of each window only the rows of
    tokens that no earlier window covered are kept, so each layer ends up with one
    routing row per token of the sample, each computed with the same context as its score.
    """

    def __init__(self, hf_model, stride: int, device: torch.device) -> None:
        self.model, self.stride, self.device = hf_model, stride, device
        self.calls, self.covered = 0, 0
        self._captured: list[torch.Tensor] = []
        gates = [layer.mlp.gate for layer in hf_model.model.layers]
        self.segments: list[list[torch.Tensor]] = [[] for _ in gates]
        self._handles = [g.register_forward_hook(self._hook) for g in gates]

    def _hook(self, _module, _inputs, output) -> None:
        self._captured.append(output[2].detach().cpu())

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        length = input_ids.shape[1]
        end = self.calls * self.stride + length
        self._captured.clear()
        logits = self.model(input_ids=input_ids.to(self.device)).logits
        new = end - self.covered
        if not 0 < new <= length or len(self._captured) != len(self.segments):
            raise RuntimeError("RoutingRecorder called off the sliding-window grid")
        for layer, top_i in enumerate(self._captured):
            self.segments[layer].append(top_i.reshape(length, -1)[length - new :])
        self.calls, self.covered = self.calls + 1, end
        return logits

    def per_layer(self) -> list[torch.Tensor]:
        """(tokens, k) expert ids per layer for the whole sample."""
        return [torch.cat(parts) for parts in self.segments]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


RECENT_WINDOW = 16
"""Look-back of the 'recent reuse' statistic: a cache holding the last 16 tokens' experts."""


def recent_reuse(top_i: torch.Tensor, num_experts: int, lookback: int) -> tuple[float, int]:
    """Summed fraction of each token's experts used by any of the previous `lookback` tokens, and token count.

    The first `lookback` tokens of the stream (fewer predecessors) are not counted.
    """
    t = top_i.shape[0]
    if t <= lookback:
        return 0.0, 0
    used = torch.zeros(t, num_experts, dtype=torch.int32).scatter_(1, top_i, 1)
    csum = torch.cat([torch.zeros(1, num_experts, dtype=torch.int32), used.cumsum(0, dtype=torch.int32)])
    recent = (csum[lookback:t] - csum[: t - lookback]) > 0  # row j: tokens j .. j+lookback-1
    hits = recent.gather(1, top_i[lookback:]).float().mean(dim=1)
    return float(hits.sum()), t - lookback


def routing_stats(per_layer: Sequence[torch.Tensor], num_experts: int, top_k: int) -> list[dict[str, float]]:
    """Per layer, over the sample's token stream ((tokens, k) expert ids): normalized usage
    entropy, share of the top 10% experts, previous-token overlap and recent reuse."""
    top_n = max(1, math.ceil(0.1 * num_experts))
    rows = []
    for layer, top_i in enumerate(per_layer):
        counts = torch.bincount(top_i.reshape(-1), minlength=num_experts).double()
        shared = (top_i[1:, :, None] == top_i[:-1, None, :]).any(-1).sum(-1).double() / top_k
        recent_sum, recent_n = recent_reuse(top_i, num_experts, RECENT_WINDOW)
        p = counts / counts.sum()
        nz = p[p > 0]
        rows.append(
            {
                "layer": layer,
                "normalized_entropy": float(-(nz * nz.log()).sum()) / math.log(num_experts),
                "top10pct_share": float(p.sort(descending=True).values[:top_n].sum()),
                "prev_token_overlap": float(shared.mean()),
                f"reuse_within_prev_{RECENT_WINDOW}": recent_sum / max(1, recent_n),
                "unused_experts": int((counts == 0).sum()),
                "max_expert_share": float(p.max()),
            }
        )
    return rows


@torch.no_grad()
def generate_demo(hf_model, tokenizer, prompt: str, device: torch.device, new_tokens: int = 48) -> str:
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids.to(device)
    out = hf_model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    return tokenizer.decode(out[0])


def final_evaluation(model_dir: Path, shape: ModelShape, sample_text: str, device: torch.device) -> dict[str, Any]:
    """Everything the model card reports about quality, measured on the saved checkpoint."""
    from transformers import AutoTokenizer

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf_model = load_saved_model(model_dir, device)
    ids = tokenizer(sample_text, add_special_tokens=False).input_ids
    max_dlogit = verify_against_training_module(hf_model, shape, ids[:256], device)
    window = hf_model.config.max_position_embeddings
    start = time.time()
    recorder = RoutingRecorder(hf_model, window // 2, device)
    try:
        ppl, scored = sliding_window_perplexity(recorder, ids, window)
    finally:
        recorder.close()
    log(f"held-out perplexity {ppl:.3f} over {scored} tokens ({time.time() - start:.1f}s)")
    routing = recorder.per_layer()
    if any(r.shape[0] != len(ids) for r in routing):
        raise RuntimeError("routing was not recorded exactly once per token")
    stats = routing_stats(routing, shape.num_experts, shape.top_k)
    for row in stats:
        log("routing " + " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    prompt = "import os\n\n\ndef "
    try:
        sample = generate_demo(hf_model, tokenizer, prompt, device)
    except (RuntimeError, ValueError, TypeError) as exc:  # non-essential illustration only
        sample = f"(generation failed: {type(exc).__name__}: {exc})"
    return {
        "heldout_sample_tokens": len(ids),
        "heldout_sample_bytes": len(sample_text.encode()),
        "perplexity": ppl,
        "scored_tokens": scored,
        "window": window,
        "stride": window // 2,
        "eval_dtype": "float32 (saved bf16 weights upcast), transformers eager experts",
        "max_abs_logit_diff_vs_training_module": max_dlogit,
        "routing": stats,
        "greedy_sample": {"prompt": prompt, "output": sample},
    }


# ---------------------------------------------------------------------------------------------
# Model card
# ---------------------------------------------------------------------------------------------


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def write_reports(out_dir: Path, stats: dict[str, Any]) -> None:
    """training_stats.json and MODEL_CARD.md; they report the directory's file sizes, their own included,
    so rewrite until those sizes are a fixed point (two or three passes)."""
    for _ in range(5):
        before = {p.name: p.stat().st_size for p in sorted(out_dir.iterdir())}
        stats["files"] = {**before, "total_bytes": sum(before.values())}
        (out_dir / "training_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
        (out_dir / "MODEL_CARD.md").write_text(render_model_card(stats))
        if {p.name: p.stat().st_size for p in sorted(out_dir.iterdir())} == before:
            return


def render_model_card(stats: dict[str, Any]) -> str:
    """MODEL_CARD.md from the measured figures in training_stats.json (nothing hand-written)."""
    shape, params, corpus = stats["shape"], stats["parameters"], stats["corpus"]
    tr, ev, cs = stats["training"], stats["evaluation"], stats["corpus_settings"]
    k, e = shape["top_k"], shape["num_experts"]
    lines = [
        "# moestream demo MoE model",
        "",
        "A small `qwen3_moe`-architecture model trained from scratch on Python source code by",
        "`scripts/train_demo_model.py`. It ships with moestream as the default model: its routing has",
        "real structure (so expert caching matters) and its held-out perplexity is the yardstick for",
        "approximate execution modes. All figures below were measured by the training script itself.",
        "",
        f"Reproduce: `{stats['command']}`",
        "",
        "## Shape",
        "",
        "| field | value |",
        "| --- | --- |",
    ]
    lines += [f"| {key} | {value} |" for key, value in shape.items()]
    lines += [
        "| routing | softmax over experts, top-k, `norm_topk_prob=True` (Qwen3-30B-A3B style) |",
        "| attention | GQA, q/k RMSNorm, RoPE, no bias; untied embeddings |",
        "",
        f"Parameters: **{params['total']:,} total**, **{params['active_per_token']:,} active per token** "
        f"({params['active_per_token_excluding_embeddings']:,} excluding embedding and LM head); "
        f"one expert = {params['one_expert']:,} parameters ({params['one_expert'] * 2:,} bytes in bf16).",
        f"Files: {stats['files']['total_bytes'] / 1e6:.2f} MB in total "
        f"(model.safetensors {stats['files']['model.safetensors'] / 1e6:.2f} MB, bf16, per-expert tensors "
        f"`model.layers.L.mlp.experts.E.{{gate,up,down}}_proj.weight`); budget {SIZE_BUDGET_BYTES / 1e6:.0f} MB.",
        "",
        "## Data",
        "",
        f"Python {corpus['python']} standard library and site-packages of the training machine "
        f"({'; '.join(corpus['roots'])}).",
        f"Recipe: every `*.py` file of {cs['min_file_bytes']}..{cs['max_file_bytes']} bytes, skipping directories named "
        f"{', '.join('`' + d + '`' for d in cs['excluded_dir_names'])} and hidden directories; files that are not UTF-8, "
        f"contain NUL, contain the EOS string, or have a line over {cs['max_line_chars']} characters are dropped; "
        f"read in seeded-hash order of their relative path until {cs['max_total_bytes'] / 1e6:.0f} MB; exact duplicates "
        f"(SHA-256 of content) dropped; held out by file: seeded hash of the relative path mod 1000 < "
        f"{cs['heldout_permille']} ({cs['heldout_permille'] / 10:.1f}%). Documents are separated by `{EOS_TOKEN}`.",
        "",
        "| | files | bytes | tokens |",
        "| --- | --- | --- | --- |",
        f"| train | {corpus['train_files']:,} | {corpus['train_bytes']:,} | {corpus['train_tokens']:,} |",
        f"| held-out | {corpus['heldout_files']:,} | {corpus['heldout_bytes']:,} | {corpus['heldout_tokens']:,} |",
        "",
        f"Candidates {corpus['candidate_files']:,}; rejected: {corpus['rejected']}. Corpus fingerprint (SHA-256 of "
        f"relpath + content hash list): `{corpus['fingerprint_sha256'][:16]}`.",
        "",
        f"Tokenizer: byte-level BPE (`tokenizers`), vocab {stats['tokenizer']['vocab']}, trained on the first "
        f"{stats['tokenizer']['train_bytes'] / 1e6:.1f} MB of the train split, `{EOS_TOKEN}` = id {stats['eos_token_id']} "
        f"(EOS, no BOS); {corpus['train_bytes'] / corpus['train_tokens']:.2f} bytes per token on the train split.",
        "",
        "## Training",
        "",
        f"Hardware: {stats['hardware']['device']} (torch {stats['hardware']['torch']}, transformers "
        f"{stats['hardware']['transformers']}). Expert kernel for training: `{tr['experts_impl']}`.",
        f"{tr['steps']:,} steps, {tr['tokens']:,} tokens ({tr['epochs']:.2f} epochs), {tr['seconds'] / 60:.1f} min of "
        f"training ({stats['timings_s']['total'] / 60:.1f} min end to end); stop: {tr['stop_reason']}; weights kept from "
        f"step {tr['best_step']:,} (best held-out loss {tr['best_heldout_loss']:.4f}).",
        f"AdamW (betas {tr['settings']['beta1']}, {tr['settings']['beta2']}, weight decay {tr['settings']['weight_decay']}), "
        f"peak lr {tr['settings']['lr']}, linear warm-up then cosine to {tr['settings']['min_lr_ratio']}x, batch "
        f"{tr['tokens_per_step']:,} tokens of sequence length {tr['settings']['seq_len']}, {tr['precision']}, "
        f"grad clip {tr['settings']['grad_clip']}, load-balancing loss coefficient "
        f"{tr['settings']['router_aux_loss_coef']} (Switch-Transformer loss computed per layer and averaged over layers; "
        f"transformers' `load_balancing_loss_func` pools layers first), seed {tr['settings']['seed']}.",
        "",
        "## Held-out quality",
        "",
        f"Perplexity **{ev['perplexity']:.3f}** on `heldout_sample.txt` ({ev['heldout_sample_bytes']:,} bytes, "
        f"{ev['heldout_sample_tokens']:,} tokens, {ev['scored_tokens']:,} scored), sliding window "
        f"{ev['window']} / stride {ev['stride']} (`scripts/demo_perplexity.py`), {ev['eval_dtype']}.",
        f"transformers and the training module agree to {ev['max_abs_logit_diff_vs_training_module']:.1e} in logits.",
        "",
        "## Routing statistics (held-out sample)",
        "",
        f"Normalized entropy = entropy of expert usage / log {e} (1 = uniform). Top-10% share = share of all "
        f"expert activations taken by the {math.ceil(0.1 * e)} most used experts (uniform: "
        f"{math.ceil(0.1 * e) / e:.3f}). Previous-token overlap = fraction of a token's {k} experts that the "
        f"previous token also used ({CHANCE_NOTE} = {k / e:.4f}). Reuse within {RECENT_WINDOW} = fraction of a "
        f"token's experts used by any of the previous {RECENT_WINDOW} tokens (the hit rate of a cache holding "
        f"exactly the recent tokens' experts; for independent uniform routing "
        f"{1 - (1 - k / e) ** RECENT_WINDOW:.3f}).",
        "",
        f"| layer | normalized entropy | top-10% share | prev-token overlap | reuse within {RECENT_WINDOW} "
        "| max expert share | unused experts |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| {r['layer']} | {r['normalized_entropy']:.4f} | {r['top10pct_share']:.4f} | {r['prev_token_overlap']:.4f} "
        f"| {r[f'reuse_within_prev_{RECENT_WINDOW}']:.4f} | {r['max_expert_share']:.4f} | {r['unused_experts']} |"
        for r in ev["routing"]
    ]
    lines += [
        "",
        "## Held-out loss during training",
        "",
        "| step | tokens | minutes | held-out loss |",
        "| --- | --- | --- | --- |",
    ]
    lines += [
        f"| {c['step']} | {c['tokens']:,} | {c['seconds'] / 60:.1f} | {c['heldout_loss']:.4f} |" for c in tr["curve"]
    ]
    sample = ev["greedy_sample"]
    lines += ["", "## Greedy sample", "", "```python", sample["output"], "```", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Orchestration
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


def install_output(tmp_dir: Path, out_dir: Path) -> None:
    """Atomically replace out_dir by tmp_dir (same parent, so rename never copies)."""
    backup = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
    if out_dir.exists():
        out_dir.rename(backup)
    tmp_dir.rename(out_dir)
    if backup.exists():
        shutil.rmtree(backup)


@dataclass
class PreparedData:
    corpus: Corpus
    sample_text: str
    sample_files: list[str]
    tokenizer: Any  # tokenizers.Tokenizer
    tokenizer_train_bytes: int
    eos_id: int
    train_tokens: np.ndarray
    heldout_tokens: np.ndarray


def prepare_data(settings: CorpusSettings, vocab_size: int, seed: int, timings: dict[str, float]) -> PreparedData:
    """Corpus, held-out sample, tokenizer and token streams (each phase timed: they eat into the budget)."""
    t = time.time()
    corpus = load_corpus(settings, seed)
    sample_text, sample_files = build_heldout_sample(corpus.heldout, settings)
    timings["corpus"] = time.time() - t
    log(
        f"corpus: {corpus.stats['train_files']} train files ({corpus.stats['train_bytes'] / 1e6:.1f} MB), "
        f"{corpus.stats['heldout_files']} held-out ({corpus.stats['heldout_bytes'] / 1e6:.2f} MB), "
        f"sample {len(sample_text.encode()):,} bytes from {len(sample_files)} files [{timings['corpus']:.1f}s]"
    )
    t = time.time()
    tok_texts = tokenizer_training_texts(corpus.train, settings.tokenizer_train_bytes)
    tok_bytes = sum(len(x.encode()) for x in tok_texts)
    tokenizer = train_tokenizer(tok_texts, vocab_size)
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    timings["tokenizer_training"] = time.time() - t
    log(
        f"tokenizer: vocab {tokenizer.get_vocab_size()}, eos id {eos_id}, trained on {tok_bytes / 1e6:.1f} MB "
        f"[{timings['tokenizer_training']:.1f}s]"
    )
    t = time.time()
    train_tokens = encode_documents(tokenizer, corpus.train, eos_id)
    heldout_tokens = encode_documents(tokenizer, corpus.heldout, eos_id)
    timings["tokenization"] = time.time() - t
    corpus.stats.update(train_tokens=int(train_tokens.size), heldout_tokens=int(heldout_tokens.size))
    log(
        f"tokenized: {train_tokens.size:,} train tokens, {heldout_tokens.size:,} held-out tokens "
        f"[{timings['tokenization']:.1f}s]"
    )
    return PreparedData(corpus, sample_text, sample_files, tokenizer, tok_bytes, eos_id, train_tokens, heldout_tokens)


def export_and_verify(
    result: TrainResult, data: PreparedData, shape: ModelShape, settings: TrainSettings, tmp_dir: Path
) -> dict[str, Any]:
    """Write model, tokenizer and held-out sample into tmp_dir and check they load as intended."""
    export_model(result.best_state, shape, data.eos_id, settings.router_aux_loss_coef, tmp_dir)
    wrap_hf_tokenizer(data.tokenizer, shape.max_position_embeddings).save_pretrained(tmp_dir)
    (tmp_dir / "heldout_sample.txt").write_text(data.sample_text, encoding="utf-8")
    return verify_tokenizer(tmp_dir, data.eos_id, data.sample_text[:4000])


def run_stats(
    command: str,
    shape: ModelShape,
    corpus_settings: CorpusSettings,
    settings: TrainSettings,
    data: PreparedData,
    impl: str,
    impl_report: dict[str, Any],
    budget_s: float,
    result: TrainResult,
    tokenizer_report: dict[str, Any],
    evaluation: dict[str, Any],
    device: torch.device,
) -> dict[str, Any]:
    """Everything training_stats.json records (and MODEL_CARD.md renders)."""
    return {
        "command": command,
        "shape": dataclasses.asdict(shape),
        "parameters": shape.param_counts(),
        "eos_token_id": data.eos_id,
        "corpus": data.corpus.stats,
        "corpus_settings": dataclasses.asdict(corpus_settings),
        "heldout_sample_files": data.sample_files,
        "tokenizer": {**tokenizer_report, "train_bytes": data.tokenizer_train_bytes},
        "hardware": hardware_info(device),
        "training": {
            "experts_impl": impl,
            "experts_impl_report": impl_report,
            "precision": "bf16 autocast, fp32 master weights"
            if device.type == "cuda"
            else "fp32 (grouped expert GEMMs in bf16)",
            "settings": dataclasses.asdict(settings),
            "budget_s": budget_s,
            "steps": result.steps,
            "tokens": result.tokens,
            "tokens_per_step": settings.batch_seqs * settings.seq_len,
            "epochs": result.epochs,
            "seconds": result.seconds,
            "stop_reason": result.stop_reason,
            "best_step": result.best_step,
            "best_heldout_loss": result.best_heldout_loss,
            "curve": result.curve,
        },
        "evaluation": evaluation,
    }


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    command = " ".join(["python3 scripts/train_demo_model.py", *(sys.argv[1:] if argv is None else argv)])
    shape, corpus_settings, settings = settings_from_args(args)
    budget_estimate = shape.check_budget()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda" and not args.smoke:
        log("WARNING: no CUDA device; a full run on CPU will train very little")
    seed_everything(settings.seed)
    log(f"shape {shape}; est. output {budget_estimate / 1e6:.2f} MB of {SIZE_BUDGET_BYTES / 1e6:.0f} MB; {device}")
    timings: dict[str, float] = {}

    data = prepare_data(corpus_settings, shape.vocab_size, settings.seed, timings)
    shape = dataclasses.replace(shape, vocab_size=data.tokenizer.get_vocab_size())
    shape.check_budget()

    t = time.time()
    model = DemoMoeForCausalLM(shape)
    init_weights(model, settings.init_std)
    model.to(device)
    micro_tokens = settings.micro_batch_seqs * settings.seq_len
    impl, impl_report = choose_experts_impl(settings.experts_impl, shape, micro_tokens, device, device.type == "cuda")
    model.set_experts_impl(impl)
    if impl == "grouped":  # activations are small without the dense path's E-wide tensors: no accumulation
        settings = dataclasses.replace(settings, micro_batch_seqs=settings.batch_seqs)
    timings["kernel_selection"] = time.time() - t

    budget_s = training_budget_s(settings)
    log(f"training for up to {budget_s / 60:.2f} min with experts impl '{impl}'")
    result = train(model, data.train_tokens, data.heldout_tokens, settings, device, budget_s)
    timings["training"] = result.seconds
    log(f"training done: {result.steps} steps, {result.tokens:,} tokens, stop: {result.stop_reason}")
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()

    out_dir = args.out.resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir()
    t = time.time()
    tokenizer_report = export_and_verify(result, data, shape, settings, tmp_dir)
    timings["export"] = time.time() - t
    t = time.time()
    evaluation = final_evaluation(tmp_dir, shape, data.sample_text, device)
    timings["final_eval"] = time.time() - t

    stats = run_stats(
        command,
        shape,
        corpus_settings,
        settings,
        data,
        impl,
        impl_report,
        budget_s,
        result,
        tokenizer_report,
        evaluation,
        device,
    )
    timings["total"] = time.time() - _T0
    stats["timings_s"] = timings
    write_reports(tmp_dir, stats)
    for path in tmp_dir.iterdir():
        path.chmod(0o644)  # save_pretrained leaves model.safetensors owner-only
    total_bytes = dir_size(tmp_dir)
    if total_bytes > SIZE_BUDGET_BYTES:
        raise SystemExit(f"output is {total_bytes / 1e6:.2f} MB > {SIZE_BUDGET_BYTES / 1e6:.0f} MB; left in {tmp_dir}")
    install_output(tmp_dir, out_dir)
    log(
        f"wrote {out_dir} ({total_bytes / 1e6:.2f} MB): held-out perplexity {evaluation['perplexity']:.3f}; "
        f"total {timings['total'] / 60:.1f} min"
    )


if __name__ == "__main__":
    main()
