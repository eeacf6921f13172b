"""GPTQ, AWQ and compressed-tensors pack-quantized: the unpacking follows each format's published
packing, transcribed here as the reference writers' loops (AutoGPTQ's `pack`, including its 3-bit
word straddling; AutoAWQ's GEMM `from_linear` with order [0, 2, 4, 6, 1, 3, 5, 7]; compressed-tensors'
dense `pack_to_int32` with the 2^(bits-1) offset), independently of moestream's own packers; and the
mapping onto moestream's affine format gives the same dequantized weights, bit for bit."""

import numpy as np
import pytest
import torch

from moestream.errors import CheckpointError
from moestream.quant import dequantize
from moestream.quant.gptq import (AWQ_ORDER, IntQuant, IntWeight, affine_spec, dequantize_int, int_quantization,
                                  pack_awq, pack_compressed, pack_gptq, quantize_int, to_affine, unpack_awq,
                                  unpack_compressed, unpack_gptq)

GEN = torch.Generator().manual_seed(0)


def random_int_weight(n, k, bits, group, sym, act_order=False, scale_dtype=torch.float16, low_zero=0):
    groups = k // group
    codes = torch.randint(0, 1 << bits, (n, k), generator=GEN).to(torch.uint8)
    zeros = (torch.full((n, groups), 1 << (bits - 1), dtype=torch.int32) if sym else
             torch.randint(low_zero, 1 << bits, (n, groups), generator=GEN).to(torch.int32))
    scales = (torch.rand(n, groups, generator=GEN) * 0.02 + 1e-3).to(scale_dtype)
    g_idx = None
    if act_order:   # GPTQ's: columns taken in a permuted order, group i = perm[i*g:(i+1)*g]
        perm = torch.randperm(k, generator=GEN)
        g_idx = torch.empty(k, dtype=torch.long)
        g_idx[perm] = torch.arange(k) // group
    return IntWeight(codes, zeros, scales, group, g_idx)


def loop_dequantize(w):
    n, k = w.codes.shape
    out = np.zeros((n, k), dtype=np.float64)
    for c in range(k):
        g = int(w.g_idx[c]) if w.g_idx is not None else c // w.group
        for r in range(n):
            out[r, c] = (int(w.codes[r, c]) - int(w.zeros[r, g])) * float(w.scales[r, g])
    return torch.tensor(out, dtype=torch.float32)


