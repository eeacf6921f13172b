"""Sliding-window perplexity: the yardstick for the quality cost of every approximate mode.

Windows of W tokens advance by W/2; each window scores only the tokens the previous window did
not, so every token after the first is predicted once, with at least W/2 tokens of context
(the scheme of the transformers perplexity guide).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F


def sliding_window_perplexity(model_fn: Callable[[torch.Tensor], torch.Tensor], ids: list[int], window: int,
                              device: torch.device | str = "cpu") -> tuple[float, int]:
    """(perplexity, scored tokens); model_fn maps (1, L) ids to (1, L, V) logits."""
    if len(ids) < 2:
        raise ValueError("perplexity needs at least two tokens")
    stride = max(1, window // 2)
    total_nll, scored, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        target_len = end - prev_end
        chunk = torch.tensor(ids[begin:end], dtype=torch.long, device=device)[None]
        logits = model_fn(chunk)[0].float()
        labels = chunk[0].clone()
        labels[: end - begin - target_len] = -100
        nll = F.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="sum")
        n = int((labels[1:] != -100).sum())
        total_nll += float(nll)
        scored += n
        prev_end = end
        if end == len(ids):
            break
    return math.exp(total_nll / scored), scored


def decode_perplexity(runner, ids: list[int], window: int, max_scored: int | None = None) -> tuple[float, int]:
    """(perplexity, scored tokens) with every scored token produced by a decode step.

    Each window of W tokens gives its first W/2 as an exact prompt and scores the next W/2 one
    decode step at a time, so modes that only change decoding (the skip miss policy) show their
    cost. `max_scored` bounds the work (decode is one step per token).
    """
    half = max(1, window // 2)
    total_nll, scored = 0.0, 0
    for begin in range(0, len(ids) - 1, half):
        context = ids[max(0, begin - half):begin] or ids[:1]   # the first window: the first token alone
        targets = ids[max(begin, 1):begin + half]
        if max_scored is not None:
            targets = targets[:max_scored - scored]
        if not targets:
            break
        logp = runner.teacher_forced(context, targets)
        total_nll -= float(logp.sum())
        scored += len(targets)
        if max_scored is not None and scored >= max_scored:
            break
    return math.exp(total_nll / scored), scored
