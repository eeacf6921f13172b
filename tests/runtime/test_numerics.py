"""Numbers that cannot be sampled from end with one clear error, and every seed is accepted or refused clearly."""

import pytest

import moestream
from moestream.errors import InputError, NumericsError


@pytest.fixture(scope="module")
def engine(tiny_qwen3):
    return moestream.load(tiny_qwen3, device="cpu", dtype="float32")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_nan_or_inf_logits_raise_a_numerics_error_naming_the_step(engine, bad, temperature):
    norm = engine.model.model.norm
    saved = norm.weight.data.clone()
    try:
        norm.weight.data.fill_(bad)
        with pytest.raises(NumericsError, match="step 1 .*--dtype"):
            engine.generate([3, 4, 5], max_tokens=4, temperature=temperature, seed=1)
    finally:
        norm.weight.data.copy_(saved)
    assert engine.scheduler.idle or not engine.scheduler.running   # the failed sequence left the batch
    assert len(engine.generate([3, 4, 5], max_tokens=4, ignore_eos=True)) == 4   # the engine still works


@pytest.mark.parametrize("seed", [0, 2**63, 2**64 - 1, -5, -2**63])
def test_any_seed_in_range_is_accepted_and_reproducible(engine, seed):
    kw = dict(max_tokens=6, temperature=1.0, ignore_eos=True, seed=seed)
    assert engine.generate([3, 4, 5], **kw) == engine.generate([3, 4, 5], **kw)


@pytest.mark.parametrize("seed", [2**64, -2**63 - 1, 1.5, "7", True])
def test_seeds_out_of_range_or_of_the_wrong_type_are_refused(engine, seed):
    with pytest.raises(InputError, match="seed"):
        engine.generate([3, 4, 5], max_tokens=2, temperature=1.0, seed=seed)


@pytest.mark.parametrize("kw,match", [({"max_tokens": 2.5}, "max_tokens"), ({"top_k": "3"}, "top_k"),
                                      ({"temperature": float("inf")}, "temperature"), ({"top_p": None}, "top_p"),
                                      ({"stop": [""]}, "stop"), ({"stop": [3]}, "stop")])
def test_sampling_values_of_the_wrong_type_are_refused(engine, kw, match):
    with pytest.raises(InputError, match=match):
        engine.generate([3, 4, 5], **{"max_tokens": 2, **kw})
