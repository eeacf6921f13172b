"""Fused MoE dispatch over quantized bank slots in Triton: the CUDA path of `quant_moe_reference`.

The same two paths, launches and epilogues as the plain kernel (fused_moe_triton.py): the kernels are
shared, and every B tile is dequantized in registers as it is loaded (`moe_tiles.load_b_tile`:
packed bytes → values → q·scale + bias or codebook[q]·scale, in fp32, rounded once to the hidden
dtype, exactly what the reference's dequantize-then-cast produces). Below the long calls' threshold no
dequantized expert is written to memory, so a miss copies and a hit reads only the packed bytes,
scales and biases.
One token takes its own launches instead (fused_moe_token_quant.py: the packed words unpacked by
value planes, the slot map and the CPU's split read in the kernels) where its format has them.
FP8 e4m3 slots (`moestream.quant.fp8`, the FP8 checkpoints' bytes and block scales) take the same
decode and grouped kernels, each byte turned into fp32 and multiplied by its block's scale as the
tile is loaded (`moe_tiles._fp8_tile`); one token takes the decode path (its GEMV, no padded dot).
Long calls (`long_prompts.py`'s thresholds) dequantize every slot once instead (dequant_slots_triton.py),
a group of slots at a time into one scratch, each group's grouped GEMMs running its slots' blocks. No host sync: safe inside CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import torch
import triton
import triton.language as tl
from torch import Tensor

from moestream.quant import QuantSpec
from moestream.quant.fp8 import Fp8Spec
from moestream.quant.normal import codebook

from .fused_moe_triton import DecodeConfig, MoeConfig, grouped_by_slot_groups, host_path, resolve_path, run_paths
from .dequant_slots_triton import dequantize_operand
from .fused_moe_decode import HostOperand, QuantOperand
from .fused_moe_token import TokenConfig, host_offset
from .fused_moe_token_quant import takes_token_path, token_moe_quant
from .long_prompts import dequant_group_slots, dequant_min_tokens
from .quant_moe_reference import QuantHostReads

__all__ = ["fused_moe_quant", "quant_operand"]


@functools.lru_cache(maxsize=None)
def nf_codebook(bits: int, device: str) -> Tensor:
    return codebook(bits).to(device)


def quant_operand(slots: Mapping[str, Tensor], proj: str, spec: QuantSpec | Fp8Spec) -> QuantOperand:
    """The kernels' view of one projection of a quantized bank (or of a single weight, unsqueezed).
    FP8: the block of a projection's grid (gate_up's halves each on their own: `gated_dot`)."""
    qweight, scales = slots[f"{proj}.qweight"], slots[f"{proj}.scales"]
    if isinstance(spec, Fp8Spec):
        n, k = qweight.shape[-2:]
        rows, cols = spec.block(n // 2 if proj == "gate_up" else n, k)
        return QuantOperand(qweight, scales, scales, scales, 8, cols, False, fp8=True, scale_rows=rows)
    biases = slots.get(f"{proj}.biases", scales)   # NF: never read
    code = nf_codebook(spec.bits, str(qweight.device)) if spec.kind == "nf" else scales
    return QuantOperand(qweight, scales, biases, code, spec.bits, spec.group, spec.kind == "nf")


def _slot_range(operand: QuantOperand, start: int, count: int) -> QuantOperand:
    """Slots [start, start + count) of a quantized projection (the codebook is shared, not per slot)."""
    S = operand.qweight.shape[0]

    def rows(t: Tensor) -> Tensor:
        return t[start:start + count] if t.dim() and t.shape[0] == S else t

    return dataclasses.replace(operand, qweight=rows(operand.qweight), scales=rows(operand.scales),
                               biases=rows(operand.biases), code=operand.code if operand.nf else rows(operand.code))


def _dequantized_call(hidden: Tensor, gate_up: QuantOperand, down: QuantOperand, slot_ids: Tensor, weights: Tensor,
                      config, S: int, I: int, reduce: bool, layer_experts: int | None) -> Tensor:
    """The long calls' path: slots dequantized into the hidden dtype, then the plain grouped GEMMs,
    `dequant_group_slots(S)` slots at a time into one scratch (a bank of many slots would otherwise
    hold a dequantized copy of all of them): the routing aligned once, each group's launches running
    its slots' blocks (`grouped_by_slot_groups`), so the result has the bits of one group."""
    H = hidden.shape[1]
    group = dequant_group_slots(S)
    up_scratch = torch.empty((group, 2 * I, H), dtype=hidden.dtype, device=hidden.device)
    down_scratch = torch.empty((group, H, I), dtype=hidden.dtype, device=hidden.device)

    def load_group(start: int, count: int) -> tuple[Tensor, Tensor]:
        whole = count == S   # a bank of at most one group: no views needed
        up = gate_up if whole else _slot_range(gate_up, start, count)
        dn = down if whole else _slot_range(down, start, count)
        return (dequantize_operand(up, H, hidden.dtype, gated=True, out=up_scratch[:count]),
                dequantize_operand(dn, I, hidden.dtype, gated=False, out=down_scratch[:count]))

    return grouped_by_slot_groups(hidden, slot_ids, weights, S, I, group, load_group, config=config,
                                  layer_experts=layer_experts, reduce=reduce)


