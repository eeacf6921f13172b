"""GPU checks (skipped without CUDA): bf16 reference agreement, exact fetch, budgets honoured."""

import pytest
import torch

import moestream
from moestream.engine.plan import plan_memory
from tiny_models import ARCHS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_logits_close_to_fp32_reference(arch, tiny_checkpoints):
    """Our bf16 on the GPU against transformers' fp32, held to what transformers' own bf16 gets: some
    tiny random families lose much more to bf16 than others (Gemma 4's ~12%, GPT-OSS's ~3%, Qwen3's
    0.7% on the CPU), so the bound is twice the reference's own bf16 error, and at most 3e-2 where
    that is smaller; the argmax agrees at least as often as the reference's bf16 does, less 5 points."""
    import copy

    folder, ref_model = tiny_checkpoints[arch]
    engine = moestream.load(folder, device="cuda", dtype="bfloat16")
    ids = torch.randint(2, 160, (2, 33), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = ref_model(ids).logits
        ref_bf16 = copy.deepcopy(ref_model).to(torch.bfloat16)(ids).logits.float()
    out = engine.logits(ids).float().cpu()
    rel = (out - ref).norm() / ref.norm()
    ref_rel = (ref_bf16 - ref).norm() / ref.norm()
    assert rel < max(3e-2, 2 * ref_rel), f"{arch}: relative error {rel:.3e} (transformers' bf16: {ref_rel:.3e})"
    agree = (out.argmax(-1) == ref.argmax(-1)).float().mean()
    ref_agree = (ref_bf16.argmax(-1) == ref.argmax(-1)).float().mean()
    assert agree >= min(0.9, ref_agree - 0.05)


@pytest.mark.parametrize("policy", ["fetch", "hybrid"])
def test_misses_are_exact_at_every_capacity_on_gpu(tiny_qwen3, policy):
    full = moestream.load(tiny_qwen3, device="cuda", dtype="float32")
    prompts = [torch.randint(2, 160, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 6)]
    expected = full.generate(prompts, max_tokens=24, ignore_eos=True)
    for cap in range(1 if policy == "hybrid" else 2, 9):
        engine = moestream.load(tiny_qwen3, device="cuda", dtype="float32", capacity=cap, miss_policy=policy,
                                host_tier="pinned")
        assert engine.generate(prompts, max_tokens=24, ignore_eos=True) == expected, f"capacity {cap}"
        engine.bank.close()


@pytest.mark.parametrize("policy", ["fetch", "hybrid"])
@pytest.mark.parametrize("share", [0.5, 1.0, "auto"])
def test_a_prompts_misses_shared_with_the_cpu_are_exact_on_gpu(tiny_qwen3, policy, share):
    """`prompt_cpu_misses` on CUDA: the CPU's thread computes its share of a streamed prompt's experts from
    the pinned tier while the staging copies and launches go on; fp32, so the tokens are the resident ones."""
    full = moestream.load(tiny_qwen3, device="cuda", dtype="float32")
    prompts = [torch.randint(2, 160, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 14)]
    expected = full.generate(prompts, max_tokens=12, ignore_eos=True)
    engine = moestream.load(tiny_qwen3, device="cuda", dtype="float32", capacity=3, miss_policy=policy,
                            host_tier="pinned", prompt_cpu_misses=share)
    try:
        assert [engine.generate(p, max_tokens=12, ignore_eos=True) for p in prompts] == expected
        assert engine.generate(prompts, max_tokens=12, ignore_eos=True) == expected
        if share != "auto":
            assert engine.stats()["cpu_served"] > 0
    finally:
        engine.close()


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.25])
def test_peak_device_memory_stays_within_budget(fraction, tiny_qwen3):
    engine = moestream.load(tiny_qwen3, device="cuda", dtype="bfloat16")
    cap = max(engine.config.top_k, int(engine.config.num_experts * fraction))
    memory = engine.plan.memory   # the plan the engine made (its KV layout), at capacity `cap`
    budget = plan_memory(engine.config, torch.bfloat16, capacity=cap, max_context=engine.max_context,
                         kv_blocks=memory.kv_blocks, kv_block_size=memory.kv_block_size or 16).total_bytes
    del engine
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    engine = moestream.load(tiny_qwen3, device="cuda", dtype="bfloat16", gpu_memory=budget)
    assert engine.bank.capacity >= cap   # the largest capacity that fits (staging can cost more than it saves)
    engine.generate(list(range(2, 120)), max_tokens=16, ignore_eos=True)
    assert torch.cuda.max_memory_allocated() - base <= budget


@pytest.mark.parametrize("fmt", ["int4", "nf4", "int3"])
def test_quantized_experts_on_gpu_match_the_cpu_engine_and_fetch_stays_exact(tiny_quant, fmt):
    ids = torch.randint(2, 160, (2, 17), generator=torch.Generator().manual_seed(6))
    cpu = moestream.load(tiny_quant, device="cpu", dtype="float32", experts=fmt, attention="int8").logits(ids)
    gpu = moestream.load(tiny_quant, device="cuda", dtype="float32", experts=fmt, attention="int8").logits(ids)
    assert (gpu.cpu() - cpu).norm() / cpu.norm() < 1e-3
    full = moestream.load(tiny_quant, device="cuda", dtype="bfloat16", experts=fmt)
    prompts = [torch.randint(2, 160, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 9)]
    expected = full.generate(prompts, max_tokens=16, ignore_eos=True)
    for cap in (2, 5):   # fetch by name: `auto` takes the hybrid policy, exact in fp32 (its own tests), not in bf16
        engine = moestream.load(tiny_quant, device="cuda", dtype="bfloat16", experts=fmt, capacity=cap,
                                miss_policy="fetch")
        assert engine.generate(prompts, max_tokens=16, ignore_eos=True) == expected, cap


