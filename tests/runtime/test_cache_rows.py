"""The rows-layout KV cache: made once with every row the memory plan reserved, and a cache that does
not fit leaves the engine as it was with one clear error (not a later one about a missing cache)."""

import pytest
import torch

import moestream
from moestream.errors import BudgetError


@pytest.mark.parametrize("layout", ["rows", "paged"])
def test_the_first_cache_takes_every_reserved_row_at_once(tiny_qwen3, layout):
    engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32", kv_rows=4, max_context=64, kv_layout=layout)
    assert engine.runner.cache is None
    engine.generate([5, 6, 7], max_tokens=2, ignore_eos=True)
    first = engine.runner.cache
    assert engine.runner.usable_rows >= 4
    engine.generate([[5, 6, 7]] * 4, max_tokens=2, ignore_eos=True)   # four rows: no second cache
    assert engine.runner.cache is first


def test_a_cache_that_does_not_fit_is_a_budget_error_and_the_engine_stays_usable(tiny_qwen3, monkeypatch):
    engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32", kv_rows=1, max_context=64, kv_layout="rows")
    want = engine.generate([5, 6, 7], max_tokens=3, ignore_eos=True)
    held = engine.runner.cache

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.25 GiB.")

    monkeypatch.setattr(engine.model, "new_cache", no_memory)
    with pytest.raises(BudgetError, match="KV cache of 2 sequences at a 64-token context does not fit"):
        engine.generate([[5, 6, 7], [8, 9]], max_tokens=3, ignore_eos=True)
    assert engine.runner.cache is held
    monkeypatch.undo()
    assert engine.generate([5, 6, 7], max_tokens=3, ignore_eos=True) == want