@triton.jit(do_not_specialize=["n"])
def _split_slots_kernel(slot_ptr, take_ptr, out_ptr, n, top_k, num_slots, PAIRS: tl.constexpr):
    """`split_outside` in one launch: per row of top_k pairs, of its m slots at or past num_slots
    (experts read from host stacks) the first take[m] become -1 (the CPU computes them)."""
    p = tl.arange(0, PAIRS)
    live = p < n
    slot = tl.load(slot_ptr + p, mask=live, other=-1).to(tl.int32)
    outside = live & (slot >= num_slots)
    same_row = (p[None, :] // top_k) == (p[:, None] // top_k)
    count = tl.sum((outside[None, :] & same_row).to(tl.int32), axis=1)          # m of each pair's row
    rank = tl.sum((outside[None, :] & same_row & (p[None, :] < p[:, None])).to(tl.int32), axis=1)
    take = tl.load(take_ptr + count, mask=live, other=0)
    tl.store(out_ptr + p, tl.where(outside & (rank < take), -1, slot), mask=live)


def split_slots(slot_ids: Tensor, num_slots: int, cpu_take: Tensor | None) -> Tensor:
    """`moe_reference.split_outside` for the decode path's few pairs: one launch instead of a chain
    of small torch ops per layer."""
    if cpu_take is None:
        return slot_ids
    T, k = slot_ids.shape
    out = torch.empty((T, k), dtype=torch.int32, device=slot_ids.device)
    _split_slots_kernel[(1,)](slot_ids.contiguous(), cpu_take, out, T * k, k, num_slots,
                              PAIRS=max(16, triton.next_power_of_2(T * k)), num_warps=4)
    return out


def host_operand(host: QuantHostReads, slots: Mapping[str, Tensor], proj: str, spec: QuantSpec) -> HostOperand:
    """Where `proj`'s host stacks sit from the slot tensors the kernels are handed (element offsets)."""
    slot_op, host_op = quant_operand(slots, proj, spec), quant_operand(host.stacks, proj, spec)
    return HostOperand(host.num_experts, host_offset(host_op.qweight, slot_op.qweight),
                       host_offset(host_op.scales, slot_op.scales), host_offset(host_op.biases, slot_op.biases))


def fused_moe_quant(hidden: Tensor, slots: Mapping[str, Tensor], slot_ids: Tensor, weights: Tensor,
                    spec: QuantSpec | Fp8Spec, config: MoeConfig | DecodeConfig | TokenConfig | None = None,
                    path: str = "auto",
                    reduce: bool = True, host: QuantHostReads | None = None, slot_map: Tensor | None = None,
                    layer_experts: int | None = None) -> Tensor:
    """Routed-expert FFN over quantized slots; contract of `quant_moe_reference` (SwiGLU). One token
    takes the one-token path (fused_moe_token_quant.py) where its format has one, else the decode
    path; larger calls the decode or grouped path, and long ones (`long_prompts.dequant_min_tokens`)
    the dequant path: every slot dequantized once, then the plain grouped GEMMs. With `slot_map`,
    `slot_ids` are expert ids, looked up in that expert → slot table (in the kernels on the
    one-token path). With `host`, slot ids S + e read expert e of its pinned stacks in place (calls
    of a few tokens), less the pairs its `cpu_take` leaves to the CPU. `layer_experts`: see `fused_moe_triton.run_paths`."""
    gate_up, down = quant_operand(slots, "gate_up", spec), quant_operand(slots, "down", spec)
    S, two_i, _ = gate_up.qweight.shape
    T, k = slot_ids.shape
    for t in (gate_up.qweight, gate_up.scales, down.qweight, slot_ids, weights):
        if t.device != hidden.device:
            raise ValueError(f"a bank tensor is on {t.device} but hidden is on {hidden.device}")
    if slot_map is not None and slot_map.device != hidden.device:
        raise ValueError(f"slot_map is on {slot_map.device} but hidden is on {hidden.device}")
    long = path == "dequant" or (path == "auto" and config is None and host is None
                                 and T >= dequant_min_tokens(spec))
    if long and host is not None:
        raise ValueError("experts read from host stacks take the decode path, not the dequant path")
    I = two_i // 2
    if not long:
        if host is not None:   # host stacks: a call larger than one token takes the decode path
            path = host_path(path, config, T, k)
        path = resolve_path(path, config, T, k, one_token=takes_token_path(spec, hidden.shape[1], I))
        if path == "token":
            reads = None
            if host is not None:
                reads = ((quant_operand(host.stacks, "gate_up", spec), quant_operand(host.stacks, "down", spec)),
                         host.cpu_take)
            return token_moe_quant(hidden, gate_up, down, slot_ids, weights, I, slot_map=slot_map,
                                   reduce=reduce, config=config, host=reads)
    if slot_map is not None:
        slot_ids = slot_map[slot_ids.long()]
    if long:   # every slot dequantized once, then the plain grouped GEMMs
        return _dequantized_call(hidden, gate_up, down, slot_ids, weights, config, S, I, reduce, layer_experts)
    operands = None
    if host is not None:
        operands = (host_operand(host, slots, "gate_up", spec), host_operand(host, slots, "down", spec))
        slot_ids = split_slots(slot_ids, S, host.cpu_take)   # run_paths refuses a path other than decode
    return run_paths(hidden, gate_up.qweight, down.qweight, slot_ids, weights, 0, config, path, S, I,
                     quant=(gate_up, down), reduce=reduce, host=operands, layer_experts=layer_experts)
