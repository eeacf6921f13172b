"""Probes the tests put on an engine to see what it did, not only what it answered."""

from __future__ import annotations


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
