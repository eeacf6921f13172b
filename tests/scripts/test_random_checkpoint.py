"""Tests for scripts/make_random_checkpoint.py.

Why: every benchmark and engine test runs on these synthetic checkpoints, so their
layout must be exactly what transformers (and the real Hub checkpoints) use.  We
check that against transformers itself: a tiny model built from the same config
and saved with ``save_pretrained`` must have the same tensor names and shapes, and
``from_pretrained`` must load ours with nothing missing or unexpected.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[2]
SHAPES = ("qwen3-30b-a3b", "mixtral-8x7b", "olmoe-1b-7b", "qwen1.5-moe-a2.7b", "glm-4.5-air", "qwen3-next-80b-a3b",
          "deepseek-v2-lite", "glm-4.7-flash", "gpt-oss-20b", "gpt-oss-120b", "qwen3.6-35b-a3b",
          "gemma-4-26b-a4b")
HYBRID = ("qwen3-next-80b-a3b", "qwen3.6-35b-a3b")   # every 4th layer is full attention


def _load_script() -> ModuleType:
    """Import the script by path (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "make_random_checkpoint", ROOT / "scripts" / "make_random_checkpoint.py"
    )
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


mrc = _load_script()
transformers = pytest.importorskip("transformers")


def _read_tensors(ckpt: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype) over every .safetensors file in ``ckpt``."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                sl = h.get_slice(k)
                out[k] = (tuple(sl.get_shape()), sl.get_dtype())
    return out


