"""A streamed prompt's missing experts shared with the CPU (`prompt_cpu_misses`): the CPU computes its
share from host RAM in a thread of its own while the rest stream through the staging buffers, and the
tokens stay those of the fully resident model (fp32). On this CPU-only machine both sides are the CPU,
but every prompt goes through the split."""

import pytest

import moestream
from moestream.errors import InputError

PROMPTS = [[5, 6, 7, 8, 9], [12, 13, 14, 15, 16, 17, 18]]


@pytest.fixture(scope="module")
def resident(tiny_qwen3):
    engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32")
    return engine, engine.generate(PROMPTS, max_tokens=16, ignore_eos=True)


def _load(folder, capacity, **kw):
    return moestream.load(folder, device="cpu", dtype="float32", capacity=capacity, host_tier="pinned",
                          discovery=False, **kw)


@pytest.mark.parametrize("policy", ["fetch", "hybrid"])
@pytest.mark.parametrize("share", [0.5, 1.0, "auto"])
def test_a_prompts_misses_computed_on_the_cpu_give_the_resident_tokens(tiny_qwen3, resident, policy, share):
    engine, want = resident
    shared = _load(tiny_qwen3, engine.config.top_k, miss_policy=policy, prompt_cpu_misses=share)
    try:
        shared.generate(PROMPTS[1], max_tokens=1, ignore_eos=True)   # the prompt only: streamed (7 tokens > slots)
        first = shared.stats()
        if share != "auto":   # auto may find copying cheaper on this machine
            assert first["cpu_served"] > 0 and first["cpu_bytes"] > 0
        assert first["misses"] >= first["cpu_served"]
        assert [shared.generate(p, max_tokens=16, ignore_eos=True) for p in PROMPTS] == want
        assert shared.generate(PROMPTS, max_tokens=16, ignore_eos=True) == want
    finally:
        shared.close()


def test_without_it_a_prompt_streams_every_miss(tiny_qwen3, resident):
    engine, want = resident
    plain = _load(tiny_qwen3, engine.config.top_k, miss_policy="fetch")
    try:
        plain.generate(PROMPTS[1], max_tokens=1, ignore_eos=True)
        assert plain.stats()["cpu_served"] == 0 and plain.stats()["misses"] > 0
        assert not plain.bank.hybrid   # decode misses are copied: the prompts' share is theirs alone
    finally:
        plain.close()


@pytest.mark.parametrize("kw, words", [
    ({"prompt_cpu_misses": 1.5}, "from 0 to 1"),
    ({"prompt_cpu_misses": "half"}, "'auto'"),
    ({"prompt_cpu_misses": 0.5, "miss_policy": "skip"}, "fetch or hybrid"),
    ({"prompt_cpu_misses": 0.5, "miss_policy": "fetch", "host_tier": "disk"}, "--host-tier pinned"),
])
def test_bad_prompt_cpu_misses_are_refused_in_one_sentence(tiny_qwen3, kw, words):
    kw = {"host_tier": "pinned", **kw}
    with pytest.raises(InputError, match=words):
        moestream.load(tiny_qwen3, device="cpu", dtype="float32", capacity=2, discovery=False, **kw)
