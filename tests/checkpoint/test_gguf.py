"""GGUF checkpoints run as they are: the same logits as transformers' own GGUF loader (its names,
its dequantization through the gguf package) on a tiny Qwen3-MoE in every ggml type we read, the
other families against the weights their GGUF stands for, block types bit-exact against gguf's
dequantization, a bounded bank token-identical to the resident one, the tokenizer and chat template
from the metadata, split sets, and bad input refused in one sentence."""

import json

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import moestream
from moestream import cli
from moestream.checkpoint.gguf_index import _unpermute
from moestream.errors import CheckpointError, UnsupportedArchError
from moestream.experts.format import ExpertShape
from moestream.quant import QuantSpec, dequantize, ggml, quantize
from moestream.quant.mxfp4 import dequantize_mxfp4
from gguf_checkpoints import make_gguf, random_k_blocks

COMMON = dict(vocab_size=160, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, num_hidden_layers=2, num_experts_per_tok=2)
IDS = torch.randint(2, 150, (2, 13), generator=torch.Generator().manual_seed(3))
MASK = torch.ones_like(IDS)
MASK[1, :4] = 0
PROMPT = IDS[0, :7].tolist()
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


def tiny_config(arch: str) -> transformers.PretrainedConfig:
    """Widths of 256 (every K-quant super-block) and 8 experts."""
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**COMMON, head_dim=64, intermediate_size=256, moe_intermediate_size=256,
                                           num_experts=8, norm_topk_prob=True)
    if arch == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**COMMON, intermediate_size=256, moe_intermediate_size=256,
                                           shared_expert_intermediate_size=256, num_experts=8)
    if arch == "mixtral":
        return transformers.MixtralConfig(**COMMON, intermediate_size=256, num_local_experts=8)
    if arch == "glm4_moe":   # layer 0 dense, 2 groups of 4 experts with 1 kept, half-rotary heads
        return transformers.Glm4MoeConfig(**{**COMMON, "num_hidden_layers": 3}, head_dim=64, intermediate_size=256,
                                          moe_intermediate_size=256, n_routed_experts=8, n_group=2, topk_group=1,
                                          n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                                          use_qk_norm=True, attention_bias=True)
    if arch in ("deepseek_v2", "deepseek_v3"):   # latent attention; layer 0 dense; grouped routing
        mla = dict(hidden_size=128, intermediate_size=128, moe_intermediate_size=64, n_routed_experts=8,
                   kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, first_k_dense_replace=1,
                   num_hidden_layers=3)
        if arch == "deepseek_v2":   # a plain q_proj (V2-Lite), softmax limited to the 2 best of 4 groups
            return transformers.DeepseekV2Config(**{**COMMON, **mla, "num_key_value_heads": 4}, q_lora_rank=None,
                                                 topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                                 routed_scaling_factor=1.5, n_shared_experts=2, norm_topk_prob=False)
        return transformers.DeepseekV3Config(**{**COMMON, **mla, "num_key_value_heads": 4}, q_lora_rank=64, n_group=2,
                                             topk_group=1, routed_scaling_factor=2.5, n_shared_experts=1,
                                             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                                              "factor": 4.0, "original_max_position_embeddings": 64,
                                                              "beta_fast": 32, "beta_slow": 1, "mscale": 0.8,
                                                              "mscale_all_dim": 0.8})
    return transformers.OlmoeConfig(**COMMON, intermediate_size=256, num_experts=8, clip_qkv=4.0, pad_token_id=0,
                                    eos_token_id=1)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_hf")
    out = {}
    for arch in ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe", "deepseek_v2", "deepseek_v3"):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(tiny_config(arch)).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("gate.weight"):
                    p.normal_(0, 0.5)
                elif "norm" in name:
                    p.add_(torch.randn_like(p) * 0.1)
                elif name.endswith("bias"):
                    p.normal_(0, 0.1)
                elif arch.startswith("deepseek") and ".self_attn." in name and p.dim() == 2:
                    p.normal_(0, p.shape[1] ** -0.5)   # latent attention that moves the logits
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):   # so the selection-only bias changes choices
                    b.normal_(0, 0.5)
        model.save_pretrained(root / arch)
        out[arch] = root / arch
    return out


def relative(out, ref):
    valid = MASK.bool()
    return ((out - ref)[valid].abs().max() / ref[valid].abs().max()).item()


