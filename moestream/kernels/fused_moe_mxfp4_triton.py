"""MXFP4 experts: the dequantizing kernels (spec: mxfp4_moe.mxfp4_moe_reference).

One pair at a time (`mxfp4_pairs`, few-token calls): two launches over the T·k pairs of a call:

* gate_up: grid (T·k, cdiv(I, BLOCK_N)); program (p, n) streams BLOCK_N gate rows and the matching up
  rows of pair p's expert along H, adds the biases, applies the activation (moe_activation.activate,
  GPT-OSS's clamped SwiGLU included) and writes the rounded row into a (T·k, I) buffer in the hidden
  dtype (as the reference rounds it before the down product).
* down: grid (T·k, cdiv(H, BLOCK_N)); program (p, n) reads BLOCK_N down rows of the pair's expert
  against that row, adds the bias and multiplies by the routing weight: the pair's fp32 row. Unrouted
  pairs (slot -1 or out of range) write zeros without reading a weight or their routing weight.

Grouped (`mxfp4_grouped`, prompts): the pairs aligned by slot into M-blocks of one expert each
(moe_align.py, on the device: nothing read back), then a gate_up launch over (M-block, N-block)
tiles (`tl.dot` of the gathered token rows against the dequantized tile of gate rows, and of up
rows, biases and activation in the epilogue, the rounded rows written per pair) and a down launch
(the same against down rows; bias, routing weight, the pair's fp32 row). The padding rows and the
unrouted group's blocks write nothing (the pair rows start at zero).

Dequantizing. A byte holds the codes of columns 2j (low nibble) and 2j + 1 (high nibble), so the
inputs are loaded as their even and odd columns and each nibble meets its own. A code becomes its fp4
e2m1 value by building the fp32 bits (exponent e - 1 + 127, the mantissa bit at bit 22; e = 0 is 0 or
0.5), and an e8m0 scale byte s becomes 2^(s - 127) as the fp32 bits s << 23: both exact, so each
weight is the reference's value exactly (a scale byte of 0, 2^-127, reads as 0).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
import triton.language as tl
from torch import Tensor

from .moe_activation import ACTIVATION_CODES, activate
from .moe_reference import Activation

BLOCK_N = 32
BLOCK_K = 64     # input columns per step: two 32-value groups, 32 bytes a row


@triton.jit
def _fp4(code):
    """fp4 e2m1 code (int32, 0-15) → fp32 value."""
    e = (code >> 1) & 3
    mant = code & 1
    normal = (((e + 126) << 23) | (mant << 22)).to(tl.float32, bitcast=True)
    value = tl.where(e == 0, mant.to(tl.float32) * 0.5, normal)
    return tl.where((code & 8) != 0, -value, value)


@triton.jit
def _mxfp4_rows_dot(x_ptr, blocks_ptr, scales_ptr, rows, row_mask, K, HALF_K, GROUPS,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Σ_k W[row, k] · x[k] in fp32 for BLOCK_N rows of one expert's MXFP4 weight (K columns)."""
    j = tl.arange(0, BLOCK_K // 2)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        col = k0 // 2 + j                                                   # byte column
        cmask = col < HALF_K
        x_even = tl.load(x_ptr + 2 * col, mask=cmask, other=0.0).to(tl.float32)
        x_odd = tl.load(x_ptr + 2 * col + 1, mask=cmask, other=0.0).to(tl.float32)
        m = row_mask[:, None] & cmask[None, :]
        byte = tl.load(blocks_ptr + rows[:, None] * HALF_K + col[None, :], mask=m, other=0).to(tl.int32)
        s = tl.load(scales_ptr + rows[:, None] * GROUPS + (col // 16)[None, :], mask=m, other=127).to(tl.int32)
        scale = (s << 23).to(tl.float32, bitcast=True)
        lo = _fp4(byte & 15) * scale
        hi = _fp4(byte >> 4) * scale
        acc += tl.sum(lo * x_even[None, :] + hi * x_odd[None, :], axis=1)
    return acc


@triton.jit
def _gate_up_kernel(x_ptr, slot_ptr, blocks_ptr, scales_ptr, bias_ptr, out_ptr, S, K, I, TOP_K,
                    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, alpha, limit,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    p = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < I
    slot = tl.load(slot_ptr + p).to(tl.int64)
    if (slot >= 0) & (slot < S):
        x_row = x_ptr + (p // TOP_K) * K
        expert_blocks = blocks_ptr + slot * (2 * I) * (K // 2)
        expert_scales = scales_ptr + slot * (2 * I) * (K // 32)
        gate = _mxfp4_rows_dot(x_row, expert_blocks, expert_scales, n, nmask, K, K // 2, K // 32, BLOCK_N, BLOCK_K)
        up = _mxfp4_rows_dot(x_row, expert_blocks, expert_scales, n + I, nmask, K, K // 2, K // 32, BLOCK_N, BLOCK_K)
        if HAS_BIAS:
            gate += tl.load(bias_ptr + slot * 2 * I + n, mask=nmask, other=0.0).to(tl.float32)
            up += tl.load(bias_ptr + slot * 2 * I + I + n, mask=nmask, other=0.0).to(tl.float32)
        h = activate(gate, up, ACTIVATION, alpha, limit)
        tl.store(out_ptr + p * I + n, h.to(out_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _down_kernel(h_ptr, slot_ptr, weight_ptr, blocks_ptr, scales_ptr, bias_ptr, out_ptr, S, K, H,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    p = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < H
    slot = tl.load(slot_ptr + p).to(tl.int64)
    y = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if (slot >= 0) & (slot < S):
        expert_blocks = blocks_ptr + slot * H * (K // 2)
        expert_scales = scales_ptr + slot * H * (K // 32)
        y = _mxfp4_rows_dot(h_ptr + p * K, expert_blocks, expert_scales, n, nmask, K, K // 2, K // 32, BLOCK_N, BLOCK_K)
        if HAS_BIAS:
            y += tl.load(bias_ptr + slot * H + n, mask=nmask, other=0.0).to(tl.float32)
        y = y * tl.load(weight_ptr + p).to(tl.float32)
    tl.store(out_ptr + p * H + n, y, mask=nmask)


@triton.jit
def _dequant_tile(blocks_ptr, scales_ptr, rows, row_mask, col, col_mask, HALF_K, GROUPS, EVEN_K: tl.constexpr = False):
    """The (rows, even columns) and (rows, odd columns) fp32 weights of byte columns `col` (EVEN_K: every
    column inside the row, masked by rows only)."""
    if EVEN_K:
        m = row_mask[:, None]   # broadcast over the columns
    else:
        m = row_mask[:, None] & col_mask[None, :]
    byte = tl.load(blocks_ptr + rows[:, None] * HALF_K + col[None, :], mask=m, other=0).to(tl.int32)
    s = tl.load(scales_ptr + rows[:, None] * GROUPS + (col // 16)[None, :], mask=m, other=127).to(tl.int32)
    scale = (s << 23).to(tl.float32, bitcast=True)
    return _fp4(byte & 15) * scale, _fp4(byte >> 4) * scale


@triton.jit
def _grouped_dot(a_ptr, a_rows, a_mask, a_stride, blocks_ptr, scales_ptr, rows, row_mask, K,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                 EVEN_K: tl.constexpr = False):
    """(BLOCK_M, BLOCK_N) fp32: rows `a_rows` of A (K wide) times the MXFP4 weight rows `rows`. EVEN_K
    (K a multiple of BLOCK_K): no mask along K, so A's tile is one K-contiguous load split into its even
    and odd columns in registers, and the weight bytes load as wide vectors (the same dots, the same bits)."""
    j = tl.arange(0, BLOCK_K // 2)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    HALF_K = K // 2
    for k0 in range(0, K, BLOCK_K):
        col = k0 // 2 + j
        cmask = col < HALF_K   # EVEN_K: all true, and `_dequant_tile` masks by rows only
        if EVEN_K:
            a_both = tl.load(a_ptr + a_rows[:, None] * a_stride + (k0 + tl.arange(0, BLOCK_K))[None, :],
                             mask=a_mask[:, None], other=0.0)
            a_even, a_odd = tl.split(tl.reshape(a_both, (BLOCK_M, BLOCK_K // 2, 2)))
        else:
            am = a_mask[:, None] & cmask[None, :]
            base = a_ptr + a_rows[:, None] * a_stride + 2 * col[None, :]
            a_even = tl.load(base, mask=am, other=0.0)
            a_odd = tl.load(base + 1, mask=am, other=0.0)
        w_even, w_odd = _dequant_tile(blocks_ptr, scales_ptr, rows, row_mask, col, cmask, HALF_K, K // 32, EVEN_K)
        acc += tl.dot(a_even, tl.trans(w_even.to(a_even.dtype)), input_precision=PRECISION)
        acc += tl.dot(a_odd, tl.trans(w_odd.to(a_odd.dtype)), input_precision=PRECISION)
    return acc


@triton.jit(do_not_specialize=["P"])
def _grouped_gate_up_kernel(x_ptr, pair_ptr, block_slot_ptr, blocks_ptr, scales_ptr, bias_ptr, out_ptr, P, K, I,
                            TOP_K, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, alpha, limit,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            PRECISION: tl.constexpr, EVEN_K: tl.constexpr = False):
    b = tl.program_id(0)
    slot = tl.load(block_slot_ptr + b).to(tl.int64)
    if slot >= 0:
        pair = tl.load(pair_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))
        pmask = pair < P
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < I
        expert_blocks = blocks_ptr + slot * (2 * I) * (K // 2)
        expert_scales = scales_ptr + slot * (2 * I) * (K // 32)
        token = pair // TOP_K
        gate = _grouped_dot(x_ptr, token, pmask, K, expert_blocks, expert_scales, n, nmask, K,
                            BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, EVEN_K)
        up = _grouped_dot(x_ptr, token, pmask, K, expert_blocks, expert_scales, n + I, nmask, K,
                          BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, EVEN_K)
        if HAS_BIAS:
            gate += tl.load(bias_ptr + slot * 2 * I + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
            up += tl.load(bias_ptr + slot * 2 * I + I + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        h = activate(gate, up, ACTIVATION, alpha, limit)
        tl.store(out_ptr + pair[:, None] * I + n[None, :], h.to(out_ptr.dtype.element_ty),
                 mask=pmask[:, None] & nmask[None, :])


@triton.jit(do_not_specialize=["P"])
def _grouped_down_kernel(h_ptr, pair_ptr, block_slot_ptr, weight_ptr, blocks_ptr, scales_ptr, bias_ptr, out_ptr,
                         P, K, H, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr = False):
    b = tl.program_id(0)
    slot = tl.load(block_slot_ptr + b).to(tl.int64)
    if slot >= 0:
        pair = tl.load(pair_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))
        pmask = pair < P
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < H
        expert_blocks = blocks_ptr + slot * H * (K // 2)
        expert_scales = scales_ptr + slot * H * (K // 32)
        y = _grouped_dot(h_ptr, pair, pmask, K, expert_blocks, expert_scales, n, nmask, K,
                         BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, EVEN_K)
        if HAS_BIAS:
            y += tl.load(bias_ptr + slot * H + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        y = y * tl.load(weight_ptr + pair, mask=pmask, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + pair[:, None] * H + n[None, :], y, mask=pmask[:, None] & nmask[None, :])


def mxfp4_grouped(hidden: Tensor, slots: Mapping[str, Tensor], slot_ids: Tensor, weights: Tensor,
                  activation: Activation, block_m: int | None = None) -> Tensor:
    """(T, k, H) fp32 rows of every pair (zero where unrouted), by the grouped launches."""
    from .moe_align import moe_align_block_size

    T, H = hidden.shape
    k = slot_ids.shape[1]
    S, two_i, _ = slots["gate_up.blocks"].shape
    I = two_i // 2
    P = T * k
    out = torch.zeros((P, H), dtype=torch.float32, device=hidden.device)
    if P == 0:
        return out.view(T, k, H)
    block_m = block_m or (16 if P < 1024 else 64)
    pair_ids, block_slot = moe_align_block_size(slot_ids, S, block_m)
    w = weights.reshape(-1).to(torch.float32).contiguous()
    x = hidden.contiguous()
    gate_up_bias, down_bias = slots.get("gate_up_bias"), slots.get("down_bias")
    has_bias = gate_up_bias is not None
    h = torch.zeros((P, I), dtype=hidden.dtype, device=hidden.device)
    precision = "ieee" if hidden.dtype == torch.float32 else "tf32"   # fp32: no tf32 rounding of the inputs
    blocks = block_slot.shape[0]
    _grouped_gate_up_kernel[(blocks, triton.cdiv(I, BLOCK_N))](
        x, pair_ids, block_slot, slots["gate_up.blocks"], slots["gate_up.scales"], gate_up_bias if has_bias else x, h,
        P, H, I, k, HAS_BIAS=has_bias, ACTIVATION=ACTIVATION_CODES[activation.name], alpha=float(activation.alpha),
        limit=float(activation.limit), BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, PRECISION=precision,
        EVEN_K=H % BLOCK_K == 0)
    _grouped_down_kernel[(blocks, triton.cdiv(H, BLOCK_N))](
        h, pair_ids, block_slot, w, slots["down.blocks"], slots["down.scales"], down_bias if has_bias else x, out,
        P, I, H, HAS_BIAS=has_bias, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, PRECISION=precision,
        EVEN_K=I % BLOCK_K == 0)
    return out.view(T, k, H)


def mxfp4_pairs(hidden: Tensor, slots: Mapping[str, Tensor], slot_ids: Tensor, weights: Tensor,
                activation: Activation) -> Tensor:
    """(T, k, H) fp32 rows of every (token, expert) pair over MXFP4 slots (zero where unrouted)."""
    T, H = hidden.shape
    k = slot_ids.shape[1]
    S, two_i, _ = slots["gate_up.blocks"].shape
    I = two_i // 2
    P = T * k
    ids = slot_ids.reshape(-1).to(torch.int32).contiguous()
    w = weights.reshape(-1).to(torch.float32).contiguous()
    x = hidden.contiguous()
    gate_up_bias, down_bias = slots.get("gate_up_bias"), slots.get("down_bias")
    h = torch.zeros((P, I), dtype=hidden.dtype, device=hidden.device)
    out = torch.empty((P, H), dtype=torch.float32, device=hidden.device)
    if P == 0:
        return out.view(T, k, H)
    has_bias = gate_up_bias is not None
    dummy = x   # never read when there are no biases
    _gate_up_kernel[(P, triton.cdiv(I, BLOCK_N))](
        x, ids, slots["gate_up.blocks"], slots["gate_up.scales"], gate_up_bias if has_bias else dummy, h,
        S, H, I, k, HAS_BIAS=has_bias, ACTIVATION=ACTIVATION_CODES[activation.name],
        alpha=float(activation.alpha), limit=float(activation.limit), BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    _down_kernel[(P, triton.cdiv(H, BLOCK_N))](
        h, ids, w, slots["down.blocks"], slots["down.scales"], down_bias if has_bias else dummy, out,
        S, I, H, HAS_BIAS=has_bias, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out.view(T, k, H)