@pytest.fixture(scope="module")
def tiny_ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Write every shape with --tiny once; a small shard size forces several shards. Qwen3-Next gets 4
    layers, so that its every-4th full-attention layer is there."""
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for shape in SHAPES:
        out[shape] = root / shape
        assert (
            mrc.main(
                [
                    "--shape",
                    shape,
                    "--tiny",
                    "--layers",
                    "4" if shape in HYBRID else "2",  # transformers needs one attention layer
                    "--out",
                    str(out[shape]),
                    "--shard-size",
                    "150KB",
                    "--workers",
                    "2",
                ]
            )
            == 0
        )
    return out


@pytest.mark.parametrize("shape", SHAPES)
def test_tiny_loads_and_runs_with_transformers(tiny_ckpts: dict[str, Path], shape: str) -> None:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_ckpts[shape], dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"], info["missing_keys"]
    assert not info["unexpected_keys"], info["unexpected_keys"]
    assert not info.get("mismatched_keys"), info.get("mismatched_keys")
    assert type(model).__name__ == mrc.PUBLISHED_CONFIGS[shape]["architectures"][0]
    ids = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 5, model.config.vocab_size)
    assert torch.isfinite(logits).all()
    # A layer's q_proj (Qwen3-Next's first layers: the linear attention's in-projection) must be the
    # random values we wrote, not a fresh init.
    name = "model.layers.0.self_attn.q_proj.weight"
    if mrc.PUBLISHED_CONFIGS[shape]["model_type"] == "qwen3_next":
        name = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    elif mrc.PUBLISHED_CONFIGS[shape]["model_type"] == "qwen3_5_moe_text":
        name = "model.layers.0.linear_attn.in_proj_qkv.weight"
    elif mrc.PUBLISHED_CONFIGS[shape].get("q_lora_rank"):   # MLA with a low-rank query: no q_proj
        name = "model.layers.0.self_attn.q_a_proj.weight"
    index = json.loads((tiny_ckpts[shape] / mrc.INDEX_NAME).read_text())
    with safe_open(str(tiny_ckpts[shape] / index["weight_map"][name]), "pt") as h:
        assert torch.equal(model.get_parameter(name), h.get_tensor(name).float())


@pytest.mark.parametrize("shape", SHAPES)
def test_tiny_layout_matches_transformers_save_pretrained(
    tiny_ckpts: dict[str, Path], shape: str, tmp_path: Path
) -> None:
    cfg = transformers.AutoConfig.from_pretrained(tiny_ckpts[shape])
    ref = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    ref.save_pretrained(tmp_path)
    theirs, ours = _read_tensors(tmp_path), _read_tensors(tiny_ckpts[shape])
    assert sorted(ours) == sorted(theirs)
    # transformers keeps some modules in fp32 whatever the model's dtype (GLM's and DeepSeek-V3's
    # router gates since 5.24) and saves them so; published checkpoints store them in the
    # checkpoint's dtype, as ours do. The shapes must agree all the same.
    fp32 = set(ref._keep_in_fp32_modules or ()) | set(getattr(ref, "_keep_in_fp32_modules_strict", None) or ())
    kept = {n for n in theirs if theirs[n][1] == "F32" and any(n.endswith(m) or f".{m}." in n for m in fp32)}
    assert {n: theirs[n][0] for n in kept} == {n: ours[n][0] for n in kept}
    assert {n: v for n, v in ours.items() if n not in kept} == {n: v for n, v in theirs.items() if n not in kept}


@pytest.mark.parametrize("shape", SHAPES)
def test_index_matches_shards(tiny_ckpts: dict[str, Path], shape: str) -> None:
    d = tiny_ckpts[shape]
    index = json.loads((d / mrc.INDEX_NAME).read_text())
    shards = sorted(p.name for p in d.glob("*.safetensors"))
    assert len(shards) > 1 and not list(d.glob("*.tmp"))
    assert sorted(set(index["weight_map"].values())) == shards
    total = 0
    for shard in shards:
        with safe_open(str(d / shard), "pt") as h:
            assert h.metadata() == {"format": "pt"}
            keys = set(h.keys())
            total += sum(h.get_tensor(k).nbytes for k in keys)
        assert keys == {k for k, v in index["weight_map"].items() if v == shard}
    assert index["metadata"]["total_size"] == total


def test_values_follow_hf_init(tiny_ckpts: dict[str, Path]) -> None:
    d = tiny_ckpts["qwen1.5-moe-a2.7b"]
    index = json.loads((d / mrc.INDEX_NAME).read_text())

    def get(name: str) -> torch.Tensor:
        with safe_open(str(d / index["weight_map"][name]), "pt") as h:
            return h.get_tensor(name)

    assert get("model.norm.weight").eq(1).all()
    assert get("model.layers.1.self_attn.k_proj.bias").eq(0).all()
    emb = get("model.embed_tokens.weight").float()
    assert emb.dtype == torch.float32 and abs(emb.std().item() - 0.02) < 0.002 and abs(emb.mean().item()) < 0.002


def test_output_is_deterministic_and_independent_of_sharding(tmp_path: Path) -> None:
    args = ["--shape", "olmoe-1b-7b", "--tiny", "--layers", "1"]
    mrc.main(args + ["--out", str(tmp_path / "a"), "--workers", "1"])
    mrc.main(args + ["--out", str(tmp_path / "b"), "--workers", "2", "--shard-size", "50KB"])
    mrc.main(args + ["--out", str(tmp_path / "c"), "--seed", "1"])
    a, b, c = ({k: v for f in (tmp_path / x).glob("*.safetensors") for k, v in _load(f).items()} for x in "abc")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    with pytest.raises(SystemExit):  # refuses to overwrite without --overwrite
        mrc.main(args + ["--out", str(tmp_path / "a")])
    mrc.main(args + ["--out", str(tmp_path / "a"), "--overwrite", "--shard-size", "50KB"])
    assert len(json.loads((tmp_path / "a" / mrc.INDEX_NAME).read_text())["weight_map"]) == len(a)


def _load(f: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(f), "pt") as h:
        return {k: h.get_tensor(k) for k in h.keys()}


EXPECTED_FULL = {
    # shape: (hidden, experts key, experts, top-k, expert width, layers, heads, kv heads, vocab)
    "qwen3-30b-a3b": (2048, "num_experts", 128, 8, 768, 48, 32, 4, 151936),
    "mixtral-8x7b": (4096, "num_local_experts", 8, 2, 14336, 32, 32, 8, 32000),
    "olmoe-1b-7b": (2048, "num_experts", 64, 8, 1024, 16, 16, 16, 50304),
    "qwen1.5-moe-a2.7b": (2048, "num_experts", 60, 4, 1408, 24, 16, 16, 151936),
    "glm-4.5-air": (4096, "n_routed_experts", 128, 8, 1408, 46, 96, 8, 151552),
    "qwen3-next-80b-a3b": (2048, "num_experts", 512, 10, 512, 48, 16, 2, 151936),
    "deepseek-v2-lite": (2048, "n_routed_experts", 64, 6, 1408, 27, 16, 16, 102400),
    "glm-4.7-flash": (2048, "n_routed_experts", 64, 4, 1536, 47, 20, 20, 154880),
    "gpt-oss-20b": (2880, "num_local_experts", 32, 4, 2880, 24, 64, 8, 201088),
    "gpt-oss-120b": (2880, "num_local_experts", 128, 4, 2880, 36, 64, 8, 201088),
    "qwen3.6-35b-a3b": (2048, "num_experts", 256, 8, 512, 40, 16, 2, 248320),
    "gemma-4-26b-a4b": (2816, "num_experts", 128, 8, 704, 30, 16, 8, 262144),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_full_size_config_numbers(shape: str) -> None:
    hidden, ekey, experts, top_k, width, layers, heads, kv, vocab = EXPECTED_FULL[shape]
    cfg = mrc.build_config(shape)
    assert (cfg["hidden_size"], cfg[ekey], cfg.get("num_experts_per_tok", cfg.get("top_k_experts")),
            cfg["num_hidden_layers"]) == (
        hidden,
        experts,
        top_k,
        layers,
    )
    assert (cfg["moe_intermediate_size"] if "moe_intermediate_size" in cfg else cfg["intermediate_size"]) == width
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]) == (heads, kv, vocab)
    assert cfg["tie_word_embeddings"] is (shape == "gemma-4-26b-a4b") and cfg["torch_dtype"] == "bfloat16"
    assert mrc.build_config(shape, layers=3)["num_hidden_layers"] == 3


def test_full_size_specifics() -> None:
    q3 = mrc.build_config("qwen3-30b-a3b")
    assert (q3["head_dim"], q3["norm_topk_prob"], q3["rope_theta"], q3["max_position_embeddings"]) == (
        128,
        True,
        1e6,
        40960,
    )
    q2 = mrc.build_config("qwen1.5-moe-a2.7b")
    assert (q2["shared_expert_intermediate_size"], q2["norm_topk_prob"]) == (5632, False)
    assert mrc.build_generation_config("qwen3-30b-a3b")["eos_token_id"] == [151645, 151643]
    specs = {s.name: s.shape for s in mrc.plan_tensors(mrc.build_config("qwen3-30b-a3b", layers=1))}
    assert specs["model.layers.0.self_attn.q_proj.weight"] == (4096, 2048)
    assert specs["model.layers.0.self_attn.q_norm.weight"] == (128,)
    assert specs["model.layers.0.mlp.experts.127.down_proj.weight"] == (2048, 768)
    olmoe = {s.name: s.shape for s in mrc.plan_tensors(mrc.build_config("olmoe-1b-7b", layers=1))}
    assert olmoe["model.layers.0.self_attn.k_norm.weight"] == (2048,)
    mix = {s.name: s.shape for s in mrc.plan_tensors(mrc.build_config("mixtral-8x7b", layers=1))}
    assert mix["model.layers.0.block_sparse_moe.experts.7.w2.weight"] == (4096, 14336)


@pytest.mark.parametrize("shape", SHAPES)
def test_full_size_param_count_matches_transformers(shape: str, tmp_path: Path) -> None:
    """Build the real-size model (2 layers) on the meta device: no memory, exact parameter count."""
    cfg = mrc.build_config(shape, layers=2)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hf_cfg = transformers.AutoConfig.from_pretrained(tmp_path)
    assert hf_cfg.hidden_size == cfg["hidden_size"] and hf_cfg.num_hidden_layers == 2
    rope = getattr(hf_cfg, "rope_parameters", None) or {"rope_theta": getattr(hf_cfg, "rope_theta", None)}
    if "rope_theta" in cfg:
        assert rope["rope_theta"] == cfg["rope_theta"]  # legacy top-level rope_theta is understood
    else:   # Gemma 4: one rope per layer type, as written
        assert rope == cfg["rope_parameters"]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    ours = sum(s.numel for s in mrc.plan_tensors(cfg))
    # everything save_pretrained writes: parameters and persistent buffers (GLM's router bias); a tied
    # lm_head is the embedding, not written
    state = model.state_dict()
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight")
    assert sum(t.numel() for t in state.values()) == ours


def test_parse_size() -> None:
    assert mrc.parse_size("4GB") == 4 * 10**9
    assert mrc.parse_size("4GiB") == 4 * 2**30
    assert mrc.parse_size("150KB") == 150_000
    assert mrc.parse_size("123") == 123


def test_hf_baseline_greedy_loop_matches_generate_on_cpu(tiny_ckpts: dict[str, Path], tmp_path: Path) -> None:
    """The peer benchmark's timed manual loop must produce exactly what model.generate produces."""
    spec = importlib.util.spec_from_file_location("hf_baseline", ROOT / "benchmarks" / "hf_baseline.py")
    assert spec and spec.loader
    hfb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hfb)
    common = [
        str(tiny_ckpts["mixtral-8x7b"]),
        "--mode",
        "resident",
        "--device",
        "cpu",
        "--prompt-tokens",
        "8",
        "--gen-tokens",
        "4",
    ]
    runs = {}
    for method in ("loop", "generate"):
        assert hfb.main(common + ["--method", method, "--json", str(tmp_path / f"{method}.json")]) == 0
        runs[method] = json.loads((tmp_path / f"{method}.json").read_text())
    assert runs["loop"]["generated_token_ids"] == runs["generate"]["generated_token_ids"]
    assert len(runs["loop"]["generated_token_ids"]) == 4
    assert runs["loop"]["experts_impl_effective"] == "grouped_mm" and runs["loop"]["decode_tok_s"] > 0


