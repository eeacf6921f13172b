"""Multi-head latent attention (DeepSeek-V2 / V3, GLM-4.7-Flash) beyond the shared reference tests:
the latent cache's size (what the plan and `moestream check` count) and its row operations, decode
logits step by step against transformers' own cache, prompts prefilled in chunks across steps with
rows of different lengths decoding together, the prefix cache cutting latent snapshots, and the
absorbed form against the expanded one."""

from __future__ import annotations

import pytest
import torch

import moestream
from moestream.archs import ARCHS
from moestream.cli import build_parser, engine_config, main as cli_main
from moestream.errors import InputError
from moestream.engine.plan import plan_memory
from moestream.model.cache import LatentCache
from moestream.model.decoder import cache_bytes
from moestream.model.mla import MultiLatentAttention, set_absorbed
from moestream.runtime.sampling import SamplingParams
from moestream.sizes import format_bytes

MLA_ARCHS = ["deepseek_v2", "deepseek_v3", "glm4_moe_lite"]
LONG = torch.randint(2, 160, (40,), generator=torch.Generator().manual_seed(31)).tolist()


@pytest.fixture(scope="module", params=MLA_ARCHS)
def tiny(tiny_checkpoints, request):
    return tiny_checkpoints[request.param]


def reference_tokens(ref_model, prompt: list[int], n: int) -> list[int]:
    out = ref_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


# ---- the cache kind -------------------------------------------------------------------------------

def test_cache_bytes_are_the_latent_per_token_and_layer(tiny, capsys):
    engine = moestream.load(tiny[0], device="cpu", dtype="float32")
    config, spec = engine.config, ARCHS[engine.config.arch]
    mla = config.latent_attention
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        per_token = (mla.kv_lora_rank + mla.qk_rope_head_dim) * size
        assert MultiLatentAttention.cache_bytes(config, 3, 50, dtype) == 3 * 50 * per_token
        assert cache_bytes(config, spec, 3, 50, dtype) == config.num_layers * 3 * 50 * per_token
        cache = engine.model.new_cache(3, 50, dtype, torch.device("cpu"))
        assert all(isinstance(layer, LatentCache) for layer in cache.layers)
        assert sum(layer.latent.nbytes for layer in cache.layers) == cache_bytes(config, spec, 3, 50, dtype)
        plan = plan_memory(config, dtype, max_context=64, batch=2, spec=spec)
        # the plan's KV bytes per token per layer: two sequences and the scratch row padded decode writes to
        assert plan.kv_bytes == config.num_layers * (2 + 1) * 64 * per_token
    # `moestream check` prints that figure
    assert cli_main(["check", str(tiny[0]), "--device", "cpu", "--dtype", "bf16", "--max-context", "64"]) == 0
    out = capsys.readouterr()
    rows = engine.plan.memory.kv_bytes // cache_bytes(config, spec, 1, engine.plan.context, torch.float32)
    assert f"KV cache          {format_bytes(cache_bytes(config, spec, rows, 64, torch.bfloat16))}" in out.out + out.err


def test_latent_cache_rows_move_snapshot_and_restore():
    rank, rope = 6, 4
    cache = LatentCache(3, 10, rank, rope, torch.float32, torch.device("cpu"))
    assert cache.kind == "latent" and cache.can_cut and cache.latent.shape == (3, 10, rank + rope)
    latent = torch.randn(2, 7, rank + rope, generator=torch.Generator().manual_seed(0))
    rows = torch.tensor([[0] * 7, [2] * 7])
    cache.write(rows, torch.arange(7).expand(2, 7), latent)
    assert torch.equal(cache.read(slice(0, 3, 2), 7), latent)
    assert cache.read(slice(0, 2), 5).data_ptr() == cache.latent.data_ptr()   # read in place, not copied

    cache.move_row(2, 1, 5)                       # the scheduler moving a sequence up a row
    assert torch.equal(cache.read(slice(1, 2), 5)[0], latent[1, :5])
    assert cache.latent[1, 5:].eq(0).all()        # only the first `length` positions move

    state = cache.snapshot(0, 7)
    assert len(state) == 1 and state[0].shape == (7, rank + rope)
    cache.write(rows[:1], torch.arange(7)[None], torch.zeros(1, 7, rank + rope))
    assert torch.equal(state[0], latent[0])       # a standalone copy, not a view of the row
    cache.restore(2, state, 4)                    # cut to a shorter prefix, into another row
    assert torch.equal(cache.read(slice(2, 3), 4)[0], latent[0, :4])
    assert torch.equal(cache.latent[2, 4:7], latent[1, 4:7])   # the positions after the cut are untouched

    grown = LatentCache(5, 10, rank, rope, torch.float32, torch.device("cpu"))
    grown.copy_rows_from(cache, 3)
    assert torch.equal(grown.latent[:3], cache.latent) and grown.latent[3:].eq(0).all()


