"""A resident prompt chunk as a padded, device-addressed forward (`PromptGraphs`): what CUDA replays.

On a GPU the runner captures it as graphs; here it runs eagerly in its place (`use_graphs=False`), so the
padding, the row and start read on the device and the last real token's logits are checked on the CPU
(fp32): every chunk gives the logits of the plain chunked prefill, and every sequence the same tokens, in
rows and in paged blocks, with a prefix reused and several sequences at once."""

import pytest
import torch

import moestream
from moestream.runtime.cuda_graphs import PROMPT_GRAPH_LENGTHS, PromptGraphs
from moestream.runtime.sampling import SamplingParams

PROMPTS = [torch.randint(2, 160, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (37, 5, 70)]


def load(folder, **kw):
    return moestream.load(folder, device="cpu", dtype="float32", prefill_chunk=32, max_context=128, max_batch=3,
                          **kw)


def run_padded(engine) -> list[tuple[int, int]]:
    """Make the engine's runner take its prompt chunks through an eager `PromptGraphs`, as a GPU's runner
    takes them through the captured one; returns the (start, length) of each chunk it ran."""
    runner, ran, held = engine.runner, [], {}

    def prompt_runner(start: int, n: int):
        graphs = held.get("graphs")
        if graphs is None or graphs.cache is not runner.cache:
            graphs = held["graphs"] = PromptGraphs(runner.model, runner.rotary_table(), runner.cache, runner.dtype,
                                                   use_graphs=False)
        if graphs.padded_length(start, n) is None:
            return None
        ran.append((start, n))
        return graphs

    runner._prompt_runner = prompt_runner
    return ran


def generate_each(engine, prompts, max_tokens=6):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts]
    while not all(s.finished for s in seqs):
        engine.step()
    return [list(s.tokens) for s in seqs]


@pytest.mark.parametrize("layout", ["rows", "paged"])
def test_padded_chunks_give_the_plain_prefills_logits_and_tokens(tiny_qwen3, layout):
    """Chunks of 32, 5 and 6 tokens (padded to 32, 16 and 16) at starts 0, 32 and 64, into row 1 of three:
    the logits of each chunk's last token and the cache the next chunk reads equal the plain prefill's."""
    plain, padded = load(tiny_qwen3, kv_layout=layout), load(tiny_qwen3, kv_layout=layout)
    ran = run_padded(padded)
    if layout == "paged":   # prefill straight into row 1 needs its blocks in the table first
        for engine in (plain, padded):
            engine.runner.ensure_rows(3)
            engine.runner.cache.tables.assign(1, list(range(1, 1 + 128 // engine.runner.paged.block_size)))
    else:
        for engine in (plain, padded):
            engine.runner.ensure_rows(3)
    ids = PROMPTS[2]
    for start, end in ((0, 32), (32, 37), (37, 43)):
        want = plain.runner.prefill(1, ids[start:end], start)
        got = padded.runner.prefill(1, ids[start:end], start)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert ran == [(0, 32), (32, 5), (37, 6)]


@pytest.mark.parametrize("layout", ["rows", "paged"])
def test_sequences_prefilled_through_padded_chunks_generate_the_same_tokens(tiny_qwen3, layout):
    """Three prompts at once (chunks of one sequence each, several rows), then a second turn of the first
    that reuses its cached prefix and prefills only the rest: the same tokens as the plain engine's."""
    kw = dict(kv_layout=layout, prefix_cache_memory="4MiB")
    plain, padded = load(tiny_qwen3, pack_prompts=False, **kw), load(tiny_qwen3, pack_prompts=False, **kw)
    ran = run_padded(padded)
    want = generate_each(plain, PROMPTS)
    assert generate_each(padded, PROMPTS) == want
    turn = PROMPTS[0] + want[0] + [7, 8, 9]
    assert generate_each(padded, [turn]) == generate_each(plain, [turn])
    assert any(start > 0 for start, _ in ran) and any(n not in PROMPT_GRAPH_LENGTHS for _, n in ran)


def test_padding_stays_inside_the_cache_and_only_full_keys_and_values_take_it(tiny_qwen3, tiny_checkpoints):
    """A chunk whose padding would run past the cache's last position, or one longer than the longest
    captured length, is not one a prompt graph runs; a recurrent layer's state (Qwen3-Next) would take the
    padding in, so its caches are refused."""
    engine = load(tiny_qwen3)
    engine.runner.ensure_rows(1)
    graphs = PromptGraphs(engine.runner.model, engine.runner.rotary_table(), engine.runner.cache,
                          engine.runner.dtype, use_graphs=False)
    assert PromptGraphs.takes(engine.runner.cache)
    assert graphs.padded_length(0, 5) == 16 and graphs.padded_length(90, 20) == 32
    assert graphs.padded_length(120, 5) is None   # 120 + 16 > 128 positions
    assert graphs.padded_length(0, PROMPT_GRAPH_LENGTHS[-1] + 1) is None
    with pytest.raises(ValueError, match="not one a prompt graph runs"):
        graphs(0, [3] * 5, 120)
    nxt = moestream.load(tiny_checkpoints["qwen3_next"][0], device="cpu", dtype="float32", max_context=128)
    nxt.runner.ensure_rows(1)
    assert not PromptGraphs.takes(nxt.runner.cache)
