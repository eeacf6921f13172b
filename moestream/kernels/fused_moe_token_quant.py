"""One token's quantized experts (batch-1 decode): fused_moe_token.py for packed banks.

The decode path (fused_moe_decode.py) serves a quantized bank at T = 1 with three launches plus a
slot-map lookup and a split launch, and reads its packed bytes one byte column at a time. Here:

* planes: the hidden row rewritten in the order the packed words are read (below), 8 KB.
* gate_up: grid (k, cdiv(I, BLOCK_N)); program (j, n) streams BLOCK_N gate rows and the matching up
  rows of pair j's expert along H and writes `act(gate, up)` into row j of a (k, I) buffer, in the
  same order.
* down: grid (cdiv(H, BLOCK_N),); program n reads BLOCK_N down rows of every pair's expert at once
  (rows of all k pairs side by side: every pair's bytes in flight together), multiplies each pair's
  row by its routing weight and adds the pairs to an fp32 total in routing order (`reduce`), or
  writes each pair's fp32 row (`reduce=False`).

Words and planes. Packed rows are read as int32 words (8 values of 4 bits, 4 of 8 bits, 16 of 2
bits), 16 bytes per load. Value plane p of a word (its p-th value) meets the inputs at word·V + p,
so the inputs are stored plane by plane: value i at (i mod V) · K/V + i / V, and plane p of a run
of words meets a contiguous run of inputs, loaded like the words themselves (the same register
layout; no trip through shared memory per plane). A value becomes a float without a shift or a
conversion instruction: masked in place and OR-ed into the mantissa of 2^23, it reads 2^23 +
code · 2^(bits·l) (l: its place among the values below bit 23), and one subtraction leaves
code · 2^(bits·l); the stored inputs of that plane are pre-scaled by 2^-(bits·l), so the product is
code · x exactly (powers of two change no rounding). Per group the affine weight q·s + b
contributes s · Σ q·x + b · Σ x (fp32 sums of exact products, regrouped against the reference's
dequantize-then-multiply); NF4 looks each code up in its 16-entry codebook: s · Σ code[q]·x. The
per-word sums are added up per group inside each thread before the scales meet them, so the scales'
own (smaller) tile is the only one in another layout.

Formats: affine int8 / int4 / int2 and NF4, where the group divides both input widths (every group
whole). The others (3-bit values straddle words; ragged last groups) take the decode path.

Bits. As in the dense one-token path, the down launch is compiled without FMA contraction and sums
the pairs from 0 in routing order, so pair rows written here (`reduce=False`) and summed by
`sum_pairs` give the bits of the in-launch total: a bank computing resident and streamed experts in
separate calls still equals full residency. A slot's expert and the same expert read in place from
a host stack are read by the same instructions: the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from moestream.quant import QuantSpec

from .fused_moe_decode import QuantOperand
from .fused_moe_token import TokenConfig, TokenTile, expert_offset, host_offset, pair_sources, slot_of, store_pair_rows
from .moe_activation import activate
from .pdl import pdl_args, release_consumer, wait_for_producer
from .switch import Switch

__all__ = ["QUANT_TOKEN_CONFIG", "one_token_quant", "takes_token_path", "token_moe_quant", "token_path_supported"]

# Swept on an H100 at Qwen3-30B-A3B's shape in int4-g64 (`benchmarks/fused_moe_kernel.py --format int4
# --tune-token`): 20.5 us cold for the three launches, against the decode path's 38.0 (a swept down
# tile of 2 columns × 256, 2 warps: 20.4).
QUANT_TOKEN_CONFIG = TokenConfig(gate_up=TokenTile(4, 512, 2), down=TokenTile(8, 256, 8))

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


_enabled = Switch()


def token_path_supported(spec: QuantSpec, hidden: int, intermediate: int) -> bool:
    """Whether these kernels serve experts in `spec` at these widths (else the decode path does)."""
    affine = spec.kind == "int" and spec.bits in (8, 4, 2)
    nf4 = spec.kind == "nf" and spec.bits == 4
    return (affine or nf4) and hidden % spec.group == 0 and intermediate % spec.group == 0


def takes_token_path(spec: QuantSpec, hidden: int, intermediate: int) -> bool:
    """Whether `fused_moe_quant` sends one token to this path: supported, and not switched off."""
    return _enabled.on and token_path_supported(spec, hidden, intermediate)


def one_token_quant(enabled: bool):
    """Switch the one-token quantized path on or off inside the block (A/B benchmarks; graphs
    captured inside keep the choice)."""
    return _enabled.set(enabled)


@triton.jit
def _affine_plane(words, p: tl.constexpr, BITS: tl.constexpr):
    """Value p of every word as fp32, times 2^(BITS · l): masked in place (no shift while its bits lie
    below bit 23), OR-ed into the mantissa of 2^23, less 2^23. One bitwise op and one add per value."""
    P0: tl.constexpr = 23 // BITS
    base: tl.constexpr = (p // P0) * P0
    if base > 0:
        words = words >> (base * BITS)
    mask: tl.constexpr = ((1 << BITS) - 1) << ((p - base) * BITS)
    return ((words & mask) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _nf_plane(words, p: tl.constexpr, code_ptr, BITS: tl.constexpr):
    """Value p of every word's codebook entry."""
    return tl.load(code_ptr + ((words >> (p * BITS)) & ((1 << BITS) - 1)))


