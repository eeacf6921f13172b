"""Sliding-window perplexity, the yardstick for the demo model's quality.

The demo model card quotes a held-out perplexity, and other parts of moestream
(approximate expert modes, the engine's own evaluator) must reproduce that number
within 1%.  That only works if everyone runs exactly the same windowing, so the
algorithm lives here, in one small importable module without heavy imports beyond
torch, instead of being re-typed in several places.

Algorithm (the Hugging Face "perplexity of fixed-length models" recipe with stride
W // 2): windows of W = max_position_embeddings tokens start every S = W // 2
tokens; each window scores only the tokens that no earlier window scored (the
first window scores all of its next-token predictions), so every token after the
first is predicted exactly once, and all but the first window's tokens see at
least W - S tokens of context.  Perplexity = exp(total NLL / scored tokens).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

ModelFn = Callable[[torch.Tensor], torch.Tensor]
"""Maps a (1, L) LongTensor of token ids to (1, L, V) next-token logits."""

IGNORE_INDEX = -100


def window_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[float, int]:
    """Summed next-token NLL (fp32) of one window and how many tokens it scored.

    Standard shifted causal-LM loss: position i's logits predict labels[i + 1];
    labels equal to -100 are not scored.
    """
    shift_logits = logits[0, :-1, :].float()
    shift_labels = labels[0, 1:].to(shift_logits.device)
    nll = F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return float(nll.item()), int((shift_labels != IGNORE_INDEX).sum().item())


@torch.no_grad()
def sliding_window_perplexity(model_fn: ModelFn, ids: Sequence[int], window: int) -> tuple[float, int]:
    """Perplexity of ``ids`` under ``model_fn`` with windows of ``window`` tokens, stride window // 2.

    Returns (perplexity, number of scored tokens).  ``ids`` is the tokenization of the
    whole text with ``add_special_tokens=False``; ``window`` is the model's
    max_position_embeddings.  Every window is run independently (no KV cache), so the
    result depends only on the model's logits, not on how it is executed.
    """
    if window < 2:
        raise ValueError(f"window must be >= 2, got {window}")
    ids = list(ids)
    if len(ids) < 2:
        raise ValueError("need at least two tokens to score a next-token prediction")
    stride = window // 2
    total_nll = 0.0
    total_tokens = 0
    prev_end = 0
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        trg_len = end - prev_end
        input_ids = torch.tensor([ids[begin:end]], dtype=torch.long)
        labels = input_ids.clone()
        labels[:, : (end - begin) - trg_len] = IGNORE_INDEX
        logits = model_fn(input_ids)
        nll, scored = window_nll(logits, labels)
        total_nll += nll
        total_tokens += scored
        prev_end = end
        if end == len(ids):
            break
    return math.exp(total_nll / total_tokens), total_tokens
