"""Sliding-window perplexity: the yardstick for the quality cost of every approximate mode.

Windows of W tokens advance by W/2; each window scores only the tokens the previous window did
not, so every token after the first is predicted once, with at least W/2 tokens of context
(the scheme of the transformers perplexity guide).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ModelFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Scores:
    perplexity: float
    tokens: int
    kl: float | None = None   # mean KL(reference ‖ model) of the next-token distributions, in nats


def sliding_window_scores(model_fn: ModelFn, ids: list[int], window: int, device: torch.device | str = "cpu",
                          reference_fn: ModelFn | None = None, progress: Callable[[int], None] | None = None) -> Scores:
    """Perplexity of `ids` under `model_fn` (maps (1, L) ids to (1, L, V) logits), and with a
    `reference_fn` the mean KL divergence from the reference's next-token distributions to the
    model's over the same scored positions (the quality cost of quantization, token by token).
    `progress(n)` hears of the n tokens each window scored (a long file takes minutes)."""
    if len(ids) < 2:
        raise ValueError("perplexity needs at least two tokens")
    stride = max(1, window // 2)
    total_nll, total_kl, scored, prev_end = 0.0, 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        target_len = end - prev_end
        chunk = torch.tensor(ids[begin:end], dtype=torch.long, device=device)[None]
        logits = model_fn(chunk)[0].float()
        labels = chunk[0].clone().to(logits.device)   # model_fn may run elsewhere (a GPU model on CPU ids)
        labels[: end - begin - target_len] = -100
        nll = F.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="sum")
        keep = labels[1:] != -100
        if reference_fn is not None:
            log_q = logits[:-1][keep].log_softmax(-1)
            log_p = reference_fn(chunk)[0].float()[:-1][keep].log_softmax(-1).to(log_q.device)
            total_kl += float((log_p.exp() * (log_p - log_q)).sum())
        total_nll += float(nll)
        scored += int(keep.sum())
        if progress is not None:
            progress(int(keep.sum()))
        prev_end = end
        if end == len(ids):
            break
    return Scores(math.exp(total_nll / scored), scored, total_kl / scored if reference_fn is not None else None)


def sliding_window_perplexity(model_fn: ModelFn, ids: list[int], window: int,
                              device: torch.device | str = "cpu") -> tuple[float, int]:
    """(perplexity, scored tokens); model_fn maps (1, L) ids to (1, L, V) logits."""
    scores = sliding_window_scores(model_fn, ids, window, device)
    return scores.perplexity, scores.tokens


def decode_perplexity(engine, ids: list[int], window: int, max_scored: int | None = None,
                      progress: Callable[[int], None] | None = None) -> tuple[float, int]:
    """(perplexity, scored tokens) with every scored token produced by a decode step of `engine`
    (`Engine.teacher_forced`); `progress(n)` hears of the n tokens each window scored.

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
        logp = engine.teacher_forced(context, targets)
        total_nll -= float(logp.sum())
        scored += len(targets)
        if progress is not None:
            progress(len(targets))
        if max_scored is not None and scored >= max_scored:
            break
    return math.exp(total_nll / scored), scored
