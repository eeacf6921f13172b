"""Fused RMSNorm (with the residual add before it) and per-head q/k norm + rotary, in Triton.

A decode step of a 24-layer model ran about a thousand tiny elementwise launches: every torch
RMSNorm is eight (cast, square, mean, add eps, rsqrt, multiply, cast back, scale) and every
rotary six per tensor. Each costs 1.5-2.5 µs even inside a CUDA graph, which added up to more
than half of the step. These kernels do each of those jobs in one launch; on a paged cache's
decode step, one launch normalises and rotates the queries and the keys and writes the keys and
values into their blocks (`qk_rope_paged`).

They round where the torch path (model/norms.py, model/rotary.py: the reference) rounds, so that
bf16 results match it to the last bit except where the fp32 sum of squares is reduced in another
order. Scale modes (`SCALE_*`) are the ways the norm classes scale:

* `SCALE_CAST_THEN_WEIGHT`: cast the normalised row to the output dtype, then multiply by the
  weight (a second rounding), as `RMSNorm` does;
* `SCALE_ONE_PLUS_WEIGHT_FP32`: multiply by (1 + weight) in fp32, then cast (`ZeroCentredRMSNorm`);
* `SCALE_WEIGHT_FP32`: multiply by the weight in fp32, then cast (`FP32ScaleRMSNorm`);
* `SCALE_NONE`: no weight (rotary alone).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moestream.kernels import SCALE_NONE
from moestream.kernels.pdl import pdl_args, release_consumer, wait_for_producer


@triton.jit
def _scaled(h, r, w, SCALE: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """The normalised fp32 values h * r scaled by weight w as the torch norm classes do (fp32 out)."""
    n = h * r
    if SCALE == 1:
        y = n.to(OUT_DTYPE).to(tl.float32) * w
    elif SCALE == 2:
        y = n * (1.0 + w)
    elif SCALE == 3:
        y = w * n
    else:
        y = n
    return y.to(OUT_DTYPE).to(tl.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, res_out_ptr, w_ptr, out_ptr, D, stride_x, stride_res, stride_out, eps,
                     HAS_RESIDUAL: tl.constexpr, SCALE: tl.constexpr, BLOCK_D: tl.constexpr,
                     USE_PDL: tl.constexpr):
    wait_for_producer(USE_PDL)
    release_consumer(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    m = d < D
    x = tl.load(x_ptr + row * stride_x + d, mask=m, other=0.0)
    if HAS_RESIDUAL:   # s = residual + x, rounded to the activation dtype as torch's add is
        x = (tl.load(res_ptr + row * stride_res + d, mask=m, other=0.0).to(tl.float32) + x.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * D + d, x, mask=m)
    h = x.to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / D + eps)
    if SCALE != 0:
        w = tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32)
    else:
        w = h
    y = _scaled(h, r, w, SCALE, x.dtype)
    tl.store(out_ptr + row * stride_out + d, y.to(out_ptr.dtype.element_ty), mask=m)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, scale: int,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm over the last dim of x; with `residual`, of residual + x. Returns (normed, sum or None)."""
    shape, D = x.shape, x.shape[-1]
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    res2 = summed = None
    if residual is not None:
        res2 = residual.reshape(-1, D)
        if res2.stride(-1) != 1:
            res2 = res2.contiguous()
        summed = torch.empty(shape, dtype=x.dtype, device=x.device)
    if rows:
        block = triton.next_power_of_2(D)
        _rms_norm_kernel[(rows,)](x2, res2 if res2 is not None else x2, summed if summed is not None else out,
                                  weight if weight is not None else x2, out, D, x2.stride(0),
                                  res2.stride(0) if res2 is not None else 0, D, eps,
                                  HAS_RESIDUAL=residual is not None, SCALE=scale if weight is not None else SCALE_NONE,
                                  BLOCK_D=block, num_warps=4 if block <= 4096 else 8, **pdl_args(x2))
    return out, summed


