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
   ``heldout_sample.txt`` (``moestream/runtime/perplexity.py``) and per-layer routing
   statistics, then writes ``MODEL_CARD.md`` and ``training_stats.json``.

Everything is written to a hidden temp directory next to ``--out`` and renamed into
place at the end, so a crash never leaves a half-written model behind.

The steps live in ``scripts/demo_training/`` (one module per concern: settings, corpus, tokenizer,
model, train, export, evaluate, report, main); this file is the command.

Reproduce the shipped model (one H100):  see scripts/README.md.
Smoke test of the whole pipeline on CPU: ``python3 scripts/train_demo_model.py --smoke --out /tmp/demo_smoke``
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")  # batch encoding on all cores
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never wait on a network call

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]   # demo_training, and moestream without installing it

from demo_training.main import main  # noqa: E402

if __name__ == "__main__":
    main()
