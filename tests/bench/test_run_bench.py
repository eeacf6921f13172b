"""`moestream bench`'s time to first token: the median over fresh prompts, not one prompt's time."""

from __future__ import annotations

import statistics

import moestream
from moestream.bench import run_bench


def test_the_time_to_first_token_is_the_median_over_fresh_prompts(tiny_qwen3):
    engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32")
    prompts, ttfts, generate = [], [], engine.generate

    def recording(prompt, **kwargs):
        out = generate(prompt, **kwargs)
        prompts.append((list(prompt), kwargs.get("max_tokens")))
        ttfts.append(engine.last_metrics.ttft_s)
        return out
    engine.generate = recording
    result = run_bench(engine, prompt_tokens=12, gen_tokens=3, prompt_repeats=3)
    timed = [ttft for (prompt, max_tokens), ttft in zip(prompts, ttfts) if max_tokens == 1]
    assert len(timed) == 3                                              # the warm-up run is not one of them
    assert len({tuple(p) for p, n in prompts}) == len(prompts)          # every prompt fresh: nothing cached
    assert all(len(p) == 12 for p, _ in prompts)
    assert result.ttft_s == statistics.median(timed + [engine.last_metrics.ttft_s])
    assert result.prefill_tok_s == 12 / result.ttft_s
