"""Qwen3-Next (and Qwen3.5-MoE, the same hybrid) beyond the shared reference tests: prompts longer
than the delta rule's chunk of 64, chunked prefill across steps, left padding, decode batches of
rows at different positions, the recurrent cache kind and the prefix cache's whole-snapshot reuse."""

from __future__ import annotations

import pytest
import torch

import moestream
from moestream.model.cache import KVCache, RecurrentCache
from moestream.model.context import decode_context, no_cache_context, prefill_context
from moestream.model.decoder import cache_bytes
from moestream.runtime.sampling import SamplingParams

LONG = torch.randint(2, 160, (150,), generator=torch.Generator().manual_seed(21)).tolist()
SHORT = LONG[40:47]


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_moe"])
def tiny(tiny_checkpoints, request):
    return tiny_checkpoints[request.param]


@pytest.fixture(scope="module")
def engine(tiny):
    return moestream.load(tiny[0], device="cpu", dtype="float32")


def reference_tokens(ref_model, prompt: list[int], n: int) -> list[int]:
    out = ref_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def relative_error(out: torch.Tensor, ref: torch.Tensor, real: torch.Tensor) -> float:
    return float((out - ref)[real].abs().max() / ref[real].abs().max())


@pytest.mark.parametrize("pad_side", ["right", "left"])
def test_logits_of_a_padded_batch_longer_than_a_chunk(tiny, engine, pad_side):
    ids = torch.tensor([LONG, LONG[::-1]])
    mask = torch.ones_like(ids)
    if pad_side == "right":
        mask[1, 100:] = 0
    else:
        mask[1, :50] = 0
    with torch.no_grad():
        ref = tiny[1](ids, attention_mask=mask).logits
    assert relative_error(engine.logits(ids, mask), ref, mask.bool()) <= 1e-4


def test_long_prompt_tokens_match_transformers_in_any_prefill_chunking(tiny):
    expected = reference_tokens(tiny[1], LONG, 12)
    for chunk in (512, 64, 50, 7):   # one pass, the delta rule's own chunk, chunks that straddle it
        engine = moestream.load(tiny[0], device="cpu", dtype="float32", prefill_chunk=chunk)
        assert engine.generate(LONG, max_tokens=12, ignore_eos=True) == expected, f"prefill_chunk={chunk}"


def test_rows_at_different_positions_decode_together_through_a_bounded_bank(tiny):
    expected = [reference_tokens(tiny[1], p, 12) for p in (SHORT, LONG)]
    bounded = moestream.load(tiny[0], device="cpu", dtype="float32", capacity=3, prefill_chunk=40)
    assert bounded.generate([SHORT, LONG], max_tokens=12, ignore_eos=True) == expected