def transformers_gguf(path) -> transformers.PreTrainedModel:
    """transformers' own GGUF loading (names, permutations, dequantization by the gguf package).
    Its qwen3_moe config map lacks expert_feed_forward_length, so that one size is given here."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = load_gguf_checkpoint(str(path))["config"]
    config["moe_intermediate_size"] = gguf.GGUFReader(path).fields["qwen3moe.expert_feed_forward_length"].contents()
    config = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        shell = transformers.AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=shell)["tensors"]
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    result = model.load_state_dict(tensors, strict=False)
    assert not result.missing_keys and not result.unexpected_keys
    return model


def greedy(model, prompt, n=12):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


# (experts' type, attention linears' type, the experts' held format, attention kept as QuantLinear)
TYPES = [("F32", "F32", "fp32", False), ("F16", "F16", "fp32", False), ("Q8_0", "Q8_0", "int8-g32", True),
         ("Q4_0", "Q4_1", "int4-g32", True), ("Q4_1", "Q8_0", "int4-g32", True), ("Q4_K", "Q4_K", "int4-g32", True),
         ("Q5_K", "Q5_K", "int8-g32", True), ("Q5_0", "Q5_1", "int8-g32", True),
         ("BF16", "Q5_0", "fp32", True), ("MXFP4", "Q8_0", "mxfp4", True)]


@pytest.mark.parametrize("experts,dense,held,quant_linear", TYPES, ids=[t[0] for t in TYPES])
def test_qwen3_moe_matches_transformers_gguf_loader(hf_models, tmp_path, experts, dense, held, quant_linear):
    path = tmp_path / f"tiny-{experts}.gguf"
    make_gguf(hf_models["qwen3_moe"], path, experts=experts, dense=dense)
    reference = transformers_gguf(path)
    engine = moestream.load(str(path), device="cpu", dtype="float32")
    assert engine.plan.kind == "gguf" and {f.name for f in engine.bank.formats.values()} == {held}
    o_proj = engine.model.model.layers[0].self_attn.o_proj
    assert (type(o_proj).__name__ == "QuantLinear") == quant_linear
    assert_matches(engine, reference, path)


def assert_matches(engine, reference, path) -> None:
    """The engine on a GGUF: the logits of `reference` (transformers) within 1e-4, its greedy tokens,
    and a bounded bank's tokens the resident engine's."""
    with torch.no_grad():
        ref = reference(IDS, attention_mask=MASK).logits
    assert relative(engine.logits(IDS, MASK), ref) <= 1e-4
    got = engine.generate(PROMPT, max_tokens=12, ignore_eos=True)
    assert got == greedy(reference, PROMPT)[:len(got)] and len(got) == 12
    bounded = moestream.load(str(path), device="cpu", dtype="float32", capacity=3)
    assert not bounded.plan.memory.fully_resident
    assert bounded.generate(PROMPT, max_tokens=12, ignore_eos=True) == got


@pytest.mark.parametrize("arch,experts,kw", [("qwen2_moe", "Q8_0", {}), ("mixtral", "Q4_0", {}),
                                             ("olmoe", "Q4_K", {}), ("glm4_moe", "Q4_1", {}),
                                             ("deepseek_v2", "Q8_0", {}),
                                             ("deepseek_v3", "Q4_0", {"kv_b_split": True}),
                                             ("qwen3_moe", "Q4_K", {"fuse_gate_up": True})],
                         ids=["qwen2_moe", "mixtral", "olmoe", "glm4_moe", "deepseek_v2", "deepseek_v3-kv_b-split",
                              "qwen3_moe-gate-up-fused"])
def test_other_families_match_the_weights_their_gguf_holds(hf_models, tmp_path, arch, experts, kw):
    """The reference is the HF model holding gguf's dequantization of every stored tensor (Mixtral's
    q/k rows permuted by the writer as llama.cpp's converter does; DeepSeek's kv_b_proj split per
    head as newer conversions write it; gate and up experts in one stack, as --fuse-gate-up-exps
    writes them)."""
    path, ref_folder = tmp_path / "m.gguf", tmp_path / "ref"
    make_gguf(hf_models[arch], path, ref_folder, experts=experts, dense=experts, **kw)
    reference = transformers.AutoModelForCausalLM.from_pretrained(ref_folder, dtype=torch.float32).eval()
    engine = moestream.load(str(path), device="cpu", dtype="float32")
    with torch.no_grad():
        assert relative(engine.logits(IDS, MASK), reference(IDS, attention_mask=MASK).logits) <= 1e-4
    bounded = moestream.load(str(path), device="cpu", dtype="float32", capacity=2)
    assert bounded.generate(PROMPT, max_tokens=8, ignore_eos=True) == engine.generate(PROMPT, max_tokens=8,
                                                                                     ignore_eos=True)


@pytest.fixture(scope="module")
def gpt_oss_hf(tmp_path_factory):
    """A tiny gpt-oss whose widths MXFP4's 32-value blocks divide (hidden and experts 32), sliding layers,
    sinks, biases and YaRN as the family has them."""
    folder = tmp_path_factory.mktemp("gguf_gpt_oss") / "gpt_oss"
    config = transformers.GptOssConfig(vocab_size=160, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                       max_position_embeddings=256, intermediate_size=32, num_hidden_layers=3,
                                       head_dim=8, num_local_experts=8, num_experts_per_tok=2, sliding_window=6,
                                       eos_token_id=1)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")) or "norm" in name:
                p.add_(torch.randn_like(p) * 0.5)
            elif "experts" in name:
                p.normal_(0, 0.5)
    model.save_pretrained(folder)
    return folder


# MXFP4 experts keep their bytes; block types the affine formats hold only without biases are dequantized
@pytest.mark.parametrize("experts,held", [("MXFP4", "mxfp4"), ("Q8_0", "fp32"), ("F32", "fp32")])
def test_gpt_oss_gguf_is_the_model_its_weights_make(gpt_oss_hf, tmp_path, experts, held):
    """llama.cpp's gpt-oss layout (gate and up split, biases beside them, sinks, post-attention norms,
    the sliding pattern and YaRN in the metadata): the same logits as transformers on the weights
    the GGUF holds, MXFP4 experts kept in their bytes; a bounded bank equal to the resident one."""
    path, ref_folder = tmp_path / "gpt-oss.gguf", tmp_path / "ref"
    make_gguf(gpt_oss_hf, path, ref_folder, experts=experts, dense="Q8_0")
    engine = moestream.load(str(path), device="cpu", dtype="float32")
    assert engine.config.sliding_window == 6 and {f.name for f in engine.bank.formats.values()} == {held}
    reference = transformers.AutoModelForCausalLM.from_pretrained(ref_folder, dtype=torch.float32).eval()
    assert_matches(engine, reference, path)


@pytest.mark.parametrize("experts", ["F32", "MXFP4"])
def test_gpt_oss_gguf_with_gate_and_up_fused_is_the_model_unfused(gpt_oss_hf, tmp_path, experts):
    """--fuse-gate-up-exps on gpt-oss fuses the biases too (ffn_gate_up_exps.bias, (E, 2I), each
    expert's gate biases then its up biases): the same logits, bit for bit, as the file of the same
    weights written unfused, and transformers' on the weights it holds."""
    plain, fused, ref_folder = tmp_path / "plain.gguf", tmp_path / "fused.gguf", tmp_path / "ref"
    make_gguf(gpt_oss_hf, plain, experts=experts, dense="Q8_0")
    make_gguf(gpt_oss_hf, fused, ref_folder, experts=experts, dense="Q8_0", fuse_gate_up=True)
    names = {t.name for t in gguf.GGUFReader(fused).tensors}
    assert {"blk.0.ffn_gate_up_exps.weight", "blk.0.ffn_gate_up_exps.bias"} <= names
    assert not any(n.endswith(("ffn_gate_exps.bias", "ffn_up_exps.bias", "ffn_gate_exps.weight")) for n in names)
    engine = moestream.load(str(fused), device="cpu", dtype="float32")
    assert {f.name for f in engine.bank.formats.values()} == {"mxfp4" if experts == "MXFP4" else "fp32"}
    logits = engine.logits(IDS, MASK)
    assert torch.equal(logits, moestream.load(str(plain), device="cpu", dtype="float32").logits(IDS, MASK))
    reference = transformers.AutoModelForCausalLM.from_pretrained(ref_folder, dtype=torch.float32).eval()
    with torch.no_grad():
        assert relative(logits, reference(IDS, attention_mask=MASK).logits) <= 1e-4


def test_gpt_oss_gguf_fused_without_its_gate_up_bias_is_refused(gpt_oss_hf, tmp_path, capsys):
    """A fused gpt-oss file lacking the fused bias its experts need: refused in one sentence naming it."""
    path = tmp_path / "nobias.gguf"
    make_gguf(gpt_oss_hf, path, experts="F32", dense="F32", fuse_gate_up=True, omit=("blk.1.ffn_gate_up_exps.bias",))
    with pytest.raises(CheckpointError, match=r"tensor 'blk\.1\.ffn_gate_up_exps\.bias' is missing from nobias\.gguf"):
        moestream.load(str(path), device="cpu")
    _cli_refuses(path, capsys, "'blk.1.ffn_gate_up_exps.bias' is missing")


@pytest.fixture(scope="module")
def qwen3_next_hf(tmp_path_factory):
    """A tiny Qwen3-Next whose widths Q8_0's and Q4_0's 32-value blocks divide: linear attention in
    layers 0 and 2 (2 key heads serving 4 value heads), gated full attention in 1 and 3
    (full_attention_interval 2, which config.json states as Qwen's own configs do), rotary on a
    quarter of each head, a gated shared expert; norms, dt_bias and the routers randomised."""
    folder = tmp_path_factory.mktemp("gguf_qwen3_next") / "qwen3_next"
    config = transformers.Qwen3NextConfig(vocab_size=160, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=256, head_dim=16, intermediate_size=64,
                                          moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                          num_hidden_layers=4, num_experts=8, num_experts_per_tok=2,
                                          full_attention_interval=2, linear_conv_kernel_dim=4, linear_num_key_heads=2,
                                          linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                                          eos_token_id=1)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            elif name.endswith(("gate.weight", "dt_bias")):
                p.normal_(0, 0.5)
            elif name.endswith("A_log"):   # decays from slow to fast, some heads forgetting within a few tokens
                p.copy_(torch.linspace(-3, 1.5, p.numel()))
    model.save_pretrained(folder)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "full_attention_interval": 2}))
    return folder