def test_dense_mlp_layers_follow_mlp_only_layers(tmp_path: Path) -> None:
    """Qwen MoE configs may make some layers dense; the planner must mirror transformers there too."""
    cfg = mrc.build_config("qwen3-30b-a3b", layers=2, tiny=True)
    cfg["mlp_only_layers"] = [0]
    names = {s.name: s.shape for s in mrc.plan_tensors(cfg)}
    assert names["model.layers.0.mlp.gate_proj.weight"] == (cfg["intermediate_size"], cfg["hidden_size"])
    assert "model.layers.0.mlp.gate.weight" not in names and "model.layers.1.mlp.gate.weight" in names
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path))
    model.save_pretrained(tmp_path / "ref")
    assert {k: v[0] for k, v in _read_tensors(tmp_path / "ref").items()} == names


def test_glm_air_specifics(tiny_ckpts: dict[str, Path]) -> None:
    """Layer 0 dense, then routed + shared experts; q/k/v biases without q/k norms; the router bias
    stays F32 in a bf16 checkpoint, as on the Hub; moestream reads it as a glm4_moe model."""
    specs = {s.name: s for s in mrc.plan_tensors(mrc.build_config("glm-4.5-air", layers=2))}
    assert specs["model.layers.0.mlp.gate_proj.weight"].shape == (10944, 4096)
    assert "model.layers.0.mlp.gate.weight" not in specs and "model.layers.0.self_attn.q_norm.weight" not in specs
    assert specs["model.layers.1.mlp.experts.127.down_proj.weight"].shape == (4096, 1408)
    assert specs["model.layers.1.mlp.shared_experts.up_proj.weight"].shape == (1408, 4096)
    assert specs["model.layers.1.self_attn.k_proj.bias"].shape == (1024,)
    assert "model.layers.1.self_attn.o_proj.bias" not in specs
    bias = specs["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.shape == (128,) and bias.fp32
    tensors = _read_tensors(tiny_ckpts["glm-4.5-air"])
    assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"][1] == "F32"
    assert tensors["model.layers.1.mlp.gate.weight"][1] == "BF16"
    from moestream.archs import detect_arch, model_config_from_hf

    raw = mrc.build_config("glm-4.5-air")
    config = model_config_from_hf(raw, detect_arch(raw))
    assert (config.rotary_dim, config.qk_norm, config.num_experts, config.shared_intermediate) == (64, "none", 128, 1408)
    assert config.moe_layers[:2] == (False, True) and config.num_moe_layers == 45


def test_qwen3_next_specifics(tmp_path: Path) -> None:
    """Layers 0-2 Gated DeltaNet, layer 3 gated attention (q_proj twice the heads), zero-centred norms
    written as zeros, a sigmoid-gated shared expert; the layout is transformers' own and moestream
    reads the config as a qwen3_next model."""
    cfg = mrc.build_config("qwen3-next-80b-a3b", layers=4)
    specs = {s.name: s for s in mrc.plan_tensors(cfg)}
    assert specs["model.layers.0.linear_attn.in_proj_qkvz.weight"].shape == (12288, 2048)
    assert specs["model.layers.0.linear_attn.in_proj_ba.weight"].shape == (64, 2048)
    assert specs["model.layers.0.linear_attn.conv1d.weight"].shape == (8192, 1, 4)
    assert specs["model.layers.0.linear_attn.out_proj.weight"].shape == (2048, 4096)
    assert "model.layers.2.self_attn.q_proj.weight" not in specs
    assert specs["model.layers.3.self_attn.q_proj.weight"].shape == (8192, 2048)
    assert specs["model.layers.3.self_attn.q_norm.weight"].init == "zeros"
    assert specs["model.norm.weight"].init == "zeros"
    assert specs["model.layers.3.mlp.experts.511.down_proj.weight"].shape == (2048, 512)
    assert specs["model.layers.3.mlp.shared_expert_gate.weight"].shape == (1, 2048)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path))
    # transformers holds the experts fused in memory (and saves them per expert): compare the rest
    dense = {k: tuple(v.shape) for k, v in model.state_dict().items() if ".experts." not in k}
    assert dense == {k: s.shape for k, s in specs.items() if ".experts." not in k}
    from moestream.archs import detect_arch, model_config_from_hf

    config = model_config_from_hf(cfg, detect_arch(cfg))
    assert config.layer_mixers == ("gated_deltanet",) * 3 + ("gated_gqa",)
    assert (config.rotary_dim, config.num_experts, config.top_k, config.shared_intermediate) == (64, 512, 10, 512)


