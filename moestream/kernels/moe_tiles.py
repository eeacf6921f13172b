"""The K-loop both fused-MoE GEMM kernels share: one row block of A against one expert's tile of B.

With GATED, B holds the gate rows and, N rows further, the up rows of gate_up; both are
accumulated in the same pass over K so the activation can be applied in the epilogue. B may be a
plain weight or a quantized one, dequantized tile by tile in registers, so every kernel serves
every expert format.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TypeVar

import triton
import triton.language as tl


@triton.jit
def _scales(base, offs_bn, first_group, num_groups, stride_sn, R: tl.constexpr, U: tl.constexpr,
            BLOCK_N: tl.constexpr):
    """Scales (or biases) of the R groups a K-tile spans, expanded to its U units: [U, BLOCK_N] fp32."""
    r = first_group + tl.arange(0, R)
    tile = tl.load(base + offs_bn[None, :] * stride_sn + r[:, None], mask=(r < num_groups)[:, None],
                   other=0.0).to(tl.float32)
    return tl.reshape(tl.broadcast_to(tl.expand_dims(tile, 1), (R, U // R, BLOCK_N)), (U, BLOCK_N))


@triton.jit
def _units(b_base, offs_bn, unit, u_mask, stride_bn, UB: tl.constexpr, EVEN_K: tl.constexpr):
    """The packed words of U units (each UB bytes: 1, or 3 for 3-bit values) of rows offs_bn: [U, BLOCK_N] int32.
    EVEN_K (every unit of the tile inside K): unmasked, so the K-contiguous bytes load as wide vectors."""
    row = b_base + offs_bn[None, :] * stride_bn
    byte = unit * UB
    if EVEN_K:
        word = tl.load(row + byte[:, None]).to(tl.int32)
    else:
        word = tl.load(row + byte[:, None], mask=u_mask[:, None], other=0).to(tl.int32)
    for b in tl.static_range(1, UB):
        word = word | (tl.load(row + (byte + b)[:, None], mask=u_mask[:, None], other=0).to(tl.int32) << (8 * b))
    return word


FP8_NATIVE, FP8_PORTABLE = 1, 2   # the kernels' FP8 switch: e4m3 converted by the hardware, or by bit arithmetic


@triton.jit
def _e4m3_value(byte, FP8: tl.constexpr):
    """float8_e4m3fn bits (uint8) → fp32, exactly: the hardware conversion (FP8_NATIVE, sm_89 and
    later), or bit arithmetic anywhere (FP8_PORTABLE): a normal value's exponent re-biased by 120
    (127 - 7) with its 3 mantissa bits moved up, a subnormal one m·2^-9."""
    if FP8 == 1:
        value = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        b = byte.to(tl.int32)
        em = b & 0x7F
        normal = ((em << 20) + (120 << 23)).to(tl.float32, bitcast=True)
        magnitude = tl.where(em < 8, em.to(tl.float32) * 0.001953125, normal)
        value = tl.where((b & 0x80) != 0, -magnitude, magnitude)
    return value


@triton.jit
def _fp8_tile(b_base, s_base, offs_bn, srow, k0, unit, u_mask, num_groups, stride_bn, stride_sn, U: tl.constexpr,
              BLOCK_N: tl.constexpr, GROUP: tl.constexpr, FP8: tl.constexpr, EVEN_K: tl.constexpr):
    """FP8 e4m3 bytes of the K-tile of rows offs_bn starting at column k0 as fp32 values, and the
    scale of each value's block (scale row `srow` of each weight row, column k // GROUP): [U, BLOCK_N]
    each. Where the tile holds whole blocks (U a multiple of GROUP) or lies inside one (GROUP a
    multiple of U), each row's few scales are loaded once and broadcast; otherwise (ragged blocks
    such as a channel scale over a width no power of two divides) one load per value."""
    if EVEN_K:
        byte = tl.load(b_base + offs_bn[None, :] * stride_bn + unit[:, None])
    else:
        byte = tl.load(b_base + offs_bn[None, :] * stride_bn + unit[:, None], mask=u_mask[:, None], other=0)
    value = _e4m3_value(byte, FP8)
    rows = s_base + srow[None, :] * stride_sn
    if U % GROUP == 0:
        R: tl.constexpr = U // GROUP
        r = k0 // GROUP + tl.arange(0, R)
        tile = tl.load(rows + r[:, None], mask=(r < num_groups)[:, None], other=0.0)
        scale = tl.reshape(tl.broadcast_to(tl.expand_dims(tile, 1), (R, GROUP, BLOCK_N)), (U, BLOCK_N))
    elif GROUP % U == 0:
        scale = tl.broadcast_to(tl.load(rows + k0 // GROUP), (U, BLOCK_N))
    else:
        scale = tl.load(rows + (unit // GROUP)[:, None], mask=u_mask[:, None], other=0.0)
    return value, scale


@triton.jit
def quant_tile(b_base, s_base, z_base, offs_bn, srow, k0, unit, u_mask, g0, num_groups, stride_bn, stride_sn,
                UB: tl.constexpr, R: tl.constexpr, U: tl.constexpr, BLOCK_N: tl.constexpr, NF: tl.constexpr,
                GROUP: tl.constexpr, FP8: tl.constexpr, EVEN_K: tl.constexpr = False):
    """The packed words, scales and biases (NF: the scales again, unused) of one K-tile of rows offs_bn;
    FP8: the values as fp32, each value's block scale, and the scales again (unused). EVEN_K: the tile
    lies inside K (its weight bytes load unmasked)."""
    if FP8:
        word, scale = _fp8_tile(b_base, s_base, offs_bn, srow, k0, unit, u_mask, num_groups, stride_bn, stride_sn,
                                U, BLOCK_N, GROUP, FP8, EVEN_K)
        bias = scale
    else:
        word = _units(b_base, offs_bn, unit, u_mask, stride_bn, UB, EVEN_K)
        scale = _scales(s_base, offs_bn, g0, num_groups, stride_sn, R, U, BLOCK_N)
        bias = scale if NF else _scales(z_base, offs_bn, g0, num_groups, stride_sn, R, U, BLOCK_N)
    return word, scale, bias


@triton.jit
def dequant_plane(word, j: tl.constexpr, scale, bias, code_ptr, BITS: tl.constexpr, NF: tl.constexpr, OUT_DTYPE: tl.constexpr,
           FP8: tl.constexpr):
    """Value j of every unit, dequantized: q·scale + bias (NF: codebook[q]·scale; FP8: value·scale),
    fp32 math, one rounding."""
    if FP8:
        w = word * scale
    else:
        q = (word >> (j * BITS)) & ((1 << BITS) - 1)
        if NF:
            w = tl.load(code_ptr + q) * scale
        else:
            w = q.to(tl.float32) * scale + bias
    return w.to(OUT_DTYPE)


@triton.jit
def _scale_rows(offs_bn, N, SCALE_ROWS: tl.constexpr):
    """The scale-grid rows of weight rows offs_bn and of the up rows N further (FP8: the gate's grid
    of ⌈N/SCALE_ROWS⌉ rows comes first, then the up's)."""
    srow = offs_bn // SCALE_ROWS
    return srow, srow + tl.cdiv(N, SCALE_ROWS)


@triton.jit
def gated_dot(a_rows, b_base, s_base, z_base, code_ptr, offs_bn, row_mask, K, N,
              stride_ak, stride_bk, stride_bn, stride_sn,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              GATED: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
              BITS: tl.constexpr, GROUP: tl.constexpr, NF: tl.constexpr, FP8: tl.constexpr,
              SCALE_ROWS: tl.constexpr):
    """fp32 (acc, acc_up) of A[rows] @ B^T over all of K (acc_up is acc's twin, unused without GATED).

    `a_rows` points at each A row's start; B is one expert's weight: rows `offs_bn` (and, GATED,
    the up rows N further) of the tensor at `b_base`.

    BITS = 0: a plain weight, read as [BLOCK_K, BLOCK_N] tiles with K contiguous.
    BITS > 0: a quantized one (moestream.quant's layout: each row a little-endian bit stream, one
    scale and bias per GROUP values; s_base / z_base point at the expert's scales / biases). A
    K-tile is read as U = BLOCK_K / VPB packed units per row (VPB values in UB bytes: two 4-bit
    values in a byte, eight 3-bit values in three), every byte once and K-contiguous. Instead of
    interleaving the unpacked values back into K order, value plane j (the j-th value of every
    unit) is multiplied by the matching strided columns of A: VPB dots of depth U per tile (4-bit: A's
    tile read in one K-contiguous load and split into its two planes' columns in registers). EVEN_K (K a
    multiple of BLOCK_K): no tile needs a mask along K, so the weight bytes and A's columns load as wide
    vectors (a mask per unit or per value pair would cut them to single bytes or pairs). The
    host picks BLOCK_K as a multiple of GROUP, so a tile spans R whole groups.

    FP8 (BITS = 8; FP8_NATIVE or FP8_PORTABLE, how the bits become fp32: `_e4m3_value`): a byte a
    value, float8_e4m3fn bits, each scaled by its block's float32 scale
    (blocks of SCALE_ROWS rows × GROUP columns; the scale grid's rows of gate rows first, then of
    up rows: `_scale_rows`); BLOCK_K needs no relation to the blocks (the scale is read per value).
    """
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if BITS == 0:
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_rows[:, None] + offs_k[None, :] * stride_ak
        b_ptrs = b_base + offs_bn[None, :] * stride_bn + offs_k[:, None] * stride_bk
        up_ptrs = b_ptrs + N * stride_bn
        for kk in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_mask[:, None], other=0.0)
                b = tl.load(b_ptrs)
            else:
                k_mask = offs_k < K - kk * BLOCK_K
                a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_mask[:, None], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            if GATED:
                if EVEN_K:
                    b_up = tl.load(up_ptrs)
                else:
                    b_up = tl.load(up_ptrs, mask=k_mask[:, None], other=0.0)
                acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
                up_ptrs += BLOCK_K * stride_bk
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
    else:
        VPB: tl.constexpr = 8 if BITS == 3 else 8 // BITS      # values per packed unit
        UB: tl.constexpr = BITS * VPB // 8                     # bytes per packed unit
        U: tl.constexpr = BLOCK_K // VPB
        R: tl.constexpr = BLOCK_K // GROUP
        num_groups = tl.cdiv(K, GROUP)
        offs_u = tl.arange(0, U)
        srow, srow_up = _scale_rows(offs_bn, N, SCALE_ROWS)
        for kk in range(0, tl.cdiv(K, BLOCK_K)):
            unit = kk * U + offs_u
            u_mask = unit * VPB < K
            g0 = kk * R
            word, scale, bias = quant_tile(b_base, s_base, z_base, offs_bn, srow, kk * U, unit, u_mask, g0,
                                            num_groups, stride_bn, stride_sn, UB, R, U, BLOCK_N, NF, GROUP, FP8,
                                            EVEN_K)
            if GATED:
                word_up, scale_up, bias_up = quant_tile(b_base, s_base, z_base, offs_bn + N, srow_up, kk * U, unit,
                                                         u_mask, g0, num_groups, stride_bn, stride_sn, UB, R, U,
                                                         BLOCK_N, NF, GROUP, FP8, EVEN_K)
            if VPB == 2:
                # Both planes' columns of A in one K-contiguous load, split in registers (a strided
                # load per plane cannot be vectorized); the same dots in the same order as below.
                offs_k = tl.arange(0, BLOCK_K)
                a_ptrs = a_rows[:, None] + ((kk * BLOCK_K + offs_k) * stride_ak)[None, :]
                if EVEN_K:
                    a_both = tl.load(a_ptrs, mask=row_mask[:, None], other=0.0)
                else:
                    k_mask = (kk * U + offs_k // 2) * 2 < K       # a value is read where its unit is
                    a_both = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                a0, a1 = tl.split(tl.reshape(a_both, (BLOCK_M, U, 2)))
                acc = _plane_dot(acc, a0, word, 0, scale, bias, code_ptr, BITS, NF, FP8, DOT_PRECISION)
                if GATED:
                    acc_up = _plane_dot(acc_up, a0, word_up, 0, scale_up, bias_up, code_ptr, BITS, NF, FP8,
                                        DOT_PRECISION)
                acc = _plane_dot(acc, a1, word, 1, scale, bias, code_ptr, BITS, NF, FP8, DOT_PRECISION)
                if GATED:
                    acc_up = _plane_dot(acc_up, a1, word_up, 1, scale_up, bias_up, code_ptr, BITS, NF, FP8,
                                        DOT_PRECISION)
            else:
                for j in tl.static_range(VPB):
                    a = tl.load(a_rows[:, None] + ((unit * VPB + j) * stride_ak)[None, :],
                                mask=row_mask[:, None] & u_mask[None, :], other=0.0)
                    acc = _plane_dot(acc, a, word, j, scale, bias, code_ptr, BITS, NF, FP8, DOT_PRECISION)
                    if GATED:
                        acc_up = _plane_dot(acc_up, a, word_up, j, scale_up, bias_up, code_ptr, BITS, NF, FP8,
                                            DOT_PRECISION)
    return acc, acc_up


@triton.jit
def _plane_dot(acc, a, word, j: tl.constexpr, scale, bias, code_ptr, BITS: tl.constexpr, NF: tl.constexpr,
               FP8: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + A's columns of value plane j @ that plane of the tile, dequantized."""
    w = dequant_plane(word, j, scale, bias, code_ptr, BITS, NF, a.dtype, FP8)
    return tl.dot(a, w, acc, input_precision=DOT_PRECISION)


@triton.jit
def quant_gemv(a_row, b_base, s_base, z_base, code_ptr, offs_bn, K, N, stride_ak, stride_bn, stride_sn,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr,
               BITS: tl.constexpr, GROUP: tl.constexpr, NF: tl.constexpr, FP8: tl.constexpr,
               SCALE_ROWS: tl.constexpr, EVEN_K: tl.constexpr = False):
    """fp32 (acc, acc_up) [BLOCK_N] of ONE row of A against a quantized expert, without tensor cores.

    The decode case (one token per expert): the dot path would pad the row to 16 and move every
    dequantized tile through shared memory into the MMA layout. Here each tile is dequantized in
    registers, multiplied by the row elementwise and summed into a [units, BLOCK_N] accumulator;
    one reduction at the end."""
    VPB: tl.constexpr = 8 if BITS == 3 else 8 // BITS
    UB: tl.constexpr = BITS * VPB // 8
    U: tl.constexpr = BLOCK_K // VPB
    R: tl.constexpr = BLOCK_K // GROUP
    num_groups = tl.cdiv(K, GROUP)
    offs_u = tl.arange(0, U)
    srow, srow_up = _scale_rows(offs_bn, N, SCALE_ROWS)
    acc = tl.zeros((U, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((U, BLOCK_N), dtype=tl.float32)
    for kk in range(0, tl.cdiv(K, BLOCK_K)):
        unit = kk * U + offs_u
        u_mask = unit * VPB < K
        g0 = kk * R
        word, scale, bias = quant_tile(b_base, s_base, z_base, offs_bn, srow, kk * U, unit, u_mask, g0,
                                        num_groups, stride_bn, stride_sn, UB, R, U, BLOCK_N, NF, GROUP, FP8, EVEN_K)
        if GATED:
            word_up, scale_up, bias_up = quant_tile(b_base, s_base, z_base, offs_bn + N, srow_up, kk * U, unit,
                                                     u_mask, g0, num_groups, stride_bn, stride_sn, UB, R, U, BLOCK_N,
                                                     NF, GROUP, FP8, EVEN_K)
        for j in tl.static_range(VPB):
            a = tl.load(a_row + (unit * VPB + j) * stride_ak, mask=u_mask, other=0.0).to(tl.float32)
            acc += dequant_plane(word, j, scale, bias, code_ptr, BITS, NF, tl.float32, FP8) * a[:, None]
            if GATED:
                acc_up += dequant_plane(word_up, j, scale_up, bias_up, code_ptr, BITS, NF, tl.float32, FP8) * a[:, None]
    return tl.sum(acc, axis=0), tl.sum(acc_up, axis=0)


def quant_block_k(bits: int, group: int) -> int:
    """BLOCK_K of a quantized tile: whole groups, and at least 16 units deep for the dots."""
    values_per_unit = 8 if bits == 3 else 8 // bits
    return max(group, 16 * values_per_unit)


Tile = TypeVar("Tile")   # a dataclass with block_n, block_k and num_stages fields


def fit_tile(tile: Tile, block_m: int, n: int, k: int, elt_bytes: int, gated: bool, smem_budget: int) -> Tile:
    """Shrink a tile to the problem and to shared memory.

    tl.dot needs every tile dimension >= 16; small or odd shapes get the smallest power of two
    that covers them. fp32 inputs double the pipeline's shared memory, so stages (then BLOCK_K)
    are reduced until it fits.
    """
    block_n = min(tile.block_n, max(16, triton.next_power_of_2(n)))
    block_k = min(tile.block_k, max(16, triton.next_power_of_2(k)))
    stages = tile.num_stages
    b_tiles = 2 if gated else 1

    def smem(st: int, bk: int) -> int:
        return st * (block_m + b_tiles * block_n) * bk * elt_bytes

    while smem(stages, block_k) > smem_budget and stages > 2:
        stages -= 1
    while smem(stages, block_k) > smem_budget and block_k > 32:
        block_k //= 2
    return replace(tile, block_n=block_n, block_k=block_k, num_stages=stages)