# (experts' and dense type, layout, attn_gate's type, what in_proj_qkvz is held as: its blocks' spec or floats)
QWEN3_NEXT = [("F32", "current", None, "float32"), ("Q8_0", "current", None, "int8-g32"),
              ("Q4_0", "legacy", None, "int4-g32"), ("Q8_0", "fused-qkv", "Q4_0", "int8-g32"),
              ("Q4_0", "current", "F16", "float32, dequantized")]


@pytest.mark.parametrize("qtype,layout,gate,held", QWEN3_NEXT, ids=["F32", "Q8_0", "Q4_0-legacy-ssm_in",
                                                                   "Q8_0-fused-qkv-Q4_0-gate", "Q4_0-F16-gate"])
def test_qwen3_next_gguf_is_the_model_its_weights_make(qwen3_next_hf, tmp_path, capsys, qtype, layout, gate, held):
    """llama.cpp's qwen3next layout (its converter's transforms: ssm_* names, -exp(A_log), norms + 1,
    conv1d squeezed, in_proj_qkvz regrouped into attn_qkv + attn_gate, or whole as ssm_in in older
    conversions; full-attention q/k/v fused by --fuse-qkv): the same logits and greedy tokens as
    transformers on the weights the GGUF holds; a bounded bank equal to the resident one. A linear
    rebuilt from parts of exact block types stays in its blocks (at the wider one's bits), one with a
    float part is read as floats; check says which, and plans the bytes the model holds."""
    from moestream.engine.weights import parameter_bytes

    path, ref_folder = tmp_path / "qwen3-next.gguf", tmp_path / "ref"
    make_gguf(qwen3_next_hf, path, ref_folder, experts=qtype, dense=qtype, layout=layout, gate=gate)
    engine = moestream.load(str(path), device="cpu", dtype="float32")
    layers = engine.model.model.layers
    assert engine.config.layer_mixers == ("gated_deltanet", "gated_gqa") * 2
    qkvz = layers[0].linear_attn.in_proj_qkvz
    assert getattr(getattr(qkvz, "spec", None), "name", "float32") == held.removesuffix(", dequantized")
    assert (type(layers[1].self_attn.q_proj).__name__ == "QuantLinear") == (qtype != "F32")
    assert {f.name for f in engine.bank.formats.values()} == {{"F32": "fp32", "Q8_0": "int8-g32",
                                                               "Q4_0": "int4-g32"}[qtype]}
    reference = transformers.AutoModelForCausalLM.from_pretrained(ref_folder, dtype=torch.float32).eval()
    assert type(reference).__name__ == "Qwen3NextForCausalLM"
    assert_matches(engine, reference, path)
    assert engine.plan.memory.dense_bytes == parameter_bytes(engine.model, torch.float32)
    assert cli.main(["check", str(path), "--device", "cpu", "--capacity", "3"]) == 0
    out = capsys.readouterr().out
    assert f"model             {path} (qwen3_next, 4 layers, 8 experts, top-2)" in out
    rebuilt = f"in_proj_qkvz from attn_qkv + attn_gate ({qtype}/{gate or qtype} -> {held}) (2 layers)"
    assert (rebuilt in out) == (layout != "legacy") and ("q_proj from attn_qkv" in out) == (layout == "fused-qkv")


