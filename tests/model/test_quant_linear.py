"""Mixed precision of dense tensors: quantized attention, shared/dense FFNs and embeddings (CPU)."""

import torch

import moestream
from moestream.model.quant_linear import QuantEmbedding, QuantLinear
from moestream.quant import dequantize

IDS = torch.randint(2, 160, (2, 24), generator=torch.Generator().manual_seed(3))


def _load(folder, **kw):
    return moestream.load(folder, device="cpu", dtype="float32", **kw)


def test_classes_are_quantized_where_the_recipe_says(tiny_quant):
    engine = _load(tiny_quant, attention="int8", shared="int4-g32", embeddings="int8")
    layers = engine.model.model.layers
    assert isinstance(layers[0].self_attn.q_proj, QuantLinear) and layers[0].self_attn.q_proj.spec.name == "int8-g64"
    assert isinstance(layers[1].mlp.gate_proj, QuantLinear)          # the dense layer's FFN is "shared"
    assert isinstance(engine.model.model.embed_tokens, QuantEmbedding) and isinstance(engine.model.lm_head, QuantLinear)
    router = layers[0].mlp.gate
    assert router.weight.dtype == torch.float32                      # routers stay at full precision
    assert engine.plan.memory.dense_bytes < _load(tiny_quant).plan.memory.dense_bytes / 2


def test_quantized_modules_compute_with_the_dequantized_weight(tiny_quant, tmp_path):
    engine = _load(tiny_quant, attention="int8")
    q = engine.model.model.layers[2].self_attn.o_proj
    x = torch.randn(3, q.in_features)
    w = dequantize(q.qweight, q.scales, q.biases, q.spec)
    assert torch.allclose(q(x), x @ w.T, atol=1e-5)


def test_int8_everywhere_stays_close_and_layer_overrides_apply(tiny_quant):
    ref = _load(tiny_quant).logits(IDS)
    out = _load(tiny_quant, experts="int8", shared="int8", attention="int8", embeddings="int8").logits(IDS)
    assert (out - ref).norm() / ref.norm() < 0.03
    engine = _load(tiny_quant, attention="int4", layer_formats={0: "int8"})
    layers = engine.model.model.layers
    assert layers[0].self_attn.q_proj.spec.bits == 8 and layers[2].self_attn.q_proj.spec.bits == 4


def test_quantized_qkv_fuse_into_one_packed_projection(tiny_quant, monkeypatch):
    """fuse_qkv concatenates quantized q, k and v (bytes, scales, biases): each projection a view into
    them, the logits unchanged, and the one-call path gives the three projections' q, k and v."""
    from moestream import kernels

    engine = _load(tiny_quant, attention="int4-g32")
    ids = IDS[:, :9]
    before = engine.logits(ids)
    mixer = engine.model.model.layers[1].self_attn
    x = torch.randn(2, 3, engine.config.hidden_size)
    three = (mixer.q_proj(x), mixer.k_proj(x), mixer.v_proj(x))
    engine.model.fuse_projections()
    qweight, _, biases = mixer.qkv_packed
    assert mixer.qkv_spec == mixer.q_proj.spec and mixer.qkv_weight is None
    assert qweight.shape[0] == sum(p.out_features for p in (mixer.q_proj, mixer.k_proj, mixer.v_proj))
    assert mixer.k_proj.qweight.data_ptr() == qweight[mixer.q_proj.out_features:].data_ptr()   # views, no copy
    assert mixer.v_proj.biases.data_ptr() == biases[-mixer.v_proj.out_features:].data_ptr()
    assert torch.equal(engine.logits(ids), before)
    monkeypatch.setattr(kernels, "fused_ops_enabled", lambda t: True)
    for got, want in zip(mixer.project_qkv(x), three):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
