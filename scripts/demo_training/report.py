"""The model card and training_stats.json."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any



from demo_training.evaluate import RECENT_WINDOW
from demo_training.settings import CHANCE_NOTE, EOS_TOKEN, SIZE_BUDGET_BYTES

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
        f"{ev['window']} / stride {ev['stride']} (`moestream/runtime/perplexity.py`), {ev['eval_dtype']}.",
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
