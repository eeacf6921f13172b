"""y = x @ dequantize(W)ᵀ (+ b) for one row x over a packed weight: the batch-1 projections of a
decode step whose dense layers are quantized (attention, shared experts, the LM head).

The decode MoE kernel that served these before reads a packed row one byte column at a time and
converts every value on its own; at batch 1 a projection is a matrix-vector product, bound by how
fast its packed bytes stream, so it gets the one-token expert kernels' scheme (see
fused_moe_token_quant.py): int32 words, 16 bytes per load, each value masked in place into the
mantissa of 2^23 (one bitwise op and one add), inputs stored plane by plane and pre-scaled so every
plane meets a contiguous run of them. Two launches:

* prepare (`planes_kernel`, the one-token kernels' rewrite): the row plane-ordered and pre-scaled,
  and (affine) the sum of each group's inputs. Every output column's bias term b · Σx needs the
  same per-group sums, so they are summed once here instead of once per column inside the product.
* product: grid (cdiv(N, BLOCK_N),); program n streams BLOCK_N packed rows along K, adds the
  products per word, then per group within each thread, where the group's scale (and, affine, its
  bias times the group's input sum) meets them; one fp32 total per column, the bias added, one
  rounding.

Formats: affine int8 / int4 / int2 and NF4 whose group divides K (every group whole); the rest, and
more than one row, take `quant_linear`'s other paths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from moestream.quant import QuantSpec

from .fused_moe_quant_triton import nf_codebook
from .fused_moe_token_quant import per_group, plane_values, planes_kernel, step_masks, token_path_supported
from .pdl import pdl_args, release_consumer, wait_for_producer

__all__ = ["QuantGemvTile", "default_tile", "quant_gemv", "quant_gemv_supported"]

_PREPARE_BLOCK = 1024


@dataclass(frozen=True)
class QuantGemvTile:
    block_n: int
    block_k: int    # values per K step
    num_warps: int


def default_tile(N: int, K: int, spec: QuantSpec) -> QuantGemvTile:
    """The tile for an (N, K) weight in `spec`. Swept on an H100 in int4-g64 over Qwen3-30B-A3B's
    projections (`benchmarks/quant_gemv_kernel.py --sweep`): 1024-value K steps for the layers' q/k/v
    (5120×2048, 8 columns a program) and o (2048×4096, 4), 8 warps; the LM head (151936×2048) wants
    16 columns a program on 2 warps. BLOCK_K stays within K, whole groups and words."""
    wide = N > 16384
    block_k = max(min(512 if wide else 1024, triton.next_power_of_2(K)), spec.group, 32 // spec.bits)
    if wide:
        return QuantGemvTile(block_n=16, block_k=block_k, num_warps=2)
    return QuantGemvTile(block_n=8 if N >= 4096 else 4, block_k=block_k, num_warps=8)


def quant_gemv_supported(spec: QuantSpec, K: int) -> bool:
    """Whether these kernels serve a weight in `spec` with K inputs per row: the formats and whole
    groups of the one-token expert kernels, whose words and planes they share."""
    return token_path_supported(spec, K, K)


@triton.jit
def _quant_gemv_kernel(planes_ptr, sums_ptr, q_ptr, s_ptr, z_ptr, code_ptr, b_ptr, out_ptr, N, K,
                       stride_qn, stride_sn, HAS_BIAS: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                       NF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                       USE_PDL: tl.constexpr):
    wait_for_producer(USE_PDL)
    V: tl.constexpr = 32 // BITS          # values per word
    W: tl.constexpr = BLOCK_K // V        # words per K step
    WPG: tl.constexpr = GROUP // V        # words per group
    GPB: tl.constexpr = BLOCK_K // GROUP  # groups per K step
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (offs_n % N).to(tl.int64)      # past N: wrap (store masked), loads stay unmasked along N
    offs_w = tl.arange(0, W)
    offs_g = tl.arange(0, GPB)
    q_ptrs = q_ptr + rows[:, None] * stride_qn + offs_w[None, :]
    s_ptrs = s_ptr + rows[:, None] * stride_sn + offs_g[None, :]
    z_ptrs = z_ptr + rows[:, None] * stride_sn + offs_g[None, :]
    x_ptrs = planes_ptr + offs_w[None, :] + 0 * rows[:, None]   # the words' shape and contiguity: their layout
    xg_ptrs = sums_ptr + offs_g[None, :] + 0 * rows[:, None]
    words_per_row = K // V
    acc = tl.zeros((BLOCK_N, GPB), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        wm, gm = step_masks(k0, offs_w, offs_g, K, V, GROUP, W, GPB, EVEN_K)
        words = tl.load(q_ptrs, mask=wm, other=0)
        d = tl.zeros((BLOCK_N, W), dtype=tl.float32)
        for p in tl.static_range(V):
            x = tl.load(x_ptrs + p * words_per_row, mask=wm, other=0.0)
            d += plane_values(words, p, code_ptr, BITS, NF) * x
        acc += per_group(d, BLOCK_N, W, WPG) * tl.load(s_ptrs, mask=gm, other=0.0).to(tl.float32)
        if not NF:
            acc += tl.load(z_ptrs, mask=gm, other=0.0).to(tl.float32) * tl.load(xg_ptrs, mask=gm, other=0.0)
        q_ptrs += W
        s_ptrs += GPB
        z_ptrs += GPB
        x_ptrs += W
        xg_ptrs += GPB
    release_consumer(USE_PDL)
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows).to(tl.float32)
    tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=offs_n < N)


def quant_gemv(x: Tensor, qweight: Tensor, scales: Tensor, biases: Tensor | None, spec: QuantSpec,
               bias: Tensor | None = None, tile: QuantGemvTile | None = None) -> Tensor:
    """x (..., K) holding one row, qweight (N, K·bits/8) uint8 with unit stride along K, scales (and
    biases) (N, K/group) → (..., N) in x's dtype. The caller checks `quant_gemv_supported`."""
    K = x.shape[-1]
    N = qweight.shape[0]
    x1 = x.reshape(K)
    words = qweight.view(torch.int32)
    nf = spec.kind == "nf"
    code = nf_codebook(spec.bits, str(x.device)) if nf else None
    planes = torch.empty((K,), dtype=torch.float32, device=x.device)
    sums = torch.empty((K // spec.group,), dtype=torch.float32, device=x.device)
    planes_kernel[(triton.cdiv(K, _PREPARE_BLOCK),)](x1, planes, sums, K, BITS=spec.bits, NF=nf, GROUP=spec.group,
                                                       SUMS=not nf, BLOCK=_PREPARE_BLOCK, num_warps=4, **pdl_args(x))
    cfg = tile or default_tile(N, K, spec)
    out = torch.empty(x.shape[:-1] + (N,), dtype=x.dtype, device=x.device)
    _quant_gemv_kernel[(triton.cdiv(N, cfg.block_n),)](
        planes, sums, words, scales, biases if biases is not None else scales, code if nf else planes,
        bias if bias is not None else scales, out, N, K, words.stride(0), scales.stride(0),
        HAS_BIAS=bias is not None, BITS=spec.bits, GROUP=spec.group, NF=nf, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, EVEN_K=K % cfg.block_k == 0, num_warps=cfg.num_warps, **pdl_args(x))
    return out
