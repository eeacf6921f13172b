"""Evaluation of the saved checkpoint: held-out perplexity (moestream's sliding-window implementation) while recording every token's routing, and the routing statistics."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


import torch

from moestream.runtime.perplexity import sliding_window_perplexity

from demo_training.export import load_saved_model, verify_against_training_module
from demo_training.settings import ModelShape, log

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