def test_qwen3_next_gguf_with_a_positive_ssm_a_is_refused(qwen3_next_hf, tmp_path, capsys):
    """ssm_a holds -exp(A_log), never positive: a GGUF whose ssm_a is (A_log written as it is, the
    converter's transform skipped) is refused in one sentence rather than run with inverted decays."""
    path = tmp_path / "raw-a-log.gguf"
    make_gguf(qwen3_next_hf, path, experts="Q8_0", dense="Q8_0", skip_a_log=True)
    with pytest.raises(CheckpointError, match="holds positive values where llama.cpp stores -exp"):
        moestream.load(str(path), device="cpu")
    _cli_refuses(path, capsys, "ssm_a")


def test_unpermute_is_transformers_reverse_permutation():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = torch.randn(64, 24)
    theirs = LlamaTensorProcessor({})._reverse_permute_weights(w.numpy(), 4, 2)
    assert torch.equal(_unpermute(w, 2), torch.from_numpy(theirs))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4"])
def test_block_types_dequantize_as_gguf_does(qtype):
    rng = np.random.default_rng(1)
    if qtype in ("Q4_K", "Q5_K", "Q6_K"):
        blocks = random_k_blocks(6, 512, qtype, rng, 0.01)
    else:
        weights = rng.standard_normal((6, 512)).astype(np.float32)
        blocks = gguf.quants.quantize(weights, gguf.GGMLQuantizationType[qtype])
    theirs = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype])
    ours = ggml.dequantize_blocks(torch.from_numpy(blocks), qtype, 512)
    assert torch.equal(ours, torch.from_numpy(theirs))   # bit for bit
    if qtype in ggml.EXACT:   # and the affine form the kernels read holds exactly those weights
        q = ggml.to_affine(torch.from_numpy(blocks), qtype)
        scales = torch.float16 if qtype in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1") else torch.float32   # d, m fp16
        assert q.spec == QuantSpec("int", ggml.EXACT[qtype][2], 32, scales)
        assert torch.equal(dequantize(q.qweight, q.scales, q.biases, q.spec), torch.from_numpy(theirs))
    if qtype == "MXFP4":   # and moestream's MXFP4 bytes the kernels read hold exactly those weights
        codes, scales = ggml.to_mxfp4(torch.from_numpy(blocks))
        assert codes.shape == (6, 256) and scales.shape == (6, 16)
        assert torch.equal(dequantize_mxfp4(codes, scales), torch.from_numpy(theirs))


