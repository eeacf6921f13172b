"""moestream.runtime.sampling: greedy, temperature, top-k, top-p, min-p, seeds, and parameter checks."""

from __future__ import annotations

import math

import pytest
import torch

import moestream
from moestream import cli
from moestream.errors import InputError
from moestream.runtime.sampling import SamplingParams, filter_logits, make_generator, sample

CPU = torch.device("cpu")
# a hand-made distribution in shuffled order: token 1 → 0.5, token 3 → 0.3, token 0 → 0.15, token 2 → 0.05
PROBS = torch.tensor([0.15, 0.5, 0.05, 0.3])
LOGITS = PROBS.log()


def _params(**kw) -> SamplingParams:
    params = SamplingParams(**kw)
    params.validate()
    return params


def _draws(logits: torch.Tensor, n: int = 4000, seed: int = 0, **kw) -> torch.Tensor:
    """n samples from one row of logits, drawn in one batched call."""
    params = _params(seed=seed, **kw)
    return sample(logits.expand(n, -1).clone(), params, make_generator(params, CPU))


def _kept(logits: torch.Tensor, **kw) -> set[int]:
    """Tokens that filtering leaves sampleable."""
    out = filter_logits(logits[None], _params(**kw))[0]
    return set(torch.isfinite(out).nonzero().flatten().tolist())


def test_greedy_is_argmax():
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(0)) * 3
    params = _params(temperature=0.0)
    assert params.greedy and make_generator(params, CPU) is None
    assert torch.equal(sample(logits, params, None), logits.argmax(-1))
    # the filters do not touch greedy decoding
    assert torch.equal(sample(logits, _params(temperature=0.0, top_k=3, top_p=0.2, min_p=0.5), None), logits.argmax(-1))


@pytest.mark.parametrize("temperature", [0.01, 0.7, 1.0, 3.0, 100.0])
def test_top_k_1_equals_greedy_at_any_temperature(temperature):
    logits = torch.randn(256, 50, generator=torch.Generator().manual_seed(1)) * 2
    params = _params(temperature=temperature, top_k=1, seed=3)
    assert torch.equal(sample(logits, params, make_generator(params, CPU)), logits.argmax(-1))


def test_top_k_keeps_the_k_most_likely():
    assert _kept(LOGITS, temperature=1.0, top_k=2) == {1, 3}
    assert _kept(LOGITS, temperature=1.0, top_k=3) == {0, 1, 3}
    assert set(_draws(LOGITS, temperature=1.0, top_k=2).tolist()) == {1, 3}


@pytest.mark.parametrize("top_p, expected", [
    (0.4, {1}),             # 0.5 alone reaches 0.4
    (0.7, {1, 3}),          # 0.5 < 0.7 <= 0.5 + 0.3
    (0.9, {0, 1, 3}),       # 0.8 < 0.9 <= 0.95
    (0.97, {0, 1, 2, 3}),
    (1.0, {0, 1, 2, 3}),
])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, expected):
    assert _kept(LOGITS, temperature=1.0, top_p=top_p) == expected
    draws = _draws(LOGITS, temperature=1.0, top_p=top_p)
    assert set(draws.tolist()) == expected
    # what is kept is renormalised: relative frequencies follow the original probabilities
    kept = sorted(expected)
    freq = torch.bincount(draws, minlength=4).float() / len(draws)
    target = PROBS[kept] / PROBS[kept].sum()
    assert torch.allclose(freq[kept], target, atol=0.04)


def test_top_p_works_per_row():
    rows = torch.stack([LOGITS, LOGITS.flip(0)])   # second row: token 2 → 0.5, token 0 → 0.3
    out = filter_logits(rows, _params(temperature=1.0, top_p=0.7))
    assert torch.isfinite(out).tolist() == [[False, True, False, True], [True, False, True, False]]


@pytest.mark.parametrize("min_p, expected", [
    (0.35, {1, 3}),         # threshold 0.175
    (0.2, {0, 1, 3}),       # threshold 0.1
    (0.09, {0, 1, 2, 3}),   # threshold 0.045
    (0.0, {0, 1, 2, 3}),
])
def test_min_p_filters_relative_to_the_max_probability(min_p, expected):
    assert _kept(LOGITS, temperature=1.0, min_p=min_p) == expected
    assert set(_draws(LOGITS, temperature=1.0, min_p=min_p).tolist()) == expected
    # the threshold scales with the top probability: the same min_p on a flatter row keeps more
    flatter = LOGITS / 4
    assert _kept(flatter, temperature=1.0, min_p=min_p) >= expected


@pytest.mark.parametrize("kw", [{"top_k": 10}, {"top_k": 10, "top_p": 0.8}, {"top_k": 12, "min_p": 0.1},
                                {"top_k": 16, "top_p": 0.9, "min_p": 0.02}])