def test_a_prompt_arriving_while_others_decode_is_prefilled_across_steps(tiny):
    """The engine takes one prefill_chunk of a new prompt per step while the first keeps decoding, and
    the first finishing moves the second up a row: both stay exact."""
    engine = moestream.load(tiny[0], device="cpu", dtype="float32", prefill_chunk=30)
    first = engine.add_request(SHORT, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    second = engine.add_request(LONG, SamplingParams(max_tokens=10, ignore_eos=True))
    while not second.finished:
        engine.step()
    assert first.tokens == reference_tokens(tiny[1], SHORT, 4)
    assert second.tokens == reference_tokens(tiny[1], LONG, 10)


def test_decode_steps_run_twice_give_the_same_tokens(tiny):
    """What CUDA-graph capture does on the GPU (a warm-up run of the step, then the replay), here on
    every decode step of a whole generation: KV and recurrent layers alike must not advance twice."""
    engine = moestream.load(tiny[0], device="cpu", dtype="float32")
    forward = engine.runner.forward

    def twice(input_ids, ctx, last_only=False, decoding=False):
        if decoding:
            forward(input_ids, ctx, last_only=last_only, decoding=decoding)
        return forward(input_ids, ctx, last_only=last_only, decoding=decoding)

    engine.runner.forward = twice
    assert engine.generate([SHORT, LONG], max_tokens=10, ignore_eos=True) == [
        reference_tokens(tiny[1], p, 10) for p in (SHORT, LONG)]


def test_the_prefix_cache_reuses_whole_recurrent_snapshots_only(tiny):
    warm = moestream.load(tiny[0], device="cpu", dtype="float32", prefix_cache_memory="16MiB", prefill_chunk=32)
    cold = moestream.load(tiny[0], device="cpu", dtype="float32", prefill_chunk=32)
    assert not warm.runner.ensure_rows(1).can_cut

    def run(engine, prompt):
        seq = engine.add_request(prompt, SamplingParams(max_tokens=6, ignore_eos=True))
        while not seq.finished:
            engine.step()
        return seq

    first = run(warm, LONG[:70])
    extended = LONG[:70] + first.tokens + [5, 6, 7]
    second = run(warm, extended)
    assert second.cached_tokens == 70 + len(first.tokens) - 1   # the whole snapshot, restored
    assert second.tokens == run(cold, extended).tokens
    diverging = LONG[:60] + [9, 9, 9]
    third = run(warm, diverging)
    assert third.cached_tokens == 0                             # a recurrent state cannot be cut at 60
    assert third.tokens == run(cold, diverging).tokens


# ---- the mixer and its cache, below the engine ---------------------------------------------------

def mixer_setup(engine, rows: int = 2, max_len: int = 64):
    model = engine.runner.model
    mixer = model.model.layers[0].linear_attn
    cache = model.new_cache(rows, max_len, torch.float32, torch.device("cpu"))
    table = (torch.ones(max_len, 4), torch.zeros(max_len, 4))   # the linear mixer reads no rotary
    return mixer, cache, table


def whole(mixer, table, x: torch.Tensor) -> torch.Tensor:
    return mixer(x, no_cache_context(table, torch.zeros(x.shape[:2], dtype=torch.long), None, torch.float32))


def test_a_repeated_decode_step_leaves_the_state_of_one_step(engine):
    """CUDA-graph capture runs a decode step for warm-up, then replays it: the state must not advance twice."""
    mixer, cache, table = mixer_setup(engine, rows=1)
    x = torch.randn(1, 31, engine.runner.model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mixer(x[:, :30], prefill_context(table, cache, 0, 0, 30, torch.float32))
        step = decode_context(table, cache, torch.tensor([30]), 31, torch.float32)
        once = mixer(x[:, 30:], step)
        after_once = [t.clone() for t in cache[0].snapshot(0, 31)]
        twice = mixer(x[:, 30:], step)
        full = whole(mixer, table, x)
    assert torch.equal(once, twice)
    assert all(torch.equal(a, b) for a, b in zip(after_once, cache[0].snapshot(0, 31)))
    torch.testing.assert_close(once[:, 0], full[:, 30], atol=1e-5, rtol=1e-5)


def test_each_row_of_a_decode_batch_continues_its_own_state(engine):
    mixer, cache, table = mixer_setup(engine, rows=2)
    H = engine.runner.model.config.hidden_size
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(1, 31, H, generator=gen), torch.randn(1, 8, H, generator=gen)
    with torch.no_grad():
        mixer(torch.randn(1, 20, H, generator=gen), prefill_context(table, cache, 0, 0, 20, torch.float32))
        mixer(a[:, :30], prefill_context(table, cache, 0, 0, 30, torch.float32))   # row 0 reused from position 0
        mixer(b[:, :7], prefill_context(table, cache, 1, 0, 7, torch.float32))
        out = mixer(torch.cat((a[:, 30:], b[:, 7:])),
                    decode_context(table, cache, torch.tensor([30, 7]), 31, torch.float32))
        want_a, want_b = whole(mixer, table, a)[:, 30], whole(mixer, table, b)[:, 7]
    torch.testing.assert_close(out[0, 0], want_a[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1, 0], want_b[0], atol=1e-5, rtol=1e-5)


def test_recurrent_cache_moves_snapshots_and_restores_rows():
    cache = RecurrentCache(3, (3, 5), (2, 4, 4), torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(2)
    conv, state = torch.randn(2, 3, 5, generator=gen), torch.randn(2, 2, 4, 4, generator=gen)
    cache.write(torch.tensor([0, 1]), torch.tensor([7, 8]), conv, state)
    got = cache.read(torch.tensor([0, 1]), torch.tensor([7, 8]))
    assert torch.equal(got[0], conv) and torch.equal(got[1], state)
    zeros = cache.read(torch.tensor([0]), torch.tensor([0]))          # a sequence starting in a used row
    assert not zeros[0].any() and not zeros[1].any()
    snap = cache.snapshot(0, 7)
    assert torch.equal(snap[0], conv[0]) and torch.equal(snap[1], state[0])
    cache.write(torch.tensor([0]), torch.tensor([7]), conv[1:] + 1, state[1:] + 1)
    assert torch.equal(snap[0], conv[0])                              # a snapshot is a standalone copy
    cache.move_row(1, 2, 8)
    moved = cache.read(torch.tensor([2]), torch.tensor([8]))
    assert torch.equal(moved[0][0], conv[1]) and torch.equal(moved[1][0], state[1])
    cache.restore(2, snap, 7)
    restored = cache.read(torch.tensor([2]), torch.tensor([7]))
    assert torch.equal(restored[0][0], conv[0]) and torch.equal(restored[1][0], state[0])
    bigger = RecurrentCache(5, (3, 5), (2, 4, 4), torch.float32, torch.device("cpu"))
    bigger.copy_rows_from(cache, 3)
    assert torch.equal(bigger.conv[:3], cache.conv) and torch.equal(bigger.state[:3], cache.state)
    assert RecurrentCache.can_cut is False and KVCache.can_cut is True
    held = cache.conv.numel() * 4 + cache.state.numel() * 4
    assert held == 3 * RecurrentCache.bytes_per_row((3, 5), (2, 4, 4), torch.float32)


def test_cache_bytes_counts_every_layer_kind_and_only_kv_grows_with_context(engine):
    model, config = engine.runner.model, engine.runner.model.config
    spec = moestream.archs.ARCHS[config.arch]
    for max_len in (16, 64):
        cache = model.new_cache(3, max_len, torch.float32, torch.device("cpu"))
        kinds = [layer.kind for layer in cache.layers]
        assert kinds == ["recurrent", "recurrent", "recurrent", "kv"]
        held = sum(t.numel() * t.element_size() for layer in cache.layers for t in vars(layer).values()
                   if isinstance(t, torch.Tensor))
        assert cache_bytes(config, spec, 3, max_len, torch.float32) == held
    linear = type(model.model.layers[0].linear_attn)
    assert linear.cache_bytes(config, 3, 16, torch.float32) == linear.cache_bytes(config, 3, 10**6, torch.float32)