@pytest.mark.parametrize("fmt", ["int4", "nf4", "int8"])
def test_quantized_hybrid_misses_are_exact_on_gpu(tiny_quant, fmt):
    """Quantized misses split between the CPU worker and the dequantizing launches reading the pinned
    stacks in place: the tokens of the fully resident quantized model (fp32), every expert off the
    GPU included. The default policy (auto) takes hybrid for them too, from the quantized share."""
    from moestream.experts.hybrid import QUANTIZED_CPU_SHARE

    prompts = [torch.randint(2, 160, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 9)]
    full = moestream.load(tiny_quant, device="cuda", dtype="float32", experts=fmt)
    expected = [full.generate(p, max_tokens=16, ignore_eos=True) for p in prompts]
    fixed = {"miss_policy": "hybrid", "cpu_misses": 0.5}
    for cap, kw in ((1, fixed), (2, fixed), (5, {})):
        engine = moestream.load(tiny_quant, device="cuda", dtype="float32", experts=fmt, capacity=cap,
                                host_tier="pinned", **kw)
        try:
            assert engine.bank.miss_policy == "hybrid" and engine.bank.hybrid_misses.gpu_reads
            assert engine.bank.hybrid_misses.cpu_share == (0.5 if kw else QUANTIZED_CPU_SHARE)
            assert [engine.generate(p, max_tokens=16, ignore_eos=True) for p in prompts] == expected, cap
            stats = engine.stats()
            assert stats["host_read"] > 0 and stats["cpu_served"] > 0
        finally:
            engine.close()


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_padded_decode_graphs_keep_each_sequence_its_own_tokens(arch, tiny_checkpoints):
    """A server's engine (several cache rows) runs a batch of 5 through the graphs captured for 8 at
    start-up: the padding writes only to the scratch row (recurrent state included), so every
    sequence decodes as it does alone (fp32)."""
    folder = tiny_checkpoints[arch][0]
    engine = moestream.load(folder, device="cuda", dtype="float32", max_batch=8, kv_rows=8, warmup_tokens=2)
    assert engine.runner.scratch_row == 8 and engine.runner.padded_batch(5) == 8
    prompts = [torch.randint(2, 160, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 7, 4, 9, 5)]
    alone = [engine.generate(p, max_tokens=12, ignore_eos=True) for p in prompts]
    assert engine.generate(prompts, max_tokens=12, ignore_eos=True) == alone
    assert engine.generate(prompts[:3], max_tokens=12, ignore_eos=True) == alone[:3]   # 3 pads to 4


@pytest.mark.parametrize("layout", ["rows", "paged"])
@pytest.mark.parametrize("experts", [None, "int4"])
def test_resident_prompt_chunks_replay_as_graphs_with_the_eager_tokens(tiny_quant, layout, experts):
    """A fully resident model's prompt chunks replay as CUDA graphs, padded (72 tokens run as 128, 7 and 2
    as 16), at any row and start (a second turn prefills after its cached prefix), through the grouped
    MoE kernels (128 tokens) and the decode ones (16): the greedy tokens equal the eager forward's and a
    chunk's logits are close to them (fp32), bf16 experts and int4 alike."""
    kw = dict(device="cuda", dtype="float32", max_context=256, prefill_chunk=128, kv_layout=layout, max_batch=2,
              prefix_cache_memory="64MiB", experts=experts)
    eager = moestream.load(tiny_quant, cuda_graphs=False, **kw)
    graphed = moestream.load(tiny_quant, **kw)
    prompts = [torch.randint(2, 160, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (200, 7, 130)]
    for prompt in prompts:
        want = eager.generate(prompt, max_tokens=8, ignore_eos=True)
        assert graphed.generate(prompt, max_tokens=8, ignore_eos=True) == want
        turn = prompt + want + [5, 6, 7]
        assert graphed.generate(turn, max_tokens=8, ignore_eos=True) == eager.generate(turn, max_tokens=8,
                                                                                       ignore_eos=True)
    graphs = graphed.runner._prompt_graphs
    assert graphs is not None and {length for length, _ in graphs.graphs} >= {128, 16}
    for engine in (eager, graphed):
        engine.runner.ensure_rows(2)
        if layout == "paged":   # row 1's blocks, for the runner's prefill straight into it
            engine.runner.cache.tables.assign(1, list(range(1, 1 + 256 // engine.runner.paged.block_size)))
    want = eager.runner.prefill(1, prompts[0])
    torch.testing.assert_close(graphed.runner.prefill(1, prompts[0]), want, rtol=1e-3, atol=1e-3)