def test_types_held_together_keep_fp16_scales_only_where_each_type_has_them():
    """A layer's or a linear's mix of exact types: the widest codes, fp16 only if every type's scales
    and offsets are exact in it (Q4_K's d·sc and dmin·m are not)."""
    assert ggml.common_spec(["Q4_0", "Q8_0"]) == QuantSpec("int", 8, 32, torch.float16)
    assert ggml.common_spec(["Q4_0", "Q4_1"]) == QuantSpec("int", 4, 32, torch.float16)
    assert ggml.common_spec(["Q4_0", "Q4_K"]) == QuantSpec("int", 4, 32, torch.float32)
    assert ggml.common_spec(["Q4_K", "Q6_K"]) == QuantSpec("int", 8, 32, torch.float32)


def test_a_block_scale_whose_offset_overflows_fp16_is_refused():
    """Q4_0's offset −8·d is held in fp16: a d past 8,188 (no weight's) would overflow, so the tensor
    is refused with a reason instead of read as infinities."""
    def q4_0_block(d: float) -> torch.Tensor:   # 18 bytes: d in fp16, then 16 bytes of codes
        return torch.from_numpy(np.frombuffer(np.float16(d).tobytes() + bytes(range(16)), dtype=np.uint8).copy())[None]

    held = ggml.to_affine(q4_0_block(8000.0), "Q4_0")
    assert held.scales.dtype == held.biases.dtype == torch.float16 and float(held.biases[0, 0]) == -64000.0
    with pytest.raises(CheckpointError, match="exceeds fp16's range"):
        ggml.to_affine(q4_0_block(12288.0), "Q4_0")


def test_q6k_experts_are_requantized_to_int8_with_the_error_said_once(hf_models, tmp_path, capfd):
    path, ref_folder = tmp_path / "q4km.gguf", tmp_path / "ref"
    make_gguf(hf_models["qwen3_moe"], path, ref_folder, experts="Q4_K", down="Q6_K", dense="Q4_K")
    engine = moestream.load(str(path), device="cpu", dtype="float32")
    err = capfd.readouterr().err
    assert err.count("Q6_K experts have no exact form") == 1 and "int8-g32" in err
    assert {f.name for f in engine.bank.formats.values()} == {"int8-g32"}
    # the oracle: the GGUF's weights, the Q6_K down projections through int8-g32 as moestream holds them
    tensors = load_file(str(ref_folder / "model.safetensors"))
    spec = QuantSpec("int", 8, 32, torch.float32)
    requantized = tmp_path / "requantized"
    requantized.mkdir()
    for name, w in tensors.items():
        if ".experts." in name and name.endswith("down_proj.weight"):
            q = quantize(w, spec)
            tensors[name] = dequantize(q.qweight, q.scales, q.biases, spec)
    save_file(tensors, str(requantized / "model.safetensors"))
    (requantized / "config.json").write_text((ref_folder / "config.json").read_text())
    out = engine.logits(IDS, MASK)
    with torch.no_grad():
        ref = transformers.AutoModelForCausalLM.from_pretrained(requantized, dtype=torch.float32).eval()
        assert relative(out, ref(IDS, attention_mask=MASK).logits) <= 1e-4
        exact = transformers.AutoModelForCausalLM.from_pretrained(ref_folder, dtype=torch.float32).eval()
        assert relative(out, exact(IDS, attention_mask=MASK).logits) <= 2e-2