def autogptq_pack_rows(intweight, bits):
    """AutoGPTQ's packing of (K, N) values into (K·bits/32, N) uint32 words, as its loop writes it."""
    intweight = intweight.astype(np.uint32)
    q = np.zeros((intweight.shape[0] // 32 * bits, intweight.shape[1]), dtype=np.uint32)
    i = row = 0
    while row < q.shape[0]:
        if bits in (2, 4, 8):
            for j in range(i, i + 32 // bits):
                q[row] |= intweight[j] << (bits * (j - i))
            i += 32 // bits
            row += 1
        else:   # 3 bits: 10 values, then one straddling the word boundary
            for j in range(i, i + 10):
                q[row] |= intweight[j] << (3 * (j - i))
            i += 10
            q[row] |= intweight[i] << 30
            row += 1
            q[row] |= (intweight[i] >> 2) & 1
            i += 1
            for j in range(i, i + 10):
                q[row] |= intweight[j] << (3 * (j - i) + 1)
            i += 10
            q[row] |= intweight[i] << 31
            row += 1
            q[row] |= (intweight[i] >> 1) & 0x3
            i += 1
            for j in range(i, i + 10):
                q[row] |= intweight[j] << (3 * (j - i) + 2)
            i += 10
            row += 1
    return torch.from_numpy(q.view(np.int32))


def awq_pack(intweight):
    """AutoAWQ GEMM: (R, N) values → (R, N/8) int32, nibble i of word c = column 8c + order[i]."""
    intweight = intweight.astype(np.uint32)
    q = np.zeros((intweight.shape[0], intweight.shape[1] // 8), dtype=np.uint32)
    for col in range(q.shape[1]):
        for i in range(8):
            q[:, col] |= intweight[:, col * 8 + AWQ_ORDER[i]] << (i * 4)
    return torch.from_numpy(q.view(np.int32))


def ct_pack(values, bits):
    """compressed-tensors pack_to_int32: element i of a row at global bit i·bits, words little-endian."""
    rows, cols = values.shape
    words = -(-cols * bits // 32)
    out = np.zeros((rows, words), dtype=np.uint32)
    for r in range(rows):
        big = sum(int(v) << (i * bits) for i, v in enumerate(values[r]))
        for w in range(words):
            out[r, w] = (big >> (32 * w)) & 0xFFFFFFFF
    return torch.from_numpy(out.view(np.int32))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("v1", [True, False])
@pytest.mark.parametrize("sym", [True, False])
def test_gptq_unpacks_the_reference_packing(bits, v1, sym):
    n, k, group = 64, 128, 32
    w = random_int_weight(n, k, bits, group, sym, low_zero=1 if v1 else 0)
    stored_zeros = (w.zeros - (1 if v1 else 0)).t().numpy()
    qweight = autogptq_pack_rows(w.codes.t().numpy(), bits)
    qzeros = autogptq_pack_rows(stored_zeros.T, bits).t().contiguous()   # packed along N
    q = IntQuant("gptq", bits, group, sym, False, 1 if v1 else 0)
    got = unpack_gptq(q, n, k, qweight, qzeros, w.scales.t().contiguous(), None)
    assert torch.equal(dequantize_int(got), loop_dequantize(w))
    ours = pack_gptq(w, bits, v1)   # moestream's writer agrees with the reference loop
    assert torch.equal(ours["qweight"], qweight) and torch.equal(ours["qzeros"], qzeros)


def test_gptq_act_order_follows_g_idx():
    n, k, group, bits = 32, 128, 32, 4
    w = random_int_weight(n, k, bits, group, sym=False, act_order=True, low_zero=1)
    parts = pack_gptq(w, bits)
    got = unpack_gptq(IntQuant("gptq", bits, group, False, True, 1), n, k, parts["qweight"], parts["qzeros"],
                      parts["scales"], parts["g_idx"])
    assert not got.ordered
    assert torch.equal(dequantize_int(got), loop_dequantize(w))
    with pytest.raises(CheckpointError, match="does not map exactly"):
        to_affine(got, affine_spec(IntQuant("gptq", bits, group, False, False, 1), torch.float16), "x")


def test_awq_unpacks_the_reference_packing():
    n, k, group = 64, 128, 64
    w = random_int_weight(n, k, 4, group, sym=False)
    qweight, qzeros = awq_pack(w.codes.t().numpy()), awq_pack(w.zeros.t().numpy())
    got = unpack_awq(IntQuant("awq", 4, group, False, False), n, k, qweight, qzeros, w.scales.t().contiguous())
    assert torch.equal(dequantize_int(got), loop_dequantize(w))
    ours = pack_awq(w)
    assert torch.equal(ours["qweight"], qweight) and torch.equal(ours["qzeros"], qzeros)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("sym", [True, False])
def test_compressed_tensors_unpacks_the_reference_packing(bits, sym):
    n, k, group = 64, 128, 32
    w = random_int_weight(n, k, bits, group, sym, scale_dtype=torch.bfloat16)
    packed = ct_pack(w.codes.numpy(), bits)
    zp = None if sym else ct_pack(w.zeros.t().numpy(), bits).t().contiguous()   # packed along N
    q = IntQuant("compressed-tensors", bits, group, sym, False)
    got = unpack_compressed(q, n, k, packed, w.scales, zp, torch.tensor([n, k]), None)
    assert torch.equal(dequantize_int(got), loop_dequantize(w))
    ours = pack_compressed(w, bits, sym)
    assert torch.equal(ours["weight_packed"], packed)
    assert sym or torch.equal(ours["weight_zero_point"], zp)


@pytest.mark.parametrize("bits,group,sym,scale_dtype,want", [
    (4, 128, True, torch.float16, "int4-g128"), (4, 32, False, torch.float16, "int4-g32"),
    (8, 64, True, torch.bfloat16, "int8-g64"), (2, 32, False, torch.bfloat16, "int2-g32"),
    (3, 64, True, torch.float16, "int3-g64"), (4, 256, False, torch.float16, "int4-g128"),
    (4, -1, True, torch.bfloat16, "int4-g128")])
def test_mapping_onto_the_affine_format_is_exact(bits, group, sym, scale_dtype, want):
    n, k = 48, 512
    w = random_int_weight(n, k, bits, k if group == -1 else group, sym, scale_dtype=scale_dtype)
    q = IntQuant("gptq", bits, group, sym, False)
    spec = affine_spec(q, scale_dtype)
    assert spec.name == want
    # symmetric bf16 or fp16 scales stay as stored (the bias -2^(b-1)·s is exact there), anything else takes fp32
    assert spec.scale_dtype == (scale_dtype if sym else torch.float32)
    qt = to_affine(w, spec)
    assert torch.equal(dequantize(qt.qweight, qt.scales, qt.biases, spec), dequantize_int(w))


def test_no_exact_mapping_for_fine_groups_or_act_order():
    assert affine_spec(IntQuant("gptq", 4, 16, True, False), torch.float16) is None
    assert affine_spec(IntQuant("gptq", 4, 48, True, False), torch.float16) is None
    assert affine_spec(IntQuant("gptq", 4, 128, True, True), torch.float16) is None


def test_round_to_nearest_writer_round_trips():
    w = torch.randn(16, 256, generator=GEN)
    for sym in (True, False):
        iw = quantize_int(w, 4, 64, sym)
        err = (dequantize_int(iw) - w).abs().max() / w.abs().max()
        assert err < 0.1


@pytest.mark.parametrize("config,match", [
    ({"quant_method": "gptq", "bits": 5, "group_size": 128}, "5-bit"),
    ({"quant_method": "gptq", "bits": 6, "group_size": 128}, "6-bit"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "marlin"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": {"-:.*": {}}}, "dynamic"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "gemv"),
    ({"quant_method": "awq", "bits": 3, "group_size": 128}, "3-bit"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {}}, "int-quantized"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128},
        "input_activations": {"num_bits": 8}}}}, "activations"),
])
def test_unreadable_configs_are_refused_by_name(config, match):
    with pytest.raises(CheckpointError, match=match):
        int_quantization({"quantization_config": config})


def test_configs_parse():
    assert int_quantization({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128,
                                                     "desc_act": True, "sym": False}}) == \
        IntQuant("gptq", 4, 128, False, True, 1)
    assert int_quantization({"quantization_config": {"quant_method": "gptq", "bits": 8, "group_size": -1,
                                                     "checkpoint_format": "gptq_v2"}}).zero_offset == 0
    ct = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                           "group_size": 128, "actorder": None}}}}
    assert int_quantization({"quantization_config": ct}) == IntQuant("compressed-tensors", 4, 128, True, False)
    per_group = {**ct, "format": "mixed-precision",
                 "config_groups": {"group_0": {**ct["config_groups"]["group_0"], "format": "pack-quantized"}}}
    assert int_quantization({"quantization_config": per_group, "torch_dtype": "bfloat16"}) == \
        IntQuant("compressed-tensors", 4, 128, True, False, scale_dtype=torch.bfloat16)
    assert int_quantization({"quantization_config": {"quant_method": "fp8"}}) is None
    float_ct = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {}}
    assert int_quantization({"quantization_config": float_ct}) is None   # another reader's
    assert int_quantization({}) is None


