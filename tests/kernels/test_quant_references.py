"""The quantized references (CPU, in CI): MoE over quantized slots and the quantized linear layer."""

import pytest
import torch

from moestream.kernels import moe_reference, quant_linear_reference, quant_moe_reference
from moestream.quant import dequantize, parse_quant, quantize


def quantized_slots(spec, slots=5, hidden=64, inter=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(slots, 2 * inter, hidden, generator=g) * 0.05
    down = torch.randn(slots, hidden, inter, generator=g) * 0.05
    out, deq = {}, {}
    for proj, w in (("gate_up", gate_up), ("down", down)):
        parts = [quantize(w[s], spec) for s in range(slots)]
        for name in parts[0].parts():
            out[f"{proj}.{name}"] = torch.stack([getattr(p, name) for p in parts])
        deq[proj] = torch.stack([dequantize(p.qweight, p.scales, p.biases, spec) for p in parts])
    return out, deq


@pytest.mark.parametrize("name", ["int8-g32", "int4-g32", "int3-g32", "int2", "nf4-g32", "nf3-g32"])
def test_quant_moe_reference_is_moe_reference_on_dequantized_weights(name):
    spec = parse_quant(name)
    slots, deq = quantized_slots(spec)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(6, 64, generator=g)
    ids = torch.randint(0, 5, (6, 2), generator=g)
    ids[0, 1], ids[3, 0] = -1, 9            # not resident / out of range: contribute nothing
    weights = torch.rand(6, 2, generator=g)
    got = quant_moe_reference(hidden, slots, ids, weights, spec)
    want = moe_reference(hidden, deq["gate_up"], deq["down"], ids, weights)
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.equal(quant_moe_reference(hidden, slots, torch.full((6, 2), -1), weights, spec), torch.zeros_like(hidden))


def test_quant_linear_reference():
    spec = parse_quant("int4-g32")
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(2))
    qt = quantize(w, spec)
    x = torch.randn(3, 64)
    bias = torch.randn(48)
    want = x @ dequantize(qt.qweight, qt.scales, qt.biases, spec).T + bias
    assert torch.allclose(quant_linear_reference(x, qt.qweight, qt.scales, qt.biases, spec, bias), want, atol=1e-5)
