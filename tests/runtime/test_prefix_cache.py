"""The rows layout's prefix cache: a prompt that extends an earlier conversation prefills only its
new tokens, and the answer is the cold run's, token for token (greedy, fp32). The paged layout's
block-shared prefix cache has its own tests (test_paged_cache.py)."""

import pytest
import torch

from engine_probes import prefilled_tokens

import moestream
from moestream.errors import InputError
from moestream.runtime.prefix_cache import PrefixCache
from moestream.runtime.sampling import SamplingParams

FIRST = torch.randint(2, 160, (40,), generator=torch.Generator().manual_seed(1)).tolist()


def run(engine, prompt, max_tokens=8):
    seq = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    while not seq.finished:
        engine.step()
    return seq


@pytest.fixture(scope="module")
def engines(tiny_qwen3):
    warm = moestream.load(tiny_qwen3, device="cpu", dtype="float32", prefix_cache_memory="64MiB",
                          prefill_chunk=16, kv_layout="rows")
    cold = moestream.load(tiny_qwen3, device="cpu", dtype="float32", prefill_chunk=16)
    return warm, cold


def test_a_second_turn_reuses_the_first_and_equals_a_cold_run(engines):
    warm, cold = engines
    first = run(warm, FIRST)
    assert first.cached_tokens == 0
    # The next turn: the whole first conversation (prompt + reply) and a new user message.
    second_prompt = FIRST + first.tokens + [7, 8, 9, 10, 11]
    counts = prefilled_tokens(warm)
    second = run(warm, second_prompt, max_tokens=10)
    reusable = len(FIRST) + len(first.tokens) - 1          # the reply's last token was never fed back
    assert second.cached_tokens == reusable
    assert sum(counts) == len(second_prompt) - reusable
    assert second.tokens == run(cold, second_prompt, max_tokens=10).tokens
    stats = warm.prefix_cache.as_dict()
    assert stats["hits"] >= 1 and stats["reused_tokens"] >= reusable


def test_a_diverging_prompt_reuses_only_the_shared_part(engines):
    warm, cold = engines
    run(warm, FIRST)
    other = FIRST[:25] + [3, 4, 5, 6]
    seq = run(warm, other)
    assert seq.cached_tokens == 25
    assert seq.tokens == run(cold, other).tokens
    same = run(warm, FIRST)                                  # a repeat reuses all but the last token
    assert same.cached_tokens == len(FIRST) - 1
    assert same.tokens == run(cold, FIRST).tokens


def test_concurrent_sequences_share_a_cached_prefix(engines):
    warm, cold = engines
    run(warm, FIRST)
    prompts = [FIRST + [20 + i] * (i + 1) for i in range(3)]
    seqs = [warm.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True)) for p in prompts]
    while not all(s.finished for s in seqs):
        warm.step()
    assert all(s.cached_tokens >= len(FIRST) - 1 for s in seqs)
    assert [s.tokens for s in seqs] == [run(cold, p, max_tokens=6).tokens for p in prompts]


def test_entries_are_evicted_within_the_budget_and_extended_entries_replace_their_prefix(tiny_qwen3):
    engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32", prefix_cache_memory=1, kv_layout="rows")
    engine.prefix_cache.budget_bytes = 0
    run(engine, FIRST)
    assert not engine.prefix_cache.entries                   # larger than the budget: not kept
    cache = engine.prefix_cache
    one_entry = None
    cache.budget_bytes = 1 << 30
    first = run(engine, FIRST)
    assert len(cache.entries) == 1
    one_entry = cache.used_bytes
    run(engine, FIRST + first.tokens + [5, 6])               # extends the first: replaces it
    assert len(cache.entries) == 1 and cache.used_bytes > one_entry
    cache.budget_bytes = cache.used_bytes                    # room for exactly this entry
    run(engine, [9, 9, 9, 9, 9, 9])                          # a new conversation evicts the oldest
    assert len(cache.entries) == 1 and cache.stats.evicted == 1
    assert cache.used_bytes <= cache.budget_bytes


def test_the_option_is_checked():
    with pytest.raises(InputError, match="prefix_cache_memory"):
        moestream.engine.config.RuntimeConfig(prefix_cache_memory=-5).validate()
    with pytest.raises(InputError, match="does not parse"):
        moestream.engine.config.RuntimeConfig(prefix_cache_memory="lots").validate()
    assert PrefixCache(10).as_dict()["hit_rate"] == 0.0