def test_modules_left_unquantized_are_read_from_the_config():
    ct = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head", "re:.*mlp.gate$"],
          "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}}}}
    q = int_quantization({"quantization_config": ct})
    assert q.skips("lm_head") and q.skips("model.layers.3.mlp.gate") and not q.skips("model.layers.3.mlp.gate_proj")
    awq = int_quantization({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128,
                                                    "modules_to_not_convert": ["shared_expert"]}})
    assert awq.skips("model.layers.0.mlp.shared_expert.up_proj") and not awq.skips("model.layers.0.self_attn.q_proj")


def test_wrong_shapes_are_named():
    q = IntQuant("gptq", 4, 32, True, False, 1)
    w = random_int_weight(16, 64, 4, 32, True)
    parts = pack_gptq(w, 4)
    with pytest.raises(CheckpointError, match=r"'m.qzeros' is int32 \[2, 2\].*\[2, 4\]"):
        unpack_gptq(q, 32, 64, torch.zeros(8, 32, dtype=torch.int32), parts["qzeros"], parts["scales"], None, "m")


def test_scales_the_planned_dtype_cannot_hold_are_refused():
    """A compressed-tensors config saying bf16 over fp16 scales: the repacking checks, it does not round."""
    w = random_int_weight(16, 64, 4, 32, sym=True, scale_dtype=torch.float16)
    spec = affine_spec(IntQuant("compressed-tensors", 4, 32, True, False), torch.bfloat16)
    assert spec.scale_dtype == torch.bfloat16
    with pytest.raises(CheckpointError, match="not exact in bfloat16"):
        to_affine(w, spec, "m")
    w.scales[0, 0] = float("nan")
    with pytest.raises(CheckpointError, match="inf or NaN"):
        to_affine(w, affine_spec(IntQuant("gptq", 4, 32, True, False)), "m")