# experts' type → what moestream holds them as, and the bytes of one (I, H) projection's codes, scales and biases
# (Q4_0: an fp16 scale and offset a group, 5 bits a weight)
HELD = {"Q4_0": ("int4-g32", lambda I, H: I * H // 2 + I * H // 32 * 4),
        "MXFP4": ("mxfp4", lambda I, H: I * H // 2 + I * H // 32)}


@pytest.mark.parametrize("experts", list(HELD))
def test_bytes_planned_are_the_bytes_held(hf_models, tmp_path, capsys, experts):
    from moestream.engine.weights import parameter_bytes

    path = tmp_path / f"{experts}.gguf"
    make_gguf(hf_models["qwen3_moe"], path, experts=experts, dense="Q8_0")
    engine = moestream.load(str(path), device="cpu", dtype="float32", capacity=3, host_tier="pinned",
                            cpu_misses=1.0)
    resident = moestream.load(str(path), device="cpu", dtype="float32")
    assert engine.generate(PROMPT, max_tokens=8, ignore_eos=True) == resident.generate(PROMPT, max_tokens=8,
                                                                                       ignore_eos=True)
    shape = ExpertShape.of(engine.config)
    fmt = engine.bank.formats[0]
    I, H = shape.intermediate, shape.hidden
    name, projection_bytes = HELD[experts]
    assert fmt.name == name and fmt.nbytes(shape) == 3 * projection_bytes(I, H) == engine.plan.memory.slot_bytes
    assert sum(t.nbytes for t in engine.bank.slots[0].tensors.values()) == 3 * fmt.nbytes(shape)
    assert engine.plan.memory.dense_bytes == parameter_bytes(engine.model, torch.float32)
    assert cli.main(["check", str(path), "--device", "cpu", "--capacity", "3"]) == 0
    assert f"{experts}/{experts}/{experts} -> {name}, exact (gate/up/down; 2 layers)" in capsys.readouterr().out


def test_tokenizer_and_chat_template_come_from_the_metadata(hf_models, tmp_path, capsys):
    path = tmp_path / "chat.gguf"
    make_gguf(hf_models["qwen3_moe"], path, experts="Q8_0", dense="Q8_0", tokenizer=True, template=TEMPLATE)
    engine = moestream.load(str(path), device="cpu", dtype="float32")
    tok = engine.tokenizer
    assert tok is not None and tok.chat_template == TEMPLATE
    ids = tok("ABCD").input_ids
    assert ids == [152, 153] and tok.decode(ids) == "ABCD"   # the two merges of the metadata's BPE
    assert cli.main(["run", str(path), "-p", "AB", "--max-tokens", "3", "--device", "cpu"]) == 0
    assert cli.main(["run", str(path), "-p", "AB", "--max-tokens", "3", "--device", "cpu", "--chat"]) == 0


def _bpe_gguf(path, pre: str, add_bos: bool = False):
    """A tokenizer-only GGUF: GPT-2's 256 byte characters, merges into "Ġt", "he", "Ġthe", "12", "123",
    one control token and one user-defined token (an added token that is not special)."""
    from gguf_checkpoints import _bytes_to_unicode

    chars = _bytes_to_unicode()
    merges = ["Ġ t", "h e", "Ġt he", "1 2", "12 3"]
    tokens = chars + [m.replace(" ", "") for m in merges] + ["<|im_start|>", "<tool_call>"]
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 2) + [3, 4])
    w.add_token_merges(merges)
    w.add_bos_token_id(len(tokens) - 2)
    w.add_eos_token_id(len(tokens) - 2)
    w.add_add_bos_token(add_bos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tokens


TEXTS = ["the theme", "  the\n\nthe 12345 x", "<|im_start|>the<tool_call>12", "Ünïcödé — the 1 2 3", "it's THE end\t"]


def test_a_bpe_vocabulary_tokenizes_as_transformers_gguf_support_does(tmp_path):
    from moestream.checkpoint.gguf_file import GGUFCheckpoint
    from moestream.checkpoint.gguf_tokenizer import load_gguf_tokenizer

    tokens = _bpe_gguf(tmp_path / "tok.gguf", "qwen2")
    ours = load_gguf_tokenizer(GGUFCheckpoint(tmp_path / "tok.gguf"))
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tok.gguf")
    for text in TEXTS:
        ids = ours(text).input_ids
        assert ids == ref(text).input_ids, text
        assert ours.decode(ids) == text
    assert ours("the").input_ids == [tokens.index("t"), tokens.index("he")]   # "Ġthe" only after a space
    assert ours(" the").input_ids == [tokens.index("Ġthe")]
    assert ours("<|im_start|>").input_ids == [len(tokens) - 2] and ours("<tool_call>").input_ids == [len(tokens) - 1]
    assert "<|im_start|>" in ours.all_special_tokens and "<tool_call>" not in ours.all_special_tokens


def test_a_llama3_vocabulary_splits_digits_by_three_and_adds_its_bos(tmp_path):
    from moestream.checkpoint.gguf_file import GGUFCheckpoint
    from moestream.checkpoint.gguf_tokenizer import load_gguf_tokenizer

    tokens = _bpe_gguf(tmp_path / "tok.gguf", "llama-bpe", add_bos=True)
    ours = load_gguf_tokenizer(GGUFCheckpoint(tmp_path / "tok.gguf"))
    bos = len(tokens) - 2
    assert ours("12345").input_ids == [bos, tokens.index("123"), tokens.index("4"), tokens.index("5")]
    qwen = load_gguf_tokenizer(GGUFCheckpoint(_bpe_gguf(tmp_path / "q.gguf", "qwen2") and tmp_path / "q.gguf"))
    assert qwen("12345").input_ids == [tokens.index(c) for c in "12345"]   # Qwen's digits go one by one


def test_a_split_set_reads_as_one_file(hf_models, tmp_path):
    single, split = tmp_path / "one.gguf", tmp_path / "parts" / "model.gguf"
    split.parent.mkdir()
    make_gguf(hf_models["qwen3_moe"], single, experts="Q8_0")
    make_gguf(hf_models["qwen3_moe"], split, experts="Q8_0", split=20)
    parts = sorted(p.name for p in split.parent.iterdir())
    assert len(parts) > 1 and parts[0] == f"model-00001-of-{len(parts):05d}.gguf"
    first = split.parent / parts[0]
    out = moestream.load(str(first), device="cpu", dtype="float32").logits(IDS, MASK)
    assert torch.equal(out, moestream.load(str(single), device="cpu", dtype="float32").logits(IDS, MASK))
    with pytest.raises(CheckpointError, match="give the first part"):
        moestream.load(str(split.parent / parts[1]), device="cpu")
    (split.parent / parts[-1]).unlink()
    with pytest.raises(CheckpointError, match=f"part {parts[-1]} of the split GGUF .* is missing"):
        moestream.load(str(first), device="cpu")


def _cli_refuses(path, capsys, match):
    before = sorted(p.name for p in path.parent.iterdir())
    assert cli.main(["run", str(path), "-p", "3 4", "--max-tokens", "2", "--device", "cpu"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0] and "Traceback" not in err[0]
    assert sorted(p.name for p in path.parent.iterdir()) == before   # nothing written


def test_an_unknown_architecture_is_refused(tmp_path, capsys):
    path = tmp_path / "bert.gguf"
    writer = gguf.GGUFWriter(path, "bert")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedArchError, match="architecture 'bert'"):
        moestream.load(str(path), device="cpu")
    _cli_refuses(path, capsys, "architecture 'bert'")


def test_an_unsupported_tensor_type_is_refused(hf_models, tmp_path, capsys):
    path = tmp_path / "iq.gguf"
    make_gguf(hf_models["qwen3_moe"], path, experts="IQ4_NL")
    with pytest.raises(CheckpointError, match="stored as IQ4_NL, a ggml type moestream does not read"):
        moestream.load(str(path), device="cpu")
    _cli_refuses(path, capsys, "IQ4_NL")


def test_a_truncated_gguf_is_refused(hf_models, tmp_path, capsys):
    path = tmp_path / "cut.gguf"
    make_gguf(hf_models["qwen3_moe"], path, experts="Q8_0")
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 4096])
    with pytest.raises(CheckpointError, match="truncated|not a readable GGUF"):
        moestream.load(str(path), device="cpu")
    _cli_refuses(path, capsys, "cut.gguf")
    path.write_bytes(data[:100])   # cut inside the header
    _cli_refuses(path, capsys, "cut.gguf")


