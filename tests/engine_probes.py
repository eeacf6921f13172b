"""Probes the tests put on an engine to see what it did, not only what it answered."""

from __future__ import annotations

import torch


def prefilled_tokens(engine) -> list[int]:
    """From now on, the tokens of each prefill forward of `engine` (decode steps, one token per
    sequence, are left out): the list fills as the engine runs."""
    counts = []
    forward = engine.runner.forward

    def counting(input_ids, ctx, last_only=False, decoding=False):
        if not decoding:
            counts.append(input_ids.numel())
        return forward(input_ids, ctx, last_only=last_only, decoding=decoding)

    engine.runner.forward = counting
    return counts


def assert_fetch_cpu_share_scores(folder, capacity: int, context: list[int], targets: list[int],
                                  want_logp: torch.Tensor) -> None:
    """The fetch policy's `--cpu-misses` (every miss to the CPU) scores `targets` after `context` as
    `want_logp` (the format's own `host_dispatch`, the kernel the hybrid policy's CPU side runs), and its
    CPU really served some of them."""
    import moestream

    fetch = moestream.load(folder, device="cpu", dtype="float32", capacity=capacity, host_tier="pinned",
                           cpu_misses=1.0, discovery=False)
    torch.testing.assert_close(fetch.teacher_forced(context, targets), want_logp, rtol=1e-4, atol=1e-4)
    assert fetch.stats()["cpu_served"] > 0
