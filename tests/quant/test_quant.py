"""Group quantization (moestream.quant): layouts, round-trip error per format, codebooks, names."""

import pytest
import torch

from moestream.errors import InputError
from moestream.quant import dequantize, parse_quant, quantize
from moestream.quant.normal import codebook
from moestream.quant.packing import pack, unpack
from moestream.quant.recipe import QuantRecipe, parse_layer_formats

# Relative error bound ‖w − deq(q(w))‖ / ‖w‖ on Gaussian weights, per format: the levels of b bits
# over a group's range give roughly 2^-b; looser for small groups at few bits.
BOUNDS = {"int8": 0.01, "int4-g32": 0.085, "int4": 0.095, "int4-g128": 0.105, "int3": 0.19, "int2": 0.34,
          "nf4": 0.095, "nf3": 0.2}


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_packing_round_trips_and_is_a_little_endian_bit_stream(bits):
    q = torch.randint(0, 1 << bits, (3, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(bits))
    packed = pack(q, bits)
    assert packed.shape == (3, 64 * bits // 8) and torch.equal(unpack(packed, bits), q)
    stream = int.from_bytes(bytes(packed[1].tolist()), "little")   # value j at bits [j*b, (j+1)*b)
    assert [(stream >> (j * bits)) & ((1 << bits) - 1) for j in range(64)] == q[1].tolist()


@pytest.mark.parametrize("name,bound", BOUNDS.items())
def test_round_trip_error_within_the_formats_bound(name, bound):
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(1)) * 0.02
    spec = parse_quant(name)
    qt = quantize(w, spec)
    assert qt.qweight.dtype == torch.uint8 and qt.qweight.shape == (96, 256 * spec.bits // 8)
    assert qt.scales.shape == (96, 256 // spec.group) and qt.scales.dtype == torch.bfloat16
    assert (qt.biases is not None) == (spec.kind == "int")
    back = dequantize(qt.qweight, qt.scales, qt.biases, spec)
    rel = ((back - w).norm() / w.norm()).item()
    assert rel < bound, rel
    assert spec.nbytes(96, 256) == sum(t.nbytes for t in qt.parts().values())


def test_representable_weights_come_back_exactly():
    """Weights already on a group's grid (scale and bias exact in bf16) lose nothing."""
    g = torch.Generator().manual_seed(2)
    q = torch.randint(0, 16, (8, 4, 64), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15                        # every group spans the full range
    scale = torch.tensor(2.0 ** -7)
    bias = -torch.randint(1, 9, (8, 4, 1), generator=g).float() * 2.0 ** -4
    w = (q * scale + bias).reshape(8, 256)
    spec = parse_quant("int4")
    qt = quantize(w, spec)
    assert torch.equal(dequantize(qt.qweight, qt.scales, qt.biases, spec), w)


def test_clip_search_beats_plain_min_max_on_outliers():
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(3)) * 0.02
    w[:, ::64] *= 12                                     # one outlier per group
    spec = parse_quant("int3")
    qt = quantize(w, spec)
    err = (dequantize(qt.qweight, qt.scales, qt.biases, spec) - w).square().sum()
    wg = w.view(64, 2, 64)
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    scale = (hi - lo) / 7
    plain = ((((wg - lo) / scale).round().clamp(0, 7) * scale + lo) - wg).square().sum()
    assert err < plain


def test_nf4_codebook_is_qloras():
    table = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
             -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
             0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
             0.7229568362236023, 1.0]
    assert torch.allclose(codebook(4), torch.tensor(table), atol=1e-6)
    nf3 = codebook(3)
    assert len(nf3) == 8 and nf3[0] == -1 and nf3[-1] == 1 and 0.0 in nf3.tolist()


@pytest.mark.parametrize("name,match", [("int5", "unknown"), ("q4_0", "unknown"), ("nf2", "unknown"),
                                        ("int4-g48", "group size 48"), ("", "unknown")])
def test_unknown_formats_and_groups_list_the_valid_ones(name, match):
    with pytest.raises(InputError, match=match):
        parse_quant(name)


def test_a_group_that_does_not_divide_the_width_ends_in_a_shorter_group():
    w = torch.randn(4, 96, generator=torch.Generator().manual_seed(5)) * 0.02
    for name in ("int4-g64", "nf4-g64", "int3-g128"):
        spec = parse_quant(name)
        qt = quantize(w, spec)
        assert qt.scales.shape == (4, spec.groups(96)) and spec.nbytes(4, 96) == sum(t.nbytes for t in qt.parts().values())
        whole = quantize(w[:, :64], spec) if spec.group == 64 else None
        back = dequantize(qt.qweight, qt.scales, qt.biases, spec)
        assert ((back - w).norm() / w.norm()) < BOUNDS[name.split("-")[0]]
        if whole is not None:   # the first group is quantized exactly as on its own
            assert torch.equal(back[:, :64], dequantize(whole.qweight, whole.scales, whole.biases, spec))
    with pytest.raises(InputError, match="multiple of 8"):
        quantize(torch.randn(4, 36), parse_quant("int4"))


def test_recipe_classes_and_layer_overrides():
    recipe = QuantRecipe(experts="int4", attention="int8", layer_formats=parse_layer_formats(["0=int8", "-1=nf4"]))
    assert recipe.validate(num_layers=4).spec("experts", 1, 4).name == "int4-g64"
    assert recipe.spec("experts", 0, 4).name == "int8-g64"
    assert recipe.spec("attention", 3, 4).name == "nf4-g64"
    assert recipe.spec("shared", 0, 4) is None            # a full-precision class stays full
    assert recipe.spec("embeddings") is None and recipe.quantized
    with pytest.raises(InputError, match="outside"):
        QuantRecipe(experts="int4", layer_formats={9: "int8"}).validate(num_layers=4)
    with pytest.raises(InputError, match="LAYER=FORMAT"):
        parse_layer_formats(["first=int8"])


def test_perplexity_reports_kl_to_full_precision(tmp_path, capsys):
    import json

    from moestream.cli import DEMO_MODEL, main as cli_main

    sample = tmp_path / "sample.py"
    sample.write_text((DEMO_MODEL / "heldout_sample.txt").read_text()[:1500])
    base = ["perplexity", "--device", "cpu", "--file", str(sample), "--window", "128", "--json", "--kl-reference"]
    assert cli_main(base) == 0
    same = json.loads(capsys.readouterr().out)
    assert cli_main(base + ["--experts", "int3"]) == 0
    int3 = json.loads(capsys.readouterr().out)
    assert same["kl_to_reference"] == pytest.approx(0.0, abs=1e-6) and int3["kl_to_reference"] > 1e-3
    assert int3["tokens"] == same["tokens"] and int3["perplexity"] != same["perplexity"]
    assert int3["experts"] == "int3-g64"