def test_a_prepacked_bank_warm_starts_and_a_changed_file_rebuilds_it(hf_models, tmp_path):
    path, snap = tmp_path / "q4k.gguf", tmp_path / "bank"
    make_gguf(hf_models["qwen3_moe"], path, experts="Q4_K", dense="F32")
    cold = moestream.load(str(path), device="cpu", dtype="float32", capacity=3, prepack=snap, warmup_tokens=4)
    assert not cold.prepack.loaded and (snap / "bank.json").exists()
    warm = moestream.load(str(path), device="cpu", dtype="float32", capacity=3, prepack=snap)
    assert warm.prepack.loaded
    assert warm.generate(PROMPT, max_tokens=8, ignore_eos=True) == cold.generate(PROMPT, max_tokens=8, ignore_eos=True)
    make_gguf(hf_models["qwen3_moe"], path, experts="Q4_K", dense="F32", seed=1)   # other K-quant blocks
    again = moestream.load(str(path), device="cpu", dtype="float32", capacity=3, prepack=snap)
    assert not again.prepack.loaded and "checkpoint" in again.prepack.reason


@pytest.mark.parametrize("embeddings", ["Q8_0", "Q4_K"])
def test_quantized_embeddings_and_lm_head_stay_quantized(hf_models, tmp_path, embeddings):
    path = tmp_path / "emb.gguf"
    make_gguf(hf_models["qwen3_moe"], path, experts="Q4_0", dense="Q4_0", embeddings=embeddings)
    engine = moestream.load(str(path), device="cpu", dtype="float32")
    assert type(engine.model.model.embed_tokens).__name__ == "QuantEmbedding"
    assert type(engine.model.lm_head).__name__ == "QuantLinear"
    with torch.no_grad():
        ref = transformers_gguf(path)(IDS, attention_mask=MASK).logits
    assert relative(engine.logits(IDS, MASK), ref) <= 1e-4