@pytest.mark.parametrize("shape,q_proj,latent_per_token", [("deepseek-v2-lite", "q_proj", 576),
                                                          ("glm-4.7-flash", "q_b_proj", 576)])
def test_mla_specifics(shape: str, q_proj: str, latent_per_token: int) -> None:
    """Multi-head latent attention's tensors at full size; moestream reads the config as an MLA model
    whose cache holds kv_lora_rank + qk_rope_head_dim values per token and layer."""
    cfg = mrc.build_config(shape, layers=2)
    specs = {s.name: s for s in mrc.plan_tensors(cfg)}
    heads, qk, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    assert specs[f"model.layers.0.self_attn.{q_proj}.weight"].shape[0] == heads * qk
    assert specs["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape == (576, 2048)
    assert specs["model.layers.0.self_attn.kv_b_proj.weight"].shape == (heads * (cfg["qk_nope_head_dim"] + v), 512)
    assert specs["model.layers.0.self_attn.o_proj.weight"].shape == (2048, heads * v)
    assert "model.layers.0.mlp.gate.weight" not in specs and "model.layers.1.mlp.gate.weight" in specs
    assert specs["model.layers.1.mlp.shared_experts.up_proj.weight"].shape == (
        cfg["n_shared_experts"] * cfg["moe_intermediate_size"], 2048)
    from moestream.archs import detect_arch, model_config_from_hf
    from moestream.model.decoder import cache_bytes

    config = model_config_from_hf(cfg, detect_arch(cfg))
    assert config.latent_attention.q_lora_rank == cfg["q_lora_rank"] and config.moe_layers == (False, True)
    assert cache_bytes(config, detect_arch(cfg), 1, 1, torch.bfloat16) == 2 * latent_per_token * 2



@pytest.mark.parametrize("shape", SHAPES)
def test_tiny_runs_in_the_engine_like_transformers(tiny_ckpts: dict[str, Path], shape: str) -> None:
    """Every shape the script writes is one the engine reads: fp32 logits as transformers' (the
    benchmarks' random checkpoints go through exactly this loader)."""
    import moestream

    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny_ckpts[shape], dtype=torch.float32)
    ids = torch.randint(0, ref.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids).logits
    got = moestream.load(tiny_ckpts[shape], device="cpu", dtype="float32").logits(ids)
    assert (got - expected).abs().max() / expected.abs().max() <= 1e-4, shape


