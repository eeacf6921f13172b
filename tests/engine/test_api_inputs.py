"""The Python API refuses what it cannot use with a MoestreamError, and one engine is safe to share
between threads (each caller gets its own, correct results)."""

import threading

import pytest
import torch

import moestream
from moestream.errors import InputError, MoestreamError


@pytest.fixture(scope="module")
def engine(tiny_qwen3):
    return moestream.load(tiny_qwen3, device="cpu", dtype="float32")


@pytest.mark.parametrize("ids,mask,match", [
    (torch.tensor([3, 4, 5]), None, "2-D"),
    (torch.zeros(1, 0, dtype=torch.long), None, "non-empty"),
    (torch.tensor([[3.0, 4.0]]), None, "integer token ids"),
    (torch.tensor([[3, 160]]), None, "160 is outside"),
    (torch.tensor([[-1, 3]]), None, "-1 is outside"),
    (torch.tensor([[3, 4]]), torch.ones(1, 3), "same shape"),
    (torch.tensor([[3, 4]]), torch.tensor([[1, 2]]), "only 0"),
    ([[3, 4]], None, "2-D"),
])
def test_logits_checks_its_inputs(engine, ids, mask, match):
    with pytest.raises(InputError, match=match):
        engine.logits(ids, mask)


@pytest.mark.parametrize("kw,match", [({"host_tier": "ram"}, "host tier"), ({"capacity": "8"}, "capacity"),
                                      ({"capacity": 0}, "capacity"), ({"max_batch": True}, "max_batch"),
                                      ({"warmup_tokens": 1.5}, "warmup_tokens"), ({"residency": "mru"}, "residency"),
                                      ({"prefetch": "yes"}, "prefetch"), ({"experts": "int9"}, "unknown"),
                                      ({"colour": "blue"}, "unknown option")])
def test_load_options_are_checked_on_every_device(tiny_qwen3, kw, match):
    with pytest.raises(MoestreamError, match=match):
        moestream.load(tiny_qwen3, device="cpu", **kw)


def test_threads_sharing_one_engine_each_get_their_own_results(engine):
    prompts = [torch.randint(2, 160, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (4, 9, 13, 6)]
    alone = [engine.generate(p, max_tokens=15, ignore_eos=True) for p in prompts]
    results: dict[int, list[int]] = {}
    errors = []

    def worker(i: int) -> None:
        try:
            results[i] = list(engine.stream_tokens(prompts[i], max_tokens=15, ignore_eos=True))
        except Exception as exc:   # surfaces in the main thread's assertion
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and [results[i] for i in range(len(prompts))] == alone
    assert engine.scheduler.idle