@triton.jit
def plane_values(words, p: tl.constexpr, code_ptr, BITS: tl.constexpr, NF: tl.constexpr):
    """Value p of every word as the kernels multiply it: its codebook entry (NF), else `_affine_plane`."""
    if NF:
        v = _nf_plane(words, p, code_ptr, BITS)
    else:
        v = _affine_plane(words, p, BITS)
    return v


@triton.jit
def per_group(t, ROWS: tl.constexpr, W: tl.constexpr, WPG: tl.constexpr):
    """(ROWS, W) per-word sums → (ROWS, W / WPG) per-group sums, within each thread's words: the group
    scales then meet a tensor 1/WPG the size (one small layout change per K step, not one per word)."""
    return tl.sum(tl.reshape(t, (ROWS, W // WPG, WPG)), axis=2)


@triton.jit
def step_masks(k0, offs_w, offs_g, K, V: tl.constexpr, GROUP: tl.constexpr, W: tl.constexpr, GPB: tl.constexpr,
                EVEN_K: tl.constexpr):
    """The (1, W) packed-word mask and (1, GPB) group mask of the K step at `k0` over a row of K values
    (all true when K is a whole number of steps)."""
    if EVEN_K:
        wm = tl.full((1, W), 1, tl.int1)
        gm = tl.full((1, GPB), 1, tl.int1)
    else:
        wm = ((k0 // V + offs_w) < K // V)[None, :]
        gm = ((k0 // GROUP + offs_g) < K // GROUP)[None, :]
    return wm, gm


@triton.jit
def planes_kernel(x_ptr, out_ptr, sums_ptr, H, BITS: tl.constexpr, NF: tl.constexpr, GROUP: tl.constexpr,
                   SUMS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """The hidden row as the gate_up launch reads it: fp32, value i at (i mod V) · H/V + i / V, times
    2^-(BITS · l) for its plane p, l = p mod (23 // BITS) (affine: what `_affine_plane` leaves
    the code times), exactly. With SUMS (the quantized GEMV), also each GROUP's Σ x in fp32 (BLOCK a
    multiple of GROUP)."""
    wait_for_producer(USE_PDL)
    V: tl.constexpr = 32 // BITS
    P0: tl.constexpr = 23 // BITS
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < H, other=0.0).to(tl.float32)
    release_consumer(USE_PDL)
    if SUMS:
        g = tl.program_id(0) * (BLOCK // GROUP) + tl.arange(0, BLOCK // GROUP)
        tl.store(sums_ptr + g, tl.sum(tl.reshape(x, (BLOCK // GROUP, GROUP)), axis=1), mask=g < H // GROUP)
    plane = i % V
    if not NF:
        x = x / (1 << ((plane % P0) * BITS)).to(tl.float32)   # a power of two: exact
    tl.store(out_ptr + plane * (H // V) + i // V, x, mask=i < H)


@triton.jit
def _qtoken_gate_up_kernel(x_ptr, q_ptr, s_ptr, z_ptr, code_ptr, c_ptr, ids_ptr, map_ptr, take_ptr, cut_ptr,
                           I, H, num_slots, num_host, host_q, host_s, host_z, top_k, stride_id,
                           stride_qe, stride_qn, stride_se, stride_sn, stride_cm,
                           HAS_MAP: tl.constexpr, ACTIVATION: tl.constexpr, BITS: tl.constexpr,
                           GROUP: tl.constexpr, NF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           EVEN_K: tl.constexpr, SPLIT: tl.constexpr, K_PAD: tl.constexpr, OUT_DTYPE: tl.constexpr,
                           USE_PDL: tl.constexpr):
    """`x_ptr`: the hidden row as `planes_kernel` writes it. Writes row j of the (k, I) fp32
    activations the same way for the down launch: value i at (i mod V) · I/V + i / V, rounded to the
    hidden dtype (OUT_DTYPE), then (affine) scaled as `planes_kernel` scales, exactly."""
    wait_for_producer(USE_PDL)
    j = tl.program_id(0)
    if SPLIT:
        src, _ = pair_sources(ids_ptr, map_ptr, take_ptr, cut_ptr, top_k, stride_id, num_slots, num_host, HAS_MAP,
                          SPLIT, K_PAD)
        slot = tl.sum(tl.where(tl.arange(0, K_PAD) == j, src, 0), axis=0)
    else:
        slot = slot_of(ids_ptr, map_ptr, j, top_k, stride_id, num_slots, num_host, HAS_MAP)
    if slot < 0:
        return
    V: tl.constexpr = 32 // BITS          # values per word
    W: tl.constexpr = BLOCK_K // V        # words per K step
    WPG: tl.constexpr = GROUP // V        # words per group
    P0: tl.constexpr = 23 // BITS
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (offs_n % I).to(tl.int64)      # past I: wrap (store masked), loads stay unmasked along N
    offs_w = tl.arange(0, W)
    g_ptrs = q_ptr + expert_offset(slot, num_slots, host_q, stride_qe) + rows[:, None] * stride_qn + offs_w[None, :]
    u_ptrs = g_ptrs + I * stride_qn
    GPB: tl.constexpr = BLOCK_K // GROUP  # groups per K step
    offs_g = tl.arange(0, GPB)
    gs_ptrs = s_ptr + expert_offset(slot, num_slots, host_s, stride_se) + rows[:, None] * stride_sn + offs_g[None, :]
    us_ptrs = gs_ptrs + I * stride_sn
    gz_ptrs = z_ptr + expert_offset(slot, num_slots, host_z, stride_se) + rows[:, None] * stride_sn + offs_g[None, :]
    uz_ptrs = gz_ptrs + I * stride_sn
    words_per_row = H // V
    x_ptrs = x_ptr + offs_w[None, :] + 0 * rows[:, None]   # the words' shape and contiguity: their layout
    acc_g = tl.zeros((BLOCK_N, GPB), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, GPB), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        wm, gm = step_masks(k0, offs_w, offs_g, H, V, GROUP, W, GPB, EVEN_K)
        wg = tl.load(g_ptrs, mask=wm, other=0)
        wu = tl.load(u_ptrs, mask=wm, other=0)
        dg = tl.zeros((BLOCK_N, W), dtype=tl.float32)
        du = tl.zeros((BLOCK_N, W), dtype=tl.float32)
        xs = tl.zeros((BLOCK_N, W), dtype=tl.float32)
        for p in tl.static_range(V):
            x = tl.load(x_ptrs + p * words_per_row, mask=wm, other=0.0)
            dg += plane_values(wg, p, code_ptr, BITS, NF) * x
            du += plane_values(wu, p, code_ptr, BITS, NF) * x
            if not NF:
                xs += x * (1 << ((p % P0) * BITS))
        acc_g += per_group(dg, BLOCK_N, W, WPG) * tl.load(gs_ptrs, mask=gm, other=0.0).to(tl.float32)
        acc_u += per_group(du, BLOCK_N, W, WPG) * tl.load(us_ptrs, mask=gm, other=0.0).to(tl.float32)
        if not NF:
            xg = per_group(xs, BLOCK_N, W, WPG)
            acc_g += tl.load(gz_ptrs, mask=gm, other=0.0).to(tl.float32) * xg
            acc_u += tl.load(uz_ptrs, mask=gm, other=0.0).to(tl.float32) * xg
        g_ptrs += W
        u_ptrs += W
        gs_ptrs += GPB
        us_ptrs += GPB
        gz_ptrs += GPB
        uz_ptrs += GPB
        x_ptrs += W
    release_consumer(USE_PDL)
    y = activate(tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1), ACTIVATION, 1.0, 0.0)
    y = y.to(OUT_DTYPE).to(tl.float32)          # the activation in the hidden dtype
    plane = offs_n % V
    if not NF:
        y = y / (1 << ((plane % P0) * BITS)).to(tl.float32)   # a power of two: exact
    tl.store(c_ptr + j * stride_cm + plane * (I // V) + offs_n // V, y, mask=offs_n < I)


@triton.jit
def _qtoken_down_kernel(a_ptr, q_ptr, s_ptr, z_ptr, code_ptr, out_ptr, ids_ptr, map_ptr, w_ptr, take_ptr, cut_ptr,
                        H, I, num_slots, num_host, host_q, host_s, host_z, top_k, stride_id, stride_w, stride_am,
                        stride_qe, stride_qn, stride_se, stride_sn, stride_om,
                        HAS_MAP: tl.constexpr, REDUCE: tl.constexpr, K_PAD: tl.constexpr, BITS: tl.constexpr,
                        GROUP: tl.constexpr, NF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        EVEN_K: tl.constexpr, SPLIT: tl.constexpr, USE_PDL: tl.constexpr):
    """BLOCK_N output columns of every pair at once: rows r = pair · BLOCK_N + column, one load per
    step. The activations arrive plane-ordered and (affine) pre-scaled, so value plane p of a word
    meets a contiguous run of inputs."""
    wait_for_producer(USE_PDL)
    V: tl.constexpr = 32 // BITS
    W: tl.constexpr = BLOCK_K // V
    WPG: tl.constexpr = GROUP // V
    R: tl.constexpr = K_PAD * BLOCK_N
    P0: tl.constexpr = 23 // BITS
    src, _ = pair_sources(ids_ptr, map_ptr, take_ptr, cut_ptr, top_k, stride_id, num_slots, num_host, HAS_MAP, SPLIT,
                      K_PAD)
    offs_j = tl.arange(0, K_PAD)
    valid = src >= 0
    r = tl.arange(0, R)
    pair = r // BLOCK_N
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col = (tl.program_id(0) * BLOCK_N + r % BLOCK_N) % H   # past H: wrap (store masked)
    src_r = tl.sum(tl.where(pair[:, None] == offs_j[None, :], src[None, :], 0), axis=1)
    live = src_r >= 0
    slot_r = tl.where(live, src_r, 0)
    offs_w = tl.arange(0, W)
    q_ptrs = (q_ptr + expert_offset(slot_r, num_slots, host_q, stride_qe)[:, None]
              + col.to(tl.int64)[:, None] * stride_qn + offs_w[None, :])
    GPB: tl.constexpr = BLOCK_K // GROUP
    offs_g = tl.arange(0, GPB)
    s_ptrs = (s_ptr + expert_offset(slot_r, num_slots, host_s, stride_se)[:, None]
              + col.to(tl.int64)[:, None] * stride_sn + offs_g[None, :])
    z_ptrs = (z_ptr + expert_offset(slot_r, num_slots, host_z, stride_se)[:, None]
              + col.to(tl.int64)[:, None] * stride_sn + offs_g[None, :])
    a_ptrs = a_ptr + pair[:, None] * stride_am + offs_w[None, :]
    acc = tl.zeros((R, GPB), dtype=tl.float32)
    words_per_row = I // V
    for k0 in range(0, I, BLOCK_K):
        wm, gm = step_masks(k0, offs_w, offs_g, I, V, GROUP, W, GPB, EVEN_K)
        m = live[:, None] & wm
        mg = live[:, None] & gm
        words = tl.load(q_ptrs, mask=m, other=0)
        d = tl.zeros((R, W), dtype=tl.float32)
        xs = tl.zeros((R, W), dtype=tl.float32)
        for p in tl.static_range(V):
            x = tl.load(a_ptrs + p * words_per_row, mask=m, other=0.0)
            d += plane_values(words, p, code_ptr, BITS, NF) * x
            if not NF:
                xs += x * (1 << ((p % P0) * BITS))
        acc += per_group(d, R, W, WPG) * tl.load(s_ptrs, mask=mg, other=0.0).to(tl.float32)
        if not NF:
            acc += tl.load(z_ptrs, mask=mg, other=0.0).to(tl.float32) * per_group(xs, R, W, WPG)
        q_ptrs += W
        s_ptrs += GPB
        z_ptrs += GPB
        a_ptrs += W
    release_consumer(USE_PDL)
    y = tl.reshape(tl.sum(acc, axis=1), (K_PAD, BLOCK_N))        # (pair, column)
    store_pair_rows(y, w_ptr, stride_w, valid, out_ptr, stride_om, offs_n, H, REDUCE, K_PAD, BLOCK_N)


def _words(t: Tensor) -> Tensor:
    """Packed bytes (..., K·bits/8) as int32 words (the kernels' loads); a view of whole, 4-byte aligned
    words, so `host_offset` between two of them counts whole words."""
    return t.view(torch.int32)


def _tile(tile: TokenTile, K: int, group: int, bits: int) -> TokenTile:
    """BLOCK_K within the problem, whole groups and whole words."""
    block_k = min(tile.block_k, triton.next_power_of_2(K))
    block_k = max(block_k, group, 32 // bits)
    return TokenTile(tile.block_n, block_k, tile.num_warps)


def token_moe_quant(hidden: Tensor, gate_up: QuantOperand, down: QuantOperand, ids: Tensor, weights: Tensor,
                    intermediate: int, slot_map: Tensor | None = None, reduce: bool = True,
                    config: TokenConfig | None = None,
                    host: tuple[tuple[QuantOperand, QuantOperand], Tensor | None] | None = None) -> Tensor:
    """hidden (1, H), quantized slots (gate_up (S, 2I, ·), down (S, H, ·)), ids and weights (1, k) →
    (1, H) in hidden's dtype (`reduce`), or the (1, k, H) fp32 pair rows, zero where unrouted; SwiGLU.
    `slot_map`: ids are expert ids, looked up in the kernels. `host`: ((gate_up, down) operands of
    pinned stacks, which sources S + e read in place; cpu_take or None), as `QuantHostReads`.
    The caller checks `token_path_supported` and the tensors."""
    cfg = config or QUANT_TOKEN_CONFIG
    k = ids.shape[1]
    S, H, I = gate_up.qweight.shape[0], hidden.shape[1], intermediate
    bits, group, nf = gate_up.bits, gate_up.group, gate_up.nf
    gu_q, dn_q = _words(gate_up.qweight), _words(down.qweight)
    num_host, offs, take = 0, ((0, 0, 0), (0, 0, 0)), None
    if host is not None:
        (hgu, hdn), take = host
        num_host = hgu.qweight.shape[0]
        offs = tuple((host_offset(_words(h.qweight), q), host_offset(h.scales, op.scales),
                      host_offset(h.biases, op.biases))
                     for h, op, q in ((hgu, gate_up, gu_q), (hdn, down, dn_q)))
    split = take is not None
    ids1, w1 = ids.reshape(k), weights.reshape(k)
    has_map = slot_map is not None
    smap = slot_map if has_map else ids1
    take = take if split else ids1   # unread placeholder without a split
    cut = take                       # `pair_sources` loads a cut; these kernels never use it (whole experts only)
    planes = torch.empty((H,), dtype=torch.float32, device=hidden.device)    # plane-ordered (planes_kernel)
    planes_kernel[(triton.cdiv(H, 1024),)](hidden, planes, planes, H, BITS=bits, NF=nf, GROUP=group, SUMS=False,
                                            BLOCK=1024, num_warps=4,
                                            **pdl_args(hidden))
    inter = torch.empty((k, I), dtype=torch.float32, device=hidden.device)   # plane-ordered (gate_up kernel)
    gu = _tile(cfg.gate_up, H, group, bits)
    k_pad = triton.next_power_of_2(k)
    _qtoken_gate_up_kernel[(k, triton.cdiv(I, gu.block_n))](
        planes, gu_q, gate_up.scales, gate_up.biases, gate_up.code, inter, ids1, smap, take, cut,
        I, H, S, num_host, *offs[0], k, ids1.stride(0),
        gu_q.stride(0), gu_q.stride(1), gate_up.scales.stride(0), gate_up.scales.stride(1), inter.stride(0),
        HAS_MAP=has_map, ACTIVATION=0, BITS=bits, GROUP=group, NF=nf, BLOCK_N=gu.block_n, BLOCK_K=gu.block_k,
        EVEN_K=H % gu.block_k == 0, SPLIT=split, K_PAD=k_pad, OUT_DTYPE=_TL_DTYPES[hidden.dtype],
        num_warps=gu.num_warps, **pdl_args(hidden))
    if reduce:
        out = torch.empty((1, H), dtype=hidden.dtype, device=hidden.device)
    else:
        out = torch.zeros((k, H), dtype=torch.float32, device=hidden.device)
    dn = _tile(cfg.down, I, group, bits)
    _qtoken_down_kernel[(triton.cdiv(H, dn.block_n),)](
        inter, dn_q, down.scales, down.biases, down.code, out, ids1, smap, w1, take, cut,
        H, I, S, num_host, *offs[1], k, ids1.stride(0), w1.stride(0), inter.stride(0),
        dn_q.stride(0), dn_q.stride(1), down.scales.stride(0), down.scales.stride(1), out.stride(0),
        HAS_MAP=has_map, REDUCE=reduce, K_PAD=k_pad, BITS=bits, GROUP=group, NF=nf,
        BLOCK_N=dn.block_n, BLOCK_K=dn.block_k, EVEN_K=I % dn.block_k == 0, SPLIT=split,
        num_warps=dn.num_warps, enable_fp_fusion=False, **pdl_args(hidden))
    return out if reduce else out.view(1, k, H)
