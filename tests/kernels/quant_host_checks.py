"""Checks of quantized experts read in place from host stacks (slot S + e) by the dequantizing
decode launches, shared by the GPU test (compiled) and the CPU test (Triton's interpreter)."""

from __future__ import annotations

import torch

from moestream.kernels.fused_moe_quant_triton import fused_moe_quant
from moestream.kernels.quant_moe_reference import QuantHostReads, quant_moe_reference
from moestream.quant import parse_quant, quantize
from moestream.quant.fp8 import Fp8Spec, parse_fp8

FORMATS = ("int4-g32", "int8-g32", "nf4-g32", "fp8-b12x12")   # FP8: ragged blocks (64 rows, 96 columns of 12)


def _stacks(spec, E: int, H: int, I: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    if isinstance(spec, Fp8Spec):   # e4m3 bytes and block grids as `Fp8Format` holds them
        from moestream.experts.format import ExpertShape, Fp8Format

        fmt, shape = Fp8Format(spec, torch.float32), ExpertShape(H, I)
        stacks = fmt.empty(shape, E)
        for e in range(E):
            gate, up = (torch.randn(I, H, generator=g) / H ** 0.5 for _ in range(2))
            fmt.encode(gate, up, torch.randn(H, I, generator=g) / I ** 0.5, {n: t[e] for n, t in stacks.items()})
        return stacks
    out: dict[str, list[torch.Tensor]] = {}
    for _ in range(E):
        for proj, (n, k) in (("gate_up", (2 * I, H)), ("down", (H, I))):
            for name, t in quantize(torch.randn(n, k, generator=g) / k ** 0.5, spec).parts().items():
                out.setdefault(f"{proj}.{name}", []).append(t)
    return {name: torch.stack(ts).contiguous() for name, ts in out.items()}


def _placed(spec, E: int, H: int, I: int, g: torch.Generator, device: str, resident: list[int]):
    """E random experts of `spec` as host stacks (pinned on CUDA), slot s holding expert resident[s],
    and every expert on the device: (host stacks, slots, full)."""
    host_stacks = _stacks(spec, E, H, I, g)
    if device == "cuda":
        host_stacks = {name: t.pin_memory() for name, t in host_stacks.items()}
    slots = {name: t[resident].to(device) for name, t in host_stacks.items()}
    full = {name: t.to(device) for name, t in host_stacks.items()}
    return host_stacks, slots, full


def check_quant_host_reads(device: str, dtype: torch.dtype, fmt: str) -> None:
    """A host expert gives the bits of the same expert held in a slot; the split leaves the CPU's
    pairs out; the reference's host form agrees."""
    spec = parse_fp8(fmt) or parse_quant(fmt)
    H, I, S, E, k = 96, 64, 4, 12, 6
    g = torch.Generator().manual_seed(11)
    resident = [3, 7, 1, 10]                                    # slot s holds expert resident[s]
    host_stacks, slots, full = _placed(spec, E, H, I, g, device, resident)
    source = torch.full((E + 1,), -1, dtype=torch.int32)
    source[resident] = torch.arange(S, dtype=torch.int32)
    source[2], source[5], source[6] = S + 2, S + 5, S + 6      # read from the host stacks; 11: no source
    source = source.to(device)
    for ids in ([[7, 2, 10, 5, 11, -1]], [[7, 2, 10, 5, 11, -1], [5, 6, 3, 2, -1, 1]]):
        ids = torch.tensor(ids, dtype=torch.int32, device=device)
        T = ids.shape[0]
        hidden = torch.randn(T, H, generator=g).to(device, dtype)
        weights = torch.rand(T, k, generator=g).softmax(dim=1).to(device)
        slot_ids = source[ids.long()]
        full_ids = torch.where(slot_ids >= 0, ids, -1)          # the same experts, all in slots (identity)
        out = fused_moe_quant(hidden, slots, slot_ids, weights, spec, path="decode", host=QuantHostReads(host_stacks))
        want = fused_moe_quant(hidden, full, full_ids, weights, spec, path="decode")
        assert torch.equal(out, want), (fmt, T, "a host expert gives the bits of one in a slot")
        ref = quant_moe_reference(hidden, slots, slot_ids, weights, spec, host=QuantHostReads(host_stacks))
        assert torch.equal(ref, quant_moe_reference(hidden, full, full_ids, weights, spec)), (fmt, T)
        tol = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}[dtype]
        assert float((out.float() - ref.float()).norm() / ref.float().norm()) < tol, (fmt, T)
    # One token: pairs 1 and 3 (experts 2 and 5) are outside the slots; take[2] = 1 leaves pair 1
    # to the CPU, take[2] = 2 both, take[2] = 0 neither.
    ids = torch.tensor([[7, 2, 10, 5, 11, -1]], dtype=torch.int32, device=device)
    hidden = torch.randn(1, H, generator=g).to(device, dtype)
    weights = torch.rand(1, k, generator=g).softmax(dim=1).to(device)
    slot_ids = source[ids.long()]
    for take2, skipped in ((1, [1]), (2, [1, 3]), (0, [])):
        take = torch.tensor([0, 1, take2, 2, 2, 2, 2], dtype=torch.int32, device=device)
        host = QuantHostReads(host_stacks, take)
        kept = torch.where(slot_ids >= 0, ids, -1)
        kept[0, skipped] = -1
        split = fused_moe_quant(hidden, slots, slot_ids, weights, spec, path="decode", host=host)
        assert torch.equal(split, fused_moe_quant(hidden, full, kept, weights, spec, path="decode")), (fmt, take2)
        assert torch.equal(quant_moe_reference(hidden, slots, slot_ids, weights, spec, host=host),
                           quant_moe_reference(hidden, full, kept, weights, spec)), (fmt, take2)


def check_split_slots(device: str) -> None:
    """The one-launch split gives `split_outside`'s slots, row by row."""
    from moestream.kernels.fused_moe_quant_triton import split_slots
    from moestream.kernels.moe_reference import split_outside

    g = torch.Generator().manual_seed(5)
    S, k = 4, 6
    for T in (1, 3, 8):
        slot_ids = torch.randint(-1, 3 * S, (T, k), generator=g, dtype=torch.int32).to(device)
        for take in ([0, 1, 1, 2, 2, 3, 4], [0, 0, 0, 0, 0, 0, 0], list(range(7))):
            take = torch.tensor(take, dtype=torch.int32, device=device)
            assert torch.equal(split_slots(slot_ids, S, take), split_outside(slot_ids, S, take).to(torch.int32))


def check_all(device: str, dtypes: tuple[torch.dtype, ...]) -> None:
    check_split_slots(device)
    for dtype in dtypes:
        for fmt in FORMATS:
            check_quant_host_reads(device, dtype, fmt)