# ---- against transformers -------------------------------------------------------------------------

def test_modules_mirror_transformers_attention(tiny):
    """The latent norms keep RMSNorm's default eps (not rms_norm_eps) and the softmax scale is transformers'."""
    folder, ref_model = tiny
    engine = moestream.load(folder, device="cpu", dtype="float32")
    ours, theirs = engine.model.model.layers[0].mixer, ref_model.model.layers[0].self_attn
    assert ours.kv_a_layernorm.eps == theirs.kv_a_layernorm.variance_epsilon
    assert ours.scale == theirs.scaling
    assert ours.low_rank_q == (theirs.q_lora_rank is not None)
    if ours.low_rank_q:
        assert ours.q_a_layernorm.eps == theirs.q_a_layernorm.variance_epsilon


@pytest.mark.parametrize("absorbed", [False, True])
def test_decode_logits_follow_transformers_cache_step_by_step(tiny, absorbed):
    """Logits of every decode step, not only the argmax: transformers with its cache vs the engine's
    latent cache (prefilled in chunks of 5 across positions)."""
    folder, ref_model = tiny
    engine = moestream.load(folder, device="cpu", dtype="float32", prefill_chunk=5)
    assert set_absorbed(engine.model, absorbed) == engine.config.num_layers
    runner = engine.runner
    runner.ensure_rows(1)
    prompt = LONG[:13]
    with torch.no_grad():
        out = ref_model(torch.tensor([prompt]), use_cache=True)
        want, past = out.logits[:, -1], out.past_key_values
        got = runner.prefill(0, prompt)
        assert rel(got, want) <= 1e-4
        for step in range(8):
            token = want.argmax(-1)
            out = ref_model(token[:, None], past_key_values=past, use_cache=True)
            want, past = out.logits[:, -1], out.past_key_values
            got = runner.decode(token, torch.tensor([len(prompt) + step]), len(prompt) + step + 1)
            assert rel(got, want) <= 1e-4, f"decode step {step}"


def test_chunked_prompts_and_rows_of_different_lengths_decode_together(tiny):
    """Three prompts prefilled 5 positions per chunk, decoding as one batch through a bank of 3 of 8 experts."""
    folder, ref_model = tiny
    prompts = [LONG[:4], LONG[5:16], LONG[:37]]
    expected = [reference_tokens(ref_model, p, 10) for p in prompts]
    engine = moestream.load(folder, device="cpu", dtype="float32", capacity=3, prefill_chunk=5)
    assert engine.generate(prompts, max_tokens=10, ignore_eos=True) == expected