def test_convert_refuses_a_gguf(hf_models, tmp_path):
    from moestream.engine.convert import convert
    from moestream.errors import InputError
    from moestream.quant.recipe import QuantRecipe

    path = tmp_path / "m.gguf"
    make_gguf(hf_models["qwen3_moe"], path, experts="Q8_0")
    with pytest.raises(InputError, match="is a GGUF checkpoint; run it as it is"):
        convert(path, tmp_path / "out", QuantRecipe(experts="int4"), progress=False)
    assert not (tmp_path / "out").exists()


def test_token_ids_are_the_prompt_of_a_gguf_without_a_tokenizer(hf_models, tmp_path, capsys):
    path = tmp_path / "ids.gguf"
    make_gguf(hf_models["qwen3_moe"], path, experts="Q4_0")
    engine = moestream.load(str(path), device="cpu", dtype="float32")
    assert engine.tokenizer is None
    want = engine.generate([3, 4, 5], max_tokens=3, ignore_eos=True)
    assert cli.main(["run", str(path), "-p", "3 4 5", "--max-tokens", "3", "--device", "cpu",
                     "--dtype", "float32"]) == 0
    assert capsys.readouterr().out.split()[:len(want)] == [str(t) for t in want]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("experts", ["Q8_0", "Q4_0", "Q4_K", "MXFP4"])
def test_gguf_on_the_gpu_agrees_with_the_cpu_and_a_bounded_bank_with_the_resident_one(hf_models, tmp_path, experts):
    path = tmp_path / "gpu.gguf"
    make_gguf(hf_models["qwen3_moe"], path, experts=experts, dense=experts)
    cpu = moestream.load(str(path), device="cpu", dtype="float32").logits(IDS, MASK)
    gpu = moestream.load(str(path), device="cuda", dtype="bfloat16")
    assert relative(gpu.logits(IDS, MASK).float().cpu(), cpu) <= 3e-2   # bf16 activations
    bounded = moestream.load(str(path), device="cuda", dtype="bfloat16", capacity=3, miss_policy="fetch")
    assert bounded.generate(PROMPT, max_tokens=12, ignore_eos=True) == gpu.generate(PROMPT, max_tokens=12,
                                                                                    ignore_eos=True)


def test_two_ranks_of_a_gguf_equal_one_process(hf_models, tmp_path):
    path = tmp_path / "ep.gguf"
    make_gguf(hf_models["qwen3_moe"], path, experts="Q4_K", dense="Q8_0")
    single = moestream.load(str(path), device="cpu", dtype="float32")
    want = single.generate(PROMPT, max_tokens=8, ignore_eos=True)
    with moestream.load(str(path), devices=["cpu", "cpu"], dtype="float32", rank_timeout_s=60) as engine:
        assert engine.bank.num_experts == single.config.num_experts // 2   # rank 0's share
        assert engine.generate(PROMPT, max_tokens=8, ignore_eos=True) == want
