"""GPT-OSS's parts on the CPU: attention sinks against the softmax-with-an-extra-column definition,
the sliding-window ring cache (wrapping, chunk boundaries, rows of different lengths, row moves
and snapshots), prompts longer than the window and prefill chunks shorter than it against
transformers, the prefix cache over a ring, the stacked expert layout, and what is refused (MXFP4
tensors and config.json that disagree, quantized experts, bad sliding-window settings). The shared reference tests
(tests/model/test_reference.py) run the tiny GPT-OSS checkpoint too."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch

import moestream
from moestream.archs import ARCHS, model_config_from_hf
from moestream.errors import CheckpointError, InputError
from moestream.model.cache import KVCache, ModelCache, RingKVCache
from moestream.model.context import decode_context, no_cache_context, prefill_context
from moestream.model.rotary import rotary_table
from moestream.model.sink_attention import SlidingSinkAttention, sink_attention
from moestream.runtime.sampling import SamplingParams
from tiny_models import tiny_config

SPEC = ARCHS["gpt_oss"]


def naive_sink_attention(q, k, v, sinks, mask, scale):
    """The definition in float64, head by head: softmax over [masked scores, sink], the sink column dropped."""
    B, Hq, L, D = q.shape
    G = Hq // k.shape[1]
    out = torch.zeros(B, Hq, L, D, dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            scores = q[b, h].double() @ k[b, h // G].double().T * scale
            scores = scores.masked_fill(~mask[b, 0], float("-inf"))
            logits = torch.cat([scores, torch.full((L, 1), float(sinks[h]), dtype=torch.float64)], dim=1)
            probs = logits.softmax(dim=-1)[:, :-1]
            out[b, h] = probs @ v[b, h // G].double()
    return out


@pytest.mark.parametrize("block_elements", [1 << 26, 40])   # one block, and one query per block
def test_sink_attention_is_a_softmax_with_an_extra_column(block_elements):
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, L, S, D = 2, 6, 2, 5, 9, 8
    q, k, v = (torch.randn(B, h, n, D, generator=g) for h, n in ((Hq, L), (Hkv, S), (Hkv, S)))
    sinks = torch.randn(Hq, generator=g) * 2
    mask = torch.rand(B, 1, L, S, generator=g) > 0.4
    mask[1, 0, 2] = False                    # a query that sees no key: all its mass goes to the sink
    out = sink_attention(q, k, v, sinks, mask, D ** -0.5, block_elements=block_elements)
    want = naive_sink_attention(q, k, v, sinks, mask, D ** -0.5)
    assert (out.double() - want).abs().max() < 1e-6
    assert torch.equal(out[1, :, 2], torch.zeros(Hq, D))
    # and transformers' eager GPT-OSS attention (an additive mask, sinks as `module.sinks`)
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    module = SimpleNamespace(num_key_value_groups=Hq // Hkv, sinks=sinks, training=False)
    additive = torch.zeros(B, 1, L, S).masked_fill(~mask, float("-inf"))
    ref, _ = eager_attention_forward(module, q, k, v, additive, scaling=D ** -0.5)
    ok = mask.any(-1)[:, 0]                  # (transformers gives NaN-free zeros there too, but via -inf - -inf)
    assert (out.transpose(1, 2)[ok] - ref[ok]).abs().max() < 1e-6


def test_sinks_take_probability_mass():
    q, k, v = torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 3, 4), torch.ones(1, 1, 3, 4)
    mask = torch.ones(1, 1, 1, 3, dtype=torch.bool)
    # three keys of score 0 and a sink of logit log(3): half the mass goes to the sink
    out = sink_attention(q, k, v, torch.tensor([torch.log(torch.tensor(3.0))]), mask, 1.0)
    torch.testing.assert_close(out, torch.full((1, 1, 1, 4), 0.5))


# ---- the ring cache ------------------------------------------------------------------------------
def _values(positions: torch.Tensor) -> torch.Tensor:
    """k/v entries that name their position: (B, L, 1, 1)."""
    return positions.float()[..., None, None]


def test_ring_wraps_and_says_which_position_each_slot_holds():
    ring = RingKVCache(rows=2, size=4, num_kv_heads=1, head_dim=1, dtype=torch.float32, device=torch.device("cpu"))
    for p in range(11):                                          # one position at a time, in row 1
        start = torch.tensor([[p]])
        held = ring.slot_positions(start)[0]
        want = [max((q for q in range(p) if q % 4 == j), default=None) for j in range(4)]
        for j in range(4):
            if want[j] is None:
                assert held[j] < 0
            else:
                assert held[j] == want[j] and ring.k[1, j, 0, 0] == want[j]
        pos = torch.tensor([[p]])
        ring.write(torch.tensor([[1]]), pos, _values(pos), _values(pos))
    assert torch.equal(ring.k[1, :, 0, 0], torch.tensor([8.0, 9.0, 10.0, 7.0]))
    assert torch.equal(ring.k[0], torch.zeros(4, 1, 1))      # another row untouched
    # a chunk longer than the ring keeps its last `size` positions
    pos = torch.arange(3, 13)[None]
    ring.write(torch.ones_like(pos), pos, _values(pos), _values(pos))
    assert torch.equal(ring.k[1, :, 0, 0], torch.tensor([12.0, 9.0, 10.0, 11.0]))
    assert torch.equal(ring.slot_positions(torch.tensor([[13]]))[0], torch.tensor([12, 9, 10, 11]))


def test_ring_rows_move_snapshot_and_restore():
    cpu = torch.device("cpu")
    ring = RingKVCache(rows=3, size=4, num_kv_heads=2, head_dim=3, dtype=torch.float32, device=cpu)
    ring.k.normal_(), ring.v.normal_()
    ring.move_row(2, 0, length=9)
    assert torch.equal(ring.k[0], ring.k[2]) and torch.equal(ring.v[0], ring.v[2])
    state = ring.snapshot(1, length=6)
    saved = ring.k[1].clone()
    ring.k[1].zero_()
    ring.restore(2, state, length=6)
    assert torch.equal(ring.k[2], saved) and torch.equal(ring.v[2], state[1])
    bigger = RingKVCache(rows=5, size=4, num_kv_heads=2, head_dim=3, dtype=torch.float32, device=cpu)
    bigger.copy_rows_from(ring, 3)
    assert torch.equal(bigger.k[:3], ring.k) and torch.equal(bigger.v[:3], ring.v)
    # a ring cannot serve a shorter prefix than it was snapshotted at, so a model with one cannot cut
    assert not ring.can_cut
    kv = KVCache(3, 16, 2, 3, torch.float32, cpu)
    assert not ModelCache([kv, ring], rows=3, max_len=16, device=cpu).can_cut
    assert ModelCache([kv], rows=3, max_len=16, device=cpu).can_cut


def _sliding_layer(window: int = 6) -> tuple[SlidingSinkAttention, object, tuple]:
    """A random sliding-window layer of the tiny config, its config and a rotary table."""
    raw = tiny_config("gpt_oss").to_dict()
    config = model_config_from_hf({**raw, "sliding_window": window}, SPEC)
    torch.manual_seed(0)
    layer = SlidingSinkAttention(config, SPEC, layer=0)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    return layer.eval(), config, rotary_table(config, 64, torch.device("cpu"))


@pytest.mark.parametrize("window", [6, 100])   # 100: beyond the 64-position context, the ring is the context
@pytest.mark.parametrize("chunks", [[23], [4] * 5 + [3], [1] * 23, [7, 1, 11, 4], [5, 6, 12]])
def test_sliding_layer_in_chunks_equals_one_pass(chunks, window):
    """Chunk boundaries anywhere, chunks shorter and longer than the window: the same outputs as the
    whole sequence at once (the no-cache path, its window applied to the positions)."""
    layer, config, table = _sliding_layer(window)
    x = torch.randn(1, 23, config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = layer(x, no_cache_context(table, torch.zeros(1, 23, dtype=torch.long), None, torch.float32))
        cache = ModelCache([layer.make_cache(config, 2, 64, torch.float32, torch.device("cpu"))], 2, 64,
                           torch.device("cpu"))
        assert cache[0].size == min(window, 64)
        cache[0].k.normal_(), cache[0].v.normal_()          # stale rows from an earlier sequence
        assert sum(chunks) == 23
        outs, start = [], 0
        for n in chunks:
            outs.append(layer(x[:, start:start + n], prefill_context(table, cache, 1, start, n, torch.float32)))
            start += n
    torch.testing.assert_close(torch.cat(outs, dim=1), whole, rtol=1e-5, atol=1e-5)


def test_sliding_layer_decodes_rows_of_different_lengths():
    layer, config, table = _sliding_layer()
    g = torch.Generator().manual_seed(2)
    lengths = [3, 14, 9]                                  # below, above and beyond the window
    xs = [torch.randn(1, n + 1, config.hidden_size, generator=g) for n in lengths]
    cpu = torch.device("cpu")
    with torch.no_grad():
        want = [layer(x, no_cache_context(table, torch.zeros(1, x.shape[1], dtype=torch.long), None,
                                          torch.float32))[:, -1] for x in xs]
        cache = ModelCache([layer.make_cache(config, 3, 64, torch.float32, cpu)], 3, 64, cpu)
        for row, (x, n) in enumerate(zip(xs, lengths)):
            layer(x[:, :n], prefill_context(table, cache, row, 0, n, torch.float32))
        positions = torch.tensor(lengths)
        step = torch.cat([x[:, -1:] for x in xs])
        out = layer(step, decode_context(table, cache, positions, max(lengths) + 1, torch.float32))
        # running the step again (a CUDA graph's warm-up, then its replay) gives the same outputs
        again = layer(step, decode_context(table, cache, positions, max(lengths) + 1, torch.float32))
    torch.testing.assert_close(out[:, 0], torch.cat(want), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again, out)


# ---- the whole model against transformers ----------------------------------------------------------
@pytest.fixture(scope="module")
def gpt_oss(tiny_checkpoints):
    return tiny_checkpoints["gpt_oss"]


def _reference_tokens(ref_model, prompt, n):
    out = ref_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_prompts_longer_than_the_window_in_chunks_shorter_than_it_match_transformers(gpt_oss):
    folder, ref_model = gpt_oss
    assert ref_model.config.sliding_window == 6
    prompts = [torch.randint(2, 160, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (19, 8, 27)]
    expected = [_reference_tokens(ref_model, p, 12) for p in prompts]
    for chunk in (4, 5, 6, 13):
        engine = moestream.load(folder, device="cpu", dtype="float32", prefill_chunk=chunk)
        assert engine.generate(prompts, max_tokens=12, ignore_eos=True) == expected, f"prefill_chunk {chunk}"


def test_yarn_rotary_matches_transformers(gpt_oss):
    folder, ref_model = gpt_oss
    engine = moestream.load(folder, device="cpu", dtype="float32")
    assert engine.config.rope.kind == "yarn" and engine.config.rope.get("truncate") is False
    cos, sin = rotary_table(engine.config, 40, torch.device("cpu"))
    ref_cos, ref_sin = ref_model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), torch.arange(40)[None])
    half = cos.shape[1] // 2                   # ours repeats the frequencies over both halves
    assert torch.equal(cos[:, :half], ref_cos[0]) and torch.equal(sin[:, :half], ref_sin[0])


def _run(engine, prompt, max_tokens=8):
    seq = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    while not seq.finished:
        engine.step()
    return seq


def test_prefix_cache_over_a_ring_reuses_whole_entries_only_and_stays_exact(gpt_oss):
    folder, _ = gpt_oss
    warm = moestream.load(folder, device="cpu", dtype="float32", prefix_cache_memory="16MiB", prefill_chunk=5)
    cold = moestream.load(folder, device="cpu", dtype="float32", prefill_chunk=5)
    assert not warm.runner.ensure_rows(1).can_cut
    first_prompt = torch.randint(2, 160, (17,), generator=torch.Generator().manual_seed(7)).tolist()
    first = _run(warm, first_prompt)
    second_prompt = first_prompt + first.tokens + [7, 8, 9]
    second = _run(warm, second_prompt)
    assert second.cached_tokens == len(first_prompt) + len(first.tokens) - 1   # the whole entry
    assert second.tokens == _run(cold, second_prompt).tokens
    diverging = first_prompt[:10] + [3, 4, 5]            # shares only part of an entry: nothing reused
    seq = _run(warm, diverging)
    assert seq.cached_tokens == 0 and seq.tokens == _run(cold, diverging).tokens


# ---- layout and what is refused --------------------------------------------------------------------
def test_stacked_experts_are_read_deinterleaved_with_their_biases(gpt_oss):
    folder, ref_model = gpt_oss
    engine = moestream.load(folder, device="cpu", dtype="float32")
    store, experts = engine.bank.store, ref_model.model.layers[2].mlp.experts
    gate, up, down = store.read_raw(2, 5)
    assert torch.equal(gate, experts.gate_up_proj[5, :, 0::2].T) and torch.equal(up, experts.gate_up_proj[5, :, 1::2].T)
    assert torch.equal(down, experts.down_proj[5].T)
    gate_b, up_b, down_b = store.read_raw_biases(2, 5)
    assert torch.equal(gate_b, experts.gate_up_proj_bias[5, 0::2])
    assert torch.equal(up_b, experts.gate_up_proj_bias[5, 1::2])
    assert torch.equal(down_b, experts.down_proj_bias[5])
    slots = engine.bank.slots[2].tensors
    assert set(slots) == {"gate_up", "down", "gate_up_bias", "down_bias"}
    assert slots["gate_up_bias"].shape == (8, 32)


def _edited(folder, tmp_path, **changes):
    out = tmp_path / "ckpt"
    shutil.copytree(folder, out)
    config = json.loads((out / "config.json").read_text())
    config.update(changes)
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_an_mxfp4_config_with_widths_mxfp4_cannot_split_is_refused(gpt_oss, tmp_path):
    folder = _edited(gpt_oss[0], tmp_path, quantization_config={"quant_method": "mxfp4",
                                                                "modules_to_not_convert": ["model.layers.*.self_attn"]})
    with pytest.raises(CheckpointError, match=r"intermediate_size = 16, which MXFP4's 32-value blocks") as info:
        moestream.load(folder, device="cpu")
    assert str(info.value).count(". ") == 0 and str(info.value).endswith(".")   # one sentence


def test_mxfp4_expert_tensors_without_the_config_entry_are_refused(gpt_oss, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _edited(gpt_oss[0], tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.0.mlp.experts.gate_up_proj"
    tensors[f"{name}_blocks"] = torch.zeros(8, 32, 1, 16, dtype=torch.uint8)
    tensors[f"{name}_scales"] = torch.zeros(8, 32, 1, dtype=torch.uint8)
    del tensors[name]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"MXFP4-quantized.*config.json does not say so.*quant_method 'mxfp4'"):
        moestream.load(folder, device="cpu")


def test_quantized_experts_are_refused_before_loading(gpt_oss):
    with pytest.raises(InputError, match="unquantized"):
        moestream.load(gpt_oss[0], device="cpu", experts="int4")


@pytest.mark.parametrize("key,value,match", [
    ("sliding_window", 0, "sliding_window"), ("sliding_window", 2.5, "sliding_window"),
    ("sliding_window", None, "sliding_window = null"), ("swiglu_limit", 0, "swiglu_limit"),
    ("swiglu_alpha", "1.7", "swiglu_alpha"), ("layer_types", ["sliding_attention", "chunked", "full_attention"],
                                               "layer type"),
    ("layer_types", ["full_attention"], "one layer type for each"),
])
def test_bad_gpt_oss_values_are_named_before_loading(gpt_oss, tmp_path, key, value, match):
    folder = _edited(gpt_oss[0], tmp_path, **{key: value})
    with pytest.raises(CheckpointError, match=match):
        moestream.load(folder, device="cpu")


def test_config_defaults_follow_transformers():
    raw = tiny_config("gpt_oss").to_dict()
    for key in ("layer_types", "sliding_window", "swiglu_alpha", "swiglu_limit"):
        raw.pop(key)
    config = model_config_from_hf(raw, SPEC)
    # layers alternate sliding / full from layer 0, the window 128, GPT-OSS's clamp
    assert config.layer_mixers == ("sink_swa", "sink_gqa", "sink_swa")
    assert (config.sliding_window, config.swiglu_alpha, config.swiglu_limit) == (128, 1.702, 7.0)
    assert config.router_bias and config.expert_bias and config.qkv_bias and config.o_bias
    assert config.expert_activation == "swiglu_clamped" and config.dense_intermediate == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("capacity, policy", [(None, "auto"), (4, "fetch"), (4, "hybrid")])   # 4 of 8: a batch of
def test_cuda_graph_decode_matches_transformers(gpt_oss, capacity, policy):                     # two still segments
    """On the GPU in fp32: decode as CUDA graphs (whole steps when resident or with hybrid misses, whose
    CPU worker computes biased, clamped experts; segments with a fetch bank), the ring and sinks inside
    them, the Triton kernels with biases and the clamped SwiGLU."""
    folder, ref_model = gpt_oss
    prompts = [torch.randint(2, 160, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (19, 8)]
    expected = [_reference_tokens(ref_model, p, 24) for p in prompts]
    engine = moestream.load(folder, device="cuda", dtype="float32", capacity=capacity, prefill_chunk=5,
                            miss_policy=policy, host_tier="pinned" if capacity else "auto")
    assert engine.bank.graph_safe or engine.bank.can_segment(2)
    assert engine.generate(prompts, max_tokens=24, ignore_eos=True) == expected
    engine.bank.close()


def test_dense_format_holds_the_biases_and_says_when_its_dispatch_syncs(monkeypatch):
    from moestream import kernels
    from moestream.experts.format import DenseFormat, ExpertShape, QuantizedFormat
    from moestream.quant import parse_quant

    config = model_config_from_hf(tiny_config("gpt_oss").to_dict(), SPEC)
    shape = ExpertShape.of(config)
    assert shape.bias and (shape.activation.name, shape.activation.alpha, shape.activation.limit) == (
        "swiglu_clamped", 1.3, 0.15)
    fmt = DenseFormat("fp32", torch.float32)
    assert [(t.name, t.shape) for t in fmt.tensors(shape)] == [("gate_up", (32, 32)), ("down", (32, 16)),
                                                               ("gate_up_bias", (32,)), ("down_bias", (32,))]
    assert fmt.nbytes(shape) == 4 * (3 * 16 * 32 + 2 * 16 + 32)
    with pytest.raises(InputError, match="unquantized"):
        QuantizedFormat(parse_quant("int4"), torch.float32).tensors(shape)
    # the reference on CUDA (no Triton) reads back: the bank then decodes without CUDA graphs
    assert not fmt.dispatch_syncs(torch.device("cpu"), shape)
    monkeypatch.setattr(kernels, "fused_moe_available", lambda: False)
    assert fmt.dispatch_syncs(torch.device("cuda"), shape)