def test_top_k_draws_follow_the_whole_row_filtered(kw):
    """Drawing among the k best tokens only (no sort of the vocabulary) gives the distribution of the
    whole row filtered: the same tokens, at the same frequencies, each row its own."""
    gen = torch.Generator().manual_seed(7)
    rows = torch.randn(3, 64, generator=gen) * 2
    params = _params(temperature=0.7, seed=11, **kw)
    n = 6000
    draws = sample(rows.repeat_interleave(n, 0), params, make_generator(params, CPU)).view(3, n)
    filtered = filter_logits(rows, params)
    for row in range(3):
        kept = set(torch.isfinite(filtered[row]).nonzero().flatten().tolist())
        assert set(draws[row].tolist()) == kept
        freq = torch.bincount(draws[row], minlength=64).float() / n
        assert torch.allclose(freq, filtered[row].softmax(-1), atol=0.025)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_alone_draws_the_softmax(temperature):
    """The Gumbel-max race over the scaled logits follows softmax(logits / T), row by row."""
    rows = torch.randn(2, 40, generator=torch.Generator().manual_seed(3)) * 2
    params = _params(temperature=temperature, seed=2)
    n = 8000
    draws = sample(rows.repeat_interleave(n, 0), params, make_generator(params, CPU)).view(2, n)
    for row in range(2):
        freq = torch.bincount(draws[row], minlength=40).float() / n
        assert torch.allclose(freq, (rows[row] / temperature).softmax(-1), atol=0.02)


@pytest.mark.parametrize("n, k", [(151936, 20), (151936, 1), (16384, 128), (50000, 64), (20000, 300), (1000, 5)])
def test_top_k_of_a_long_row_in_two_stages_equals_torch_topk(n, k):
    """Exact chunks, padded ones (50000), and the one-stage rows (k beyond a chunk's share, short rows)."""
    from moestream.runtime.sampling import top_k

    x = torch.randn(3, n, generator=torch.Generator().manual_seed(n + k))
    values, ids = top_k(x, k)
    want_values, want_ids = torch.topk(x, k, dim=-1)
    assert torch.equal(values, want_values) and torch.equal(ids, want_ids)


def test_temperature_sharpens_and_flattens():
    low = torch.bincount(_draws(LOGITS, temperature=0.25), minlength=4).float()
    high = torch.bincount(_draws(LOGITS, temperature=4.0), minlength=4).float()
    assert low[1] > 0.8 * low.sum()          # p(1) at T=0.25 is 0.5^4 / sum(p^4) ≈ 0.88
    assert high.min() > 0.15 * high.sum()    # T=4 is close to uniform


def test_same_seed_same_samples_different_seed_different_samples():
    flat = torch.zeros(1000, 100)   # a flat distribution: every draw is pure randomness

    def draw(seed):
        params = _params(temperature=1.0, seed=seed)
        return sample(flat, params, make_generator(params, CPU))

    first = draw(1234)
    assert torch.equal(first, draw(1234))
    assert not torch.equal(first, draw(1235))
    assert len(set(first.tolist())) > 90   # and the draws really spread over the vocabulary
    # no seed → a fresh random seed each time
    unseeded = _params(temperature=1.0)
    assert not torch.equal(sample(flat, unseeded, make_generator(unseeded, CPU)),
                           sample(flat, unseeded, make_generator(unseeded, CPU)))


@pytest.mark.parametrize("kw, word", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(top_k=-1), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_p=math.nan), "top_p"),
    (dict(min_p=1.0), "min_p"),
    (dict(min_p=-0.01), "min_p"),
])
def test_invalid_params_raise_input_error(kw, word):
    with pytest.raises(InputError, match=word):
        SamplingParams(**kw).validate()


@pytest.fixture(scope="module")
def engine(tiny_qwen3):
    return moestream.load(tiny_qwen3, device="cpu", dtype="float32")


def test_engine_rejects_invalid_params(engine, capsys, tiny_qwen3):
    with pytest.raises(InputError, match="top_p"):
        engine.generate([3, 4, 5], max_tokens=4, temperature=1.0, top_p=0.0)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", str(tiny_qwen3), "-p", "3 4 5", "--device", "cpu", "--temperature", "nan"])
    assert exit_info.value.code == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("moestream: error: --temperature") and err.count("\n") == 1


def test_engine_seeded_sampling_is_reproducible(engine):
    prompt = [3, 4, 5, 6]
    kw = dict(max_tokens=16, temperature=0.8, ignore_eos=True)
    first = engine.generate(prompt, seed=5, **kw)
    assert len(first) == 16
    assert engine.generate(prompt, seed=5, **kw) == first
    assert list(engine.stream_tokens(prompt, seed=5, **kw)) == first
    assert engine.generate(prompt, seed=6, **kw) != first
    # top_k=1 sampling is greedy decoding
    assert engine.generate(prompt, seed=7, top_k=1, **kw) == engine.generate(prompt, max_tokens=16, ignore_eos=True)
