"""Quantized bank slots dequantized into a plain weight tensor, in Triton: the long prompts' path.

A grouped GEMM over quantized slots dequantizes each weight tile once per M-block of tokens, on the
CUDA cores, inside the tensor-core loop (moe_tiles.gated_dot). For a long chunk, where every slot
is used by hundreds of tokens, it is cheaper to dequantize every slot once into the hidden dtype
(a pass that only streams memory) and run the plain grouped GEMM, whose tiles go straight from
memory to the tensor cores. The values are the ones the in-register path computes (the same
`quant_tile` / `dequant_plane` arithmetic, one rounding to the hidden dtype), so both paths multiply the
same weights. No host sync: safe inside CUDA graphs.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from torch import Tensor

from .fused_moe_decode import QuantOperand, fp8_args, quant_args
from .moe_tiles import dequant_plane, quant_tile

__all__ = ["dequantize_operand"]


@triton.jit
def _dequant_slots_kernel(b_ptr, s_ptr, z_ptr, code_ptr, out_ptr, N, K, HALF_N,
                          stride_be, stride_bn, stride_se, stride_sn, stride_oe, stride_on,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                          NF: tl.constexpr, FP8: tl.constexpr = 0, SCALE_ROWS: tl.constexpr = 1,
                          GATED: tl.constexpr = False, EVEN_K: tl.constexpr = False):
    """out[slot, rows, K-tile] = the dequantized weight of one (slot, row block, K-tile): rows of N
    (gate_up: the gate's HALF_N rows, then the up's), every value rounded once to out's dtype.
    EVEN_K (K a multiple of BLOCK_K): the packed bytes load unmasked, as wide vectors."""
    slot = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.program_id(2)
    n_mask = offs_n < N
    offs_bn = tl.where(n_mask, offs_n, 0).to(tl.int64)
    if GATED:   # FP8: the gate's scale-grid rows come first, then the up's (moe_tiles._scale_rows)
        up = offs_bn >= HALF_N
        srow = tl.where(up, (offs_bn - HALF_N) // SCALE_ROWS + tl.cdiv(HALF_N, SCALE_ROWS), offs_bn // SCALE_ROWS)
    else:
        srow = offs_bn // SCALE_ROWS
    VPB: tl.constexpr = 8 if BITS == 3 else 8 // BITS
    UB: tl.constexpr = BITS * VPB // 8
    U: tl.constexpr = BLOCK_K // VPB
    R: tl.constexpr = BLOCK_K // GROUP
    unit = kk * U + tl.arange(0, U)
    u_mask = unit * VPB < K
    word, scale, bias = quant_tile(b_ptr + slot * stride_be, s_ptr + slot * stride_se, z_ptr + slot * stride_se,
                                    offs_bn, srow, kk * U, unit, u_mask, kk * R, tl.cdiv(K, GROUP), stride_bn,
                                    stride_sn, UB, R, U, BLOCK_N, NF, GROUP, FP8, EVEN_K)
    out_rows = out_ptr + slot * stride_oe + offs_bn[None, :] * stride_on
    if VPB == 2:   # two values a byte: the planes interleaved back into K order, so the stores are contiguous
        dtype = out_ptr.dtype.element_ty
        pair = tl.join(dequant_plane(word, 0, scale, bias, code_ptr, BITS, NF, dtype, FP8),
                       dequant_plane(word, 1, scale, bias, code_ptr, BITS, NF, dtype, FP8))      # [U, BLOCK_N, 2]
        w = tl.reshape(tl.permute(pair, (0, 2, 1)), (BLOCK_K, BLOCK_N))
        k = kk * BLOCK_K + tl.arange(0, BLOCK_K)
        tl.store(out_rows + k[:, None], w, mask=n_mask[None, :] & (k < K)[:, None])
    else:
        for j in tl.static_range(VPB):
            w = dequant_plane(word, j, scale, bias, code_ptr, BITS, NF, out_ptr.dtype.element_ty, FP8)
            tl.store(out_rows + (unit * VPB + j)[:, None], w, mask=n_mask[None, :] & u_mask[:, None])


def dequantize_operand(operand: QuantOperand, k: int, dtype: torch.dtype, gated: bool,
                       out: Tensor | None = None) -> Tensor:
    """Every slot of a quantized projection (QuantOperand of S slots, K = `k` input columns) as a
    (S, N, K) tensor of `dtype`; `gated`: gate_up (FP8 reads the gate's and the up's scale grids)."""
    S, N = operand.qweight.shape[:2]
    if out is None:
        out = torch.empty((S, N, k), dtype=dtype, device=operand.qweight.device)
    b, s, z, code, stride_se, stride_sn, bits, group, nf, block_k = quant_args(operand.qweight, operand, 64)
    block_n = 64
    fp8 = fp8_args(operand)
    if gated and fp8:
        fp8["GATED"] = True
    grid = (S, triton.cdiv(N, block_n), triton.cdiv(k, block_k))
    with torch.cuda.device(out.device) if out.is_cuda else contextlib.nullcontext():
        _dequant_slots_kernel[grid](b, s, z, code, out, N, k, N // 2, b.stride(0), b.stride(1), stride_se, stride_sn,
                                    out.stride(0), out.stride(1), BLOCK_N=block_n, BLOCK_K=block_k, BITS=bits,
                                    GROUP=group, NF=nf, EVEN_K=k % block_k == 0, num_warps=4, **fp8)
    return out