def test_a_prompt_arriving_while_another_decodes_joins_across_steps(tiny):
    folder, ref_model = tiny
    engine = moestream.load(folder, device="cpu", dtype="float32", prefill_chunk=6)
    first = engine.add_request(LONG[:7], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    second = engine.add_request(LONG[3:33], SamplingParams(max_tokens=9, ignore_eos=True))
    while not second.finished:
        engine.step()
    assert first.tokens == reference_tokens(ref_model, LONG[:7], 4)   # finishing first moves the second up a row
    assert second.tokens == reference_tokens(ref_model, LONG[3:33], 9)


def test_the_prefix_cache_cuts_latent_snapshots(tiny):
    folder, _ = tiny
    warm = moestream.load(folder, device="cpu", dtype="float32", prefix_cache_memory="4MiB", prefill_chunk=8)
    cold = moestream.load(folder, device="cpu", dtype="float32", prefill_chunk=8)
    assert warm.runner.ensure_rows(1).can_cut

    def run(engine, prompt):
        seq = engine.add_request(prompt, SamplingParams(max_tokens=5, ignore_eos=True))
        while not seq.finished:
            engine.step()
        return seq

    run(warm, LONG[:30])
    diverging = LONG[:20] + [9, 9, 9]
    second = run(warm, diverging)
    assert second.cached_tokens == 20             # a latent cache cuts at any position, as KV does
    assert second.tokens == run(cold, diverging).tokens


# ---- the absorbed form ----------------------------------------------------------------------------

def test_absorbed_form_equals_the_expanded_form(tiny):
    """W_UK folded into the query and W_UV applied after attention: the same logits on a padded batch
    (no cache) and the same greedy tokens through the cache."""
    folder, ref_model = tiny
    engine = moestream.load(folder, device="cpu", dtype="float32", prefill_chunk=7)
    ids = torch.tensor([LONG[:21], LONG[10:31]])
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    expanded = engine.logits(ids, mask)
    set_absorbed(engine.model)
    absorbed = engine.logits(ids, mask)
    assert rel(absorbed[mask.bool()], expanded[mask.bool()]) <= 1e-5
    prompts = [LONG[:6], LONG[:19]]
    assert engine.generate(prompts, max_tokens=12, ignore_eos=True) == [
        reference_tokens(ref_model, p, 12) for p in prompts]


def test_mla_absorbed_option_builds_the_absorbed_form(tiny, tiny_qwen3):
    """`mla_absorbed` (EngineConfig's runtime section, `--mla-absorbed`) switches every MLA layer before
    the runner exists, decoding transformers' tokens; a model without MLA refuses it by name."""
    folder, ref_model = tiny
    engine = moestream.load(folder, device="cpu", dtype="float32", mla_absorbed=True)
    layers = [m for m in engine.model.modules() if isinstance(m, MultiLatentAttention)]
    assert len(layers) == engine.config.num_layers and all(m.absorbed for m in layers)
    assert engine.generate([LONG[:9]], max_tokens=8, ignore_eos=True) == [reference_tokens(ref_model, LONG[:9], 8)]
    with pytest.raises(InputError, match="mla_absorbed is for multi-head latent attention"):
        moestream.load(tiny_qwen3, device="cpu", dtype="float32", mla_absorbed=True)
    args = build_parser().parse_args(["run", str(folder), "--mla-absorbed", "-p", "1 2"])
    assert engine_config(args).runtime.mla_absorbed is True


def test_absorbed_form_reads_a_quantized_kv_b_proj(tiny_quant_checkpoints):
    """With attention quantized, kv_b_proj is a QuantLinear: the absorbed form uses its dequantized weight."""
    folder = tiny_quant_checkpoints["deepseek_v3"][0]
    engine = moestream.load(folder, device="cpu", dtype="float32", attention="int8")
    ids = torch.tensor([LONG[:17]])
    expanded = engine.logits(ids)
    set_absorbed(engine.model)
    assert rel(engine.logits(ids), expanded) <= 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("absorbed", [False, True])
def test_mla_decode_reads_nothing_back_on_the_gpu(tiny_checkpoints, absorbed):
    engine = moestream.load(tiny_checkpoints["deepseek_v3"][0], device="cuda", dtype="float32", cuda_graphs=False)
    set_absorbed(engine.model, absorbed)
    runner = engine.runner
    runner.ensure_rows(2)
    runner.prefill(0, LONG[:9])
    runner.prefill(1, LONG[:4])
    tokens, positions = torch.tensor([3, 4], device="cuda"), torch.tensor([9, 4], device="cuda")
    runner.decode(tokens, positions, 10)   # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        runner.decode(tokens, positions, 10)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("absorbed", [False, True])
@pytest.mark.parametrize("arch", MLA_ARCHS)
def test_mla_decode_under_cuda_graphs_equals_eager_decode(tiny_checkpoints, arch, absorbed):
    """Whole-step graphs (resident bank) and graph segments (fetch bank) replay the latent cache's reads
    and writes as eager decode runs them: the same fp32 logits and tokens."""
    folder, _ = tiny_checkpoints[arch]
    prompts = [LONG[:6], LONG[:19]]
    eager = moestream.load(folder, device="cuda", dtype="float32", cuda_graphs=False)
    set_absorbed(eager.model, absorbed)
    want = eager.generate(prompts, max_tokens=12, ignore_eos=True)
    # 4 of 8 at top-2: a batch of two can be made resident, so a fetch bank segments; hybrid misses
    # keep whole-step graphs.
    for capacity, policy in ((None, "auto"), (4, "fetch"), (4, "hybrid")):
        graphs = moestream.load(folder, device="cuda", dtype="float32", capacity=capacity, mla_absorbed=absorbed,
                                miss_policy=policy, host_tier="pinned" if capacity else "auto")
        assert graphs.bank.graph_safe if policy != "fetch" else graphs.bank.can_segment(2)
        assert graphs.generate(prompts, max_tokens=12, ignore_eos=True) == want, f"capacity {capacity}, {policy}"
        graphs.bank.close()
