"""Expert parallel on CUDA tensors (skipped without CUDA): two ranks sharing one GPU over gloo give
the single-process engine's tokens; with two GPUs, NCCL's all-reduce is captured inside the decode
graphs and the tokens stay the same."""

from __future__ import annotations

import pytest
import torch

import moestream

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL ranks cannot share one)")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 0, 0, 0, 0]])
MASK = (IDS != 0).long()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.fixture(scope="module")
def single(tiny_qwen3):
    """The single-process engine's fp32 logits and greedy tokens on the GPU."""
    engine = moestream.load(tiny_qwen3, device="cuda", dtype="float32")
    return (engine.config.top_k, engine.logits(IDS, MASK).cpu(),
            engine.generate(PROMPTS, max_tokens=16, ignore_eos=True))


@pytest.mark.parametrize("bounded", [False, True], ids=["resident", "bounded"])
def test_two_ranks_sharing_one_gpu_over_gloo_give_one_process_tokens(tiny_qwen3, single, bounded):
    top_k, want_logits, want_tokens = single
    with moestream.load(tiny_qwen3, devices=["cuda:0", "cuda:0"], dist_backend="gloo", dtype="float32",
                        capacity=top_k if bounded else None, rank_timeout_s=120) as engine:
        assert engine.device.type == "cuda" and not engine.runner.cuda_graphs   # gloo's reduce is not capturable
        assert not engine.overlapping   # auto: gloo reads every step back on the host; nothing to overlap
        assert rel(engine.logits(IDS, MASK).cpu()[MASK.bool()], want_logits[MASK.bool()]) <= 1e-4
        assert engine.generate(PROMPTS, max_tokens=16, ignore_eos=True) == want_tokens
        stats = engine.stats()
        assert [r["device"] for r in stats["ranks"]] == ["cuda:0", "cuda:0"]
        for r in stats["ranks"]:
            assert r["collective"]["calls"] > 0 and r["collective"]["graph_calls"] == 0 and r["collective"]["seconds"] > 0
        assert (stats["misses"] > 0) == bounded


def test_two_ranks_sharing_one_gpu_in_bf16_stay_close(tiny_qwen3):
    """bf16 partial outputs are rounded on each rank before they are summed, so not bit-exact."""
    want = moestream.load(tiny_qwen3, device="cuda", dtype="bfloat16").logits(IDS, MASK).cpu()
    with moestream.load(tiny_qwen3, devices=["cuda:0", "cuda:0"], dist_backend="gloo", dtype="bfloat16",
                        rank_timeout_s=120) as engine:
        got = engine.logits(IDS, MASK).cpu()
    assert got.dtype == torch.bfloat16 and rel(got[MASK.bool()], want[MASK.bool()]) <= 3e-2


def test_overlapped_ranks_sharing_one_gpu_over_gloo_give_one_process_tokens(tiny_qwen3, single):
    """Overlap forced on with eager steps: the tokens broadcast from rank 0 are CUDA tensors still being
    sampled when the next step is published and launched."""
    _, _, want_tokens = single
    with moestream.load(tiny_qwen3, devices=["cuda:0", "cuda:0"], dist_backend="gloo", dtype="float32",
                        overlap="on", rank_timeout_s=120) as engine:
        assert engine.overlapping and not engine.runner.cuda_graphs
        assert engine.generate(PROMPTS, max_tokens=16, ignore_eos=True) == want_tokens


@two_gpus
@pytest.mark.parametrize("bounded", [False, True], ids=["resident", "bounded"])
def test_nccl_all_reduce_runs_inside_the_decode_graphs(tiny_qwen3, single, bounded):
    """Fully resident ranks replay whole decode steps, all-reduces included; a bounded bank reads
    its routing back between segments split at each router, which replay as graphs with their
    all-reduces (each rank making its own share of the routed experts resident)."""
    top_k, want_logits, want_tokens = single
    with moestream.load(tiny_qwen3, devices=["cuda:0", "cuda:1"], dtype="float32",
                        capacity=top_k if bounded else None, rank_timeout_s=120) as engine:
        assert engine.runner.cuda_graphs
        assert engine.overlapping == (not bounded)   # auto: whole-step graphs, the tokens broadcast inside
        assert engine.generate(PROMPTS, max_tokens=16, ignore_eos=True) == want_tokens
        assert engine.generate(PROMPTS[1], max_tokens=16, ignore_eos=True) == \
            moestream.load(tiny_qwen3, device="cuda", dtype="float32").generate(PROMPTS[1], max_tokens=16,
                                                                                  ignore_eos=True)
        stats = engine.stats()
        for r in stats["ranks"]:
            c = r["collective"]
            assert c["seconds"] > 0                              # prefill's reduces, timed by CUDA events
            assert c["graph_calls"] > 0                          # decode's, replayed inside the graphs