@triton.jit
def _normed_rotated(x_ptr, w_ptr, cos_ptr, sin_ptr, tok, hh, heads, D, R, stride_tok, stride_head, stride_cos, eps,
                    SCALE: tl.constexpr, BLOCK_D: tl.constexpr):
    """Heads `hh` of token `tok`: optional per-head RMSNorm, then rotary on the leading R dims
    (half-split). Returns the values as the activation dtype holds them (in fp32), and their mask."""
    d = tl.arange(0, BLOCK_D)
    m = (hh[:, None] < heads) & (d[None, :] < D)
    half = R // 2
    partner = tl.where(d < half, d + half, d - half)
    rotates = d < R
    pm = m & rotates[None, :]
    base = x_ptr + tok * stride_tok + hh[:, None] * stride_head
    x = tl.load(base + d[None, :], mask=m, other=0.0)
    xp = tl.load(base + partner[None, :], mask=pm, other=0.0)
    h, hp = x.to(tl.float32), xp.to(tl.float32)
    if SCALE != 0:
        r = 1.0 / tl.sqrt(tl.sum(h * h, axis=1) / D + eps)[:, None]
        w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)[None, :]
        wp = tl.load(w_ptr + partner, mask=rotates, other=0.0).to(tl.float32)[None, :]
        h = _scaled(h, r, w, SCALE, x.dtype)
        hp = _scaled(hp, r, wp, SCALE, x.dtype)
    c = tl.load(cos_ptr + tok * stride_cos + d, mask=rotates, other=1.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + tok * stride_cos + d, mask=rotates, other=0.0).to(tl.float32)[None, :]
    rot = tl.where((d < half)[None, :], -hp, hp)
    # x*cos and rotated*sin each round to the activation dtype before their sum, as torch's ops do
    a = (h * c).to(x.dtype).to(tl.float32)
    b = (rot * s).to(x.dtype).to(tl.float32)
    return tl.where(rotates[None, :], a + b, h), m


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, heads, D, R, stride_tok, stride_head,
                      stride_cos, eps, SCALE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One token's heads: optional per-head RMSNorm, then rotary on the leading R dims (half-split)."""
    tok = tl.program_id(0).to(tl.int64)
    hh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    y, m = _normed_rotated(x_ptr, w_ptr, cos_ptr, sin_ptr, tok, hh, heads, D, R, stride_tok, stride_head,
                           stride_cos, eps, SCALE, BLOCK_D)
    tl.store(out_ptr + (tok * heads + hh[:, None]) * D + d[None, :], y.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _qk_rope_paged_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, qo_ptr, kp_ptr, vp_ptr,
                          tables_ptr, rows_ptr, pos_ptr, q_heads, kv_heads, D, R,
                          stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos,
                          stride_table, stride_block, stride_pos, stride_kvh, eps,
                          SCALE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KH: tl.constexpr,
                          BLOCK_D: tl.constexpr, BS: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (t, j < last): query heads of block j, normed and rotated into qo. Program (t, last):
    the token's keys, normed and rotated, and its values, straight into their paged block."""
    wait_for_producer(USE_PDL)
    release_consumer(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    if j < tl.num_programs(1) - 1:
        hq = j * BLOCK_H + tl.arange(0, BLOCK_H)
        yq, mq = _normed_rotated(q_ptr, qw_ptr, cos_ptr, sin_ptr, tok, hq, q_heads, D, R, stride_qt, stride_qh,
                                 stride_cos, eps, SCALE, BLOCK_D)
        tl.store(qo_ptr + (tok * q_heads + hq[:, None]) * D + d[None, :], yq.to(qo_ptr.dtype.element_ty), mask=mq)
    else:
        hk = tl.arange(0, BLOCK_KH)
        y, m = _normed_rotated(k_ptr, kw_ptr, cos_ptr, sin_ptr, tok, hk, kv_heads, D, R, stride_kt, stride_kh,
                               stride_cos, eps, SCALE, BLOCK_D)
        row = tl.load(rows_ptr + tok).to(tl.int64)
        pos = tl.load(pos_ptr + tok).to(tl.int64)
        block = tl.load(tables_ptr + row * stride_table + pos // BS).to(tl.int64)
        dst = block * stride_block + (pos % BS) * stride_pos + hk[:, None] * stride_kvh + d[None, :]
        tl.store(kp_ptr + dst, y.to(kp_ptr.dtype.element_ty), mask=m)
        v = tl.load(v_ptr + tok * stride_vt + hk[:, None] * stride_vh + d[None, :], mask=m)
        tl.store(vp_ptr + dst, v.to(vp_ptr.dtype.element_ty), mask=m)


def _token_major(x: torch.Tensor) -> torch.Tensor:
    """x (B, L, heads, D) as the kernels index it: B * L tokens x.stride(1) apart, unit last stride
    (a view where it already is, as the q/k/v split of one GEMM gives)."""
    return x if x.stride(-1) == 1 and x.stride(0) == x.shape[1] * x.stride(1) else x.contiguous()


def _head_tiles(heads: int, D: int) -> tuple[int, int]:
    """(BLOCK_H, BLOCK_D): a program's heads and head dims, at most 4,096 values."""
    block_d = triton.next_power_of_2(D)
    return min(triton.next_power_of_2(heads), max(1, 4096 // block_d)), block_d


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, scale: int, cos: torch.Tensor,
              sin: torch.Tensor) -> torch.Tensor:
    """x (B, L, heads, D) (last dim contiguous) → per-head RMSNorm (none when weight is None), then
    rotary of the leading R = cos.shape[-1] dims; cos/sin (B, 1, L, R) or (B, L, R). Returns a new
    contiguous (B, L, heads, D)."""
    B, L, heads, D = x.shape
    R = cos.shape[-1]
    x = _token_major(x)
    cos2, sin2 = cos.reshape(B * L, R), sin.reshape(B * L, R)
    out = torch.empty((B, L, heads, D), dtype=x.dtype, device=x.device)
    if B * L == 0:
        return out
    block_h, block_d = _head_tiles(heads, D)
    grid = (B * L, triton.cdiv(heads, block_h))
    _norm_rope_kernel[grid](x, weight if weight is not None else x, cos2, sin2, out, heads, D, R, x.stride(1),
                            x.stride(2), cos2.stride(0), eps, SCALE=scale if weight is not None else SCALE_NONE,
                            BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4)
    return out


def qk_rope_paged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor | None,
                  k_weight: torch.Tensor | None, eps: float, scale: int, cos: torch.Tensor, sin: torch.Tensor,
                  k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor, rows: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
    """`norm_rope` of q and of k, and k and v written into their blocks (as `paged_kv_write`), in one
    launch. q (B, L, heads, D), k and v (B, L, kv_heads, D), each with a unit last stride; returns the
    new contiguous q. Both norms are of one kind (`scale`, `eps`); weights None: rotary alone."""
    B, L, heads, D = q.shape
    kv_heads = k.shape[2]
    R = cos.shape[-1]
    q, k, v = _token_major(q), _token_major(k), _token_major(v)
    cos2, sin2 = cos.reshape(B * L, R), sin.reshape(B * L, R)
    rows, positions = rows.reshape(-1).contiguous(), positions.reshape(-1).contiguous()
    out = torch.empty((B, L, heads, D), dtype=q.dtype, device=q.device)
    if B * L == 0:
        return out
    block_h, block_d = _head_tiles(heads, D)
    if q_weight is None:
        scale = SCALE_NONE
    _qk_rope_paged_kernel[(B * L, triton.cdiv(heads, block_h) + 1)](
        q, k, v, q_weight if q_weight is not None else q, k_weight if k_weight is not None else k, cos2, sin2, out,
        k_pool, v_pool, tables, rows, positions, heads, kv_heads, D, R,
        q.stride(1), q.stride(2), k.stride(1), k.stride(2), v.stride(1), v.stride(2), cos2.stride(0),
        tables.stride(0), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), eps,
        SCALE=scale, BLOCK_H=block_h, BLOCK_KH=triton.next_power_of_2(kv_heads), BLOCK_D=block_d,
        BS=k_pool.shape[1], num_warps=4, **pdl_args(q))
    return out
