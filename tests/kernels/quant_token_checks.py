"""Checks of one token's quantized experts (fused_moe_token_quant.py) against the reference, the decode
path and themselves; one body for the GPU test (compiled) and the CPU test (Triton's interpreter)."""

from __future__ import annotations

import torch
from quant_host_checks import _placed

from moestream.kernels.fused_moe_quant_triton import fused_moe_quant
from moestream.kernels.fused_moe_token_quant import token_path_supported
from moestream.kernels.quant_moe_reference import QuantHostReads, quant_moe_reference
from moestream.quant import parse_quant

# (format, H, I): the common 4-bit case with whole K steps, and widths whose last K step is partial
# ":fp32": fp32 scales and biases (asymmetric GPTQ/AWQ repacked); ":fp16": fp16 ones (GGUF's Q4_0 and Q8_0)
CASES = (("int4-g64", 128, 64), ("int4-g32", 192, 96), ("int8-g32", 192, 96), ("int2-g32", 128, 96),
         ("nf4-g32", 192, 64), ("int4-g64:fp32", 128, 64), ("int4-g32:fp16", 192, 96), ("int8-g32:fp16", 128, 64))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def check_quant_token(device: str, dtype: torch.dtype, fmt: str, H: int, I: int) -> None:
    from moestream.kernels.fused_moe_triton import sum_pairs

    base, _, scales = fmt.partition(":")
    spec = parse_quant(base, {"": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[scales])
    assert token_path_supported(spec, H, I)
    S, E, k = 4, 10, 6
    g = torch.Generator().manual_seed(H + I)
    resident = [3, 7, 1, 8]                                     # slot s holds expert resident[s]
    host_stacks, slots, full = _placed(spec, E, H, I, g, device, resident)
    hidden = torch.randn(1, H, generator=g).to(device, dtype)
    weights = torch.rand(1, k, generator=g).softmax(dim=1).to(device)
    tol = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}[dtype]

    # in slots: pairs on slots 2, 0, 3 and 1; one -1 and one out of range (unrouted, weight NaN)
    ids = torch.tensor([[2, 0, -1, 3, S, 1]], dtype=torch.int32, device=device)
    poisoned = weights.clone()
    poisoned[0, 2] = poisoned[0, 4] = float("nan")
    ref = quant_moe_reference(hidden, slots, ids, weights, spec)
    out = fused_moe_quant(hidden, slots, ids, poisoned, spec, path="token")
    assert out.shape == (1, H) and out.dtype == dtype and not out.isnan().any(), fmt
    assert _rel(out, ref) < tol, (fmt, _rel(out, ref))
    assert _rel(out, fused_moe_quant(hidden, slots, ids, weights, spec, path="decode")) < tol, fmt
    assert torch.equal(fused_moe_quant(hidden, slots, ids, poisoned, spec), out), "auto takes the token path at T = 1"
    rows = fused_moe_quant(hidden, slots, ids, poisoned, spec, path="token", reduce=False)
    assert rows.shape == (1, k, H) and rows.dtype == torch.float32
    assert torch.equal(rows[0, 2], torch.zeros_like(rows[0, 2])), "an unrouted pair's row is zero"
    assert torch.equal(sum_pairs(rows, dtype), out), "pair rows summed as a dispatch ends give its bits"
    none = fused_moe_quant(hidden, slots, torch.full_like(ids, -1), poisoned, spec, path="token")
    assert torch.equal(none, torch.zeros_like(none)), fmt

    # the slot map read in the kernels: expert ids, 9 held nowhere
    slot_map = torch.full((E + 1,), -1, dtype=torch.int32)
    slot_map[resident] = torch.arange(S, dtype=torch.int32)
    slot_map = slot_map.to(device)
    experts = torch.tensor([[1, 9, 7, 3, -1, 8]], dtype=torch.int32, device=device)
    mapped = fused_moe_quant(hidden, slots, experts, weights, spec, path="token", slot_map=slot_map)
    assert torch.equal(mapped, fused_moe_quant(hidden, slots, slot_map[experts.long()], weights, spec, path="token"))

    # host stacks read in place (source S + e): the bits of the same experts in slots
    source = slot_map.clone()
    source[2], source[5], source[6] = S + 2, S + 5, S + 6
    experts = torch.tensor([[7, 2, 8, 5, 9, 6]], dtype=torch.int32, device=device)
    in_slots = torch.where(source[experts.long()] >= 0, experts, -1)   # the same experts, all in slots (identity)
    want = fused_moe_quant(hidden, full, in_slots, weights, spec, path="token")
    got = fused_moe_quant(hidden, slots, experts, weights, spec, path="token", slot_map=source,
                          host=QuantHostReads(host_stacks))
    assert torch.equal(got, want), (fmt, "a host expert gives the bits of one in a slot")
    # the CPU's split: of the three host pairs (positions 1, 3, 5) the first take[3] are left out
    for take3, skipped in ((1, [1]), (2, [1, 3]), (3, [1, 3, 5]), (0, [])):
        take = torch.tensor([0, 1, 1, take3, 3, 3, 3], dtype=torch.int32, device=device)
        kept = in_slots.clone()
        kept[0, skipped] = -1
        split = fused_moe_quant(hidden, slots, experts, weights, spec, path="token", slot_map=source,
                                host=QuantHostReads(host_stacks, take))
        assert torch.equal(split, fused_moe_quant(hidden, full, kept, weights, spec, path="token")), (fmt, take3)


def check_all(device: str, dtypes: tuple[torch.dtype, ...]) -> None:
    for dtype in dtypes:
        for fmt, H, I in CASES:
            check_quant_token(device, dtype, fmt, H, I)