@two_gpus
def test_a_server_sized_group_captures_every_batch_on_every_rank(tiny_qwen3, single):
    """Start-up captures of the padded batch sizes run on every rank (their all-reduces pair up)."""
    _, _, want_tokens = single
    with moestream.load(tiny_qwen3, devices=["cuda:0", "cuda:1"], dtype="float32", kv_rows=4, max_batch=4,
                        warmup_tokens=2, rank_timeout_s=120) as engine:
        assert engine.generate(PROMPTS, max_tokens=16, ignore_eos=True) == want_tokens


@two_gpus
def test_an_nccl_group_launches_each_step_before_reading_the_last(tiny_qwen3, single):
    """Resident ranks over NCCL decode overlapped: every decode call but a batch's first is published
    while the step before is still unread, and carries host values only (publishing never waits for
    the device); the tokens stay the one-process engine's."""
    _, _, want_tokens = single
    with moestream.load(tiny_qwen3, devices=["cuda:0", "cuda:1"], dtype="float32", rank_timeout_s=120) as engine:
        assert engine.overlapping and engine.runner.cuda_graphs
        published, publish = [], engine.group.publish

        def recording(op, *args):
            published.append((op, args, engine._inflight is not None))
            publish(op, *args)
        engine.group.publish = recording
        assert engine.generate(PROMPTS, max_tokens=16, ignore_eos=True) == want_tokens
    decodes = [(args, ahead) for op, args, ahead in published if op == "decode"]
    assert len(decodes) == 15 and sum(ahead for _, ahead in decodes) == 14
    assert all(type(x) is int for args, _ in decodes for x in [args[0], args[2], *args[1]])


@two_gpus
def test_a_rank_killed_inside_nccl_steps_ends_the_group_with_a_clear_error(tiny_qwen3):
    """A follower killed while rank 0's graphs replay (their all-reduces wait for it, and no NCCL
    timeout watches a replayed collective): rank 0's watchdog aborts the communicators, the wait for
    the step raises the group's error within seconds, and nothing is left running."""
    import threading
    import time

    from moestream.errors import DistributedError

    engine = moestream.load(tiny_qwen3, devices=["cuda:0", "cuda:1"], dtype="float32", rank_timeout_s=120)
    follower = engine.group.procs[0]
    try:
        engine.generate(PROMPTS, max_tokens=4, ignore_eos=True)
        threading.Timer(0.5, follower.kill).start()
        start = time.monotonic()
        with pytest.raises(DistributedError, match=r"rank 1 exited with code -9"):
            while time.monotonic() - start < 60:   # a generation ends at the tiny model's context: go on decoding
                engine.generate(PROMPTS, max_tokens=200, ignore_eos=True)
        assert time.monotonic() - start < 60
    finally:
        engine.close()
    assert follower.poll() is not None


@two_gpus
def test_hybrid_ranks_over_nccl_replay_whole_steps_with_the_one_process_tokens(tiny_qwen3, single):
    """--miss-policy hybrid on two GPUs: each rank's CPU computes the misses among its own experts
    inside whole-step graphs (the all-reduces captured with them), tokens as one process's."""
    _, _, want_tokens = single
    with moestream.load(tiny_qwen3, devices=["cuda:0", "cuda:1"], dtype="float32", capacity=1,
                        miss_policy="hybrid", host_tier="pinned", rank_timeout_s=120) as engine:
        assert engine.runner.cuda_graphs
        assert engine.generate(PROMPTS, max_tokens=16, ignore_eos=True) == want_tokens
        assert all(r["cpu_served"] > 0 for r in engine.stats()["ranks"])