def test_gemma4_specifics() -> None:
    """Five sliding layers to each full one, the last one full whatever the layer count; full layers
    512 wide with 2 key/value heads and no v_proj (keys are the values); a dense MLP beside 128 stacked
    GeGLU experts; 25.2B parameters at 30 layers (the published total); moestream reads the config as
    a gemma4 model with a ring cache of the window on sliding layers."""
    cfg = mrc.build_config("gemma-4-26b-a4b")
    assert cfg["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 5
    assert mrc.build_config("gemma-4-26b-a4b", layers=8)["layer_types"][4:] == [
        "sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    specs = {s.name: s.shape for s in mrc.plan_tensors(cfg)}
    assert specs["model.layers.0.self_attn.k_proj.weight"] == (8 * 256, 2816)
    assert specs["model.layers.0.self_attn.v_proj.weight"] == (8 * 256, 2816)
    assert specs["model.layers.5.self_attn.q_proj.weight"] == (16 * 512, 2816)
    assert specs["model.layers.5.self_attn.k_proj.weight"] == (2 * 512, 2816)
    assert "model.layers.5.self_attn.v_proj.weight" not in specs and "lm_head.weight" not in specs
    assert specs["model.layers.0.mlp.gate_proj.weight"] == (2112, 2816)
    assert specs["model.layers.0.experts.gate_up_proj"] == (128, 2 * 704, 2816)
    assert specs["model.layers.0.experts.down_proj"] == (128, 2816, 704)
    total = sum(s.numel for s in mrc.plan_tensors(cfg))
    assert 25.1e9 < total < 25.3e9
    from moestream.archs import detect_arch, model_config_from_hf
    from moestream.model.decoder import cache_bytes

    config = model_config_from_hf(cfg, detect_arch(cfg))
    assert (config.num_experts, config.top_k, config.vocab_size) == (128, 8, 262144)
    # a 2-layer cut (sliding, full) at a context beyond the window: the sliding layer holds the window only
    two = mrc.build_config("gemma-4-26b-a4b", layers=2)
    two_config = model_config_from_hf(two, detect_arch(two))
    per_row = cache_bytes(two_config, detect_arch(two), 1, 4096, torch.bfloat16)
    bf16_kv = 2 * 2   # keys and values, 2 bytes each
    assert per_row == bf16_kv * (1024 * 8 * 256 + 4096 * 2 * 512)


@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "deepseek-v2-lite"])
def test_fp8_block_form_loads_as_fp8_and_matches_transformers(shape: str, tmp_path: Path) -> None:
    """--fp8-block writes the FP8 checkpoints' layout (e4m3 weights of every decoder linear but the
    router, float32 scale grids, quantization_config), which moestream keeps in FP8 and computes as
    transformers does on the dequantized weights."""
    import moestream
    from safetensors.torch import load_file, save_file
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    out = tmp_path / "fp8"
    assert mrc.main(["--shape", shape, "--tiny", "--out", str(out), "--fp8-block", "16x24", "--workers", "1",
                     "--shard-size", "150KB"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [16, 24]}
    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    fp8 = [n for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn]
    assert any(".experts.0.down_proj" in n for n in fp8) and any("self_attn" in n for n in fp8)
    assert not any(n.endswith("mlp.gate.weight") or "embed" in n or "lm_head" in n for n in fp8)
    ref = {}
    for name, t in tensors.items():
        if name.endswith("weight_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            scale = tensors[name.removesuffix("weight") + "weight_scale_inv"]
            n, k = t.shape
            assert scale.dtype == torch.float32 and scale.shape == (-(-n // 16), -(-k // 24))
            t = _dequantize_fp8_weight(t, scale, [16, 24], torch.float32)
        ref[name] = t.float()
    (tmp_path / "ref").mkdir()
    save_file(ref, str(tmp_path / "ref" / "model.safetensors"))
    (tmp_path / "ref" / "config.json").write_text(json.dumps({k: v for k, v in config.items()
                                                              if k != "quantization_config"}))
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ref", dtype=torch.float32).eval()
    engine = moestream.load(out, device="cpu", dtype="float32", capacity=12 if "qwen" in shape else None)
    assert engine.plan.kind == "fp8" and engine.plan.fp8.name == "fp8-b16x24"
    ids = torch.randint(0, 200, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = reference(ids).logits
    got = engine.logits(ids, torch.ones_like(ids))
    assert (got - want).abs().max() / want.abs().max() <= 1e-4


def _routing(ckpt: Path, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each sparse layer's chosen experts for every token of `ids` (transformers, fp32), as sorted (T, k)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    with torch.no_grad():
        logits = model(ids, output_router_logits=True).router_logits
    k = model.config.num_experts_per_tok
    return [r.reshape(-1, r.shape[-1]).topk(k, dim=-1).indices.sort(dim=-1).values for r in logits]


@pytest.mark.parametrize("shape,layers", [("qwen3-30b-a3b", "3"), ("qwen3-next-80b-a3b", "4")])
def test_token_routing_picks_each_tokens_experts_by_the_token_alone(tmp_path: Path, shape: str, layers: str) -> None:
    """--token-routing: one token routes to the same experts wherever it stands in the prompt, in every
    layer (a random model's own routers do not: its second token in a context routes elsewhere), and a
    varied prompt reaches nearly every expert of every layer."""
    out = {}
    for flag in ([], ["--token-routing"]):
        out[bool(flag)] = tmp_path / ("token" if flag else "plain")
        assert mrc.main(["--shape", shape, "--tiny", "--layers", layers, "--out", str(out[bool(flag)]),
                         "--workers", "2", *flag]) == 0
    vocab = json.loads((out[True] / "config.json").read_text())["vocab_size"]
    ids = torch.randint(0, vocab, (1, 96), generator=torch.Generator().manual_seed(1))
    ids[0, 50:60] = ids[0, 3]   # one token again, ten times, in another context
    routed = _routing(out[True], ids)
    for layer in routed:
        assert all(torch.equal(layer[t], layer[3]) for t in range(50, 60))
        assert layer.unique().numel() >= 0.9 * json.loads((out[True] / "config.json").read_text())["num_experts"]
    plain = _routing(out[False], ids)
    assert any(not torch.equal(layer[t], layer[3]) for layer in plain for t in range(50, 60))


def test_token_routing_is_refused_where_it_is_not_written() -> None:
    with pytest.raises(SystemExit, match="--token-routing is written for"):
        mrc.planned("gpt-oss-20b", 2, "bf16", True, token_routing=True)
