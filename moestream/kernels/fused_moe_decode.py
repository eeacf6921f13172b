"""Small-batch (decode) path of `fused_moe`: two GEMV-like launches, no alignment step.

For a few (token, position) pairs the grouped GEMM's align step (launches, padding) costs more
than the work, so this path reads the routing directly. One kernel, launched twice:

* gate_up: grid (T*k, cdiv(I, BLOCK_N)); writes `act(gate_up[slot] @ hidden[t])` into a
  (T*k, I) buffer in the hidden dtype.
* down:    grid (T*k, cdiv(H, BLOCK_N)); writes `weights[t, j] * down[slot] @ inter[pair]` in
  fp32 into a (T*k, H) buffer.

The caller then sums the k rows of each token in a fixed reduction order (deterministic, no
atomics). Experts with biases add their slot's bias row in both epilogues (before the activation,
before the routing weight), as the grouped path does.

Program (p, n) belongs to pair p. It loads all T*k slot ids (a few hundred bytes) and does the
work only if p is the *first* pair routed to its slot (the slot's owner); the owner computes the
rows of every pair routed to that slot, BLOCK_M at a time, with a `tl.dot` over the stacked
rows. So each used expert is streamed from memory once even when several tokens share it
(at T=8, k=8, S=128 random routing, ~64 pairs touch only ~50 experts), and a pair never needs
a host-side grouping. Pairs whose slot is -1 or outside [0, S) (with host reads: [0, S + E), slot S + e
being expert e of pinned host stacks, read in place) are skipped by both launches;
their rows of the two buffers stay unwritten and the caller's sum skips them too.

Memory-bound by design: weight tiles are [BLOCK_K, BLOCK_N] with K the contiguous dimension of
the bank (16-byte vector loads, pipelined over `num_stages`), and BLOCK_N is small so that one
token's 8 experts already give hundreds of programs (8 pairs x 48 N-tiles for gate_up at
Qwen3-30B-A3B's I = 768 and BLOCK_N = 16).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from torch import Tensor

from .moe_activation import activate
from .moe_tiles import FP8_NATIVE, FP8_PORTABLE, fit_tile, gated_dot, quant_block_k, quant_gemv
from .pdl import pdl_args, release_consumer, wait_for_producer
from .switch import Switch

__all__ = ["DecodeConfig", "DecodeTile", "DEFAULT_DECODE_CONFIG", "QUANT_DECODE_CONFIG", "HostOperand", "QuantOperand",
           "launch_decode_gemms"]

# Shared memory one program's pipeline may use; small tiles leave room for several programs/SM.
_SMEM_BUDGET_BYTES = 96 * 1024


@dataclass(frozen=True)
class DecodeTile:
    """Tile shape and pipelining of one decode launch."""

    block_n: int      # output columns per program (for gate_up: activated columns)
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class DecodeConfig:
    """Block sizes of the decode path. block_m = pair rows per dot (>= 16; more loop)."""

    gate_up: DecodeTile
    down: DecodeTile
    block_m: int = 16


# First-principles defaults for H100 (not yet measured; `benchmarks/fused_moe_kernel.py --tune-decode`
# sweeps around them). gate_up at T=1: 8 pairs x 48 N-tiles = 384 programs, each streaming
# 2 x 16 rows x H; down: 8 x 64 = 512 programs of 32 rows x I.
DEFAULT_DECODE_CONFIG = DecodeConfig(gate_up=DecodeTile(16, 128, 4, 4),
                                     down=DecodeTile(32, 128, 4, 4))
# Quantized banks: the dequantizing loads are not software-pipelined (they feed bit arithmetic,
# not the dot), so each K step waits for memory; deep K tiles put more bytes in flight per step.
QUANT_DECODE_CONFIG = DecodeConfig(gate_up=DecodeTile(16, 512, 4, 1), down=DecodeTile(32, 256, 4, 1))


@triton.jit(do_not_specialize=["num_pairs", "num_slots", "num_host"])
def _moe_decode_kernel(
    a_ptr, b_ptr, c_ptr, slot_ptr, w_ptr, s_ptr, z_ptr, code_ptr, bias_ptr,
    N, K, num_pairs, num_slots, num_host, host_b, host_s, host_z, top_k,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_st, stride_sj, stride_wt, stride_wj, stride_se, stride_sn, stride_bias_e, alpha, limit,
    A_BY_TOKEN: tl.constexpr,     # A row of a pair = its token (hidden) or the pair (inter)
    GATED: tl.constexpr,          # B holds gate rows [0, N) then up rows [N, 2N); activate
    ACTIVATION: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,     # multiply each row by its routing weight
    HAS_BIAS: tl.constexpr,       # add the slot's bias row (gated: gate bias [0, N), up bias [N, 2N))
    PAIRS: tl.constexpr,          # power of two >= num_pairs
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BITS: tl.constexpr, GROUP: tl.constexpr, NF: tl.constexpr,   # B quantized (BITS > 0): see load_b_tile
    USE_PDL: tl.constexpr = False,   # programmatic dependent launch (pdl.py)
    FP8: tl.constexpr = 0, SCALE_ROWS: tl.constexpr = 1,     # B FP8 e4m3 (BITS = 8): see gated_dot
):
    """C[q, n-tile] = epilogue(A[row(q)] @ B[slot]^T) for every pair q routed to this pair's
    slot, if this pair is the slot's first pair (see the module docstring)."""
    wait_for_producer(USE_PDL)
    release_consumer(USE_PDL)
    pid = tl.program_id(0)
    pid_n = tl.program_id(1)
    # One load of all T*k slot ids (this pair's among them): a single memory round trip
    # before the weights can be requested.
    offs_p = tl.arange(0, PAIRS)
    in_range = offs_p < num_pairs
    slots = tl.load(slot_ptr + (offs_p // top_k) * stride_st + (offs_p % top_k) * stride_sj,
                    mask=in_range, other=-1)
    slot = tl.sum(tl.where(offs_p == pid, slots, 0), axis=0)
    if (slot < 0) | (slot >= num_slots + num_host):
        return
    match = (slots == slot) & in_range
    if tl.min(tl.where(match, offs_p, PAIRS), axis=0) != pid:
        return                                    # an earlier pair owns this slot
    match_i = match.to(tl.int32)
    count = tl.sum(match_i, axis=0)
    rank = tl.where(match, tl.cumsum(match_i, axis=0) - 1, -1)   # position among the matches

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Columns past N wrap around instead of being masked (the store is masked), which keeps
    # the weight loads unmasked along N and wide along K.
    offs_bn = (offs_n % N).to(tl.int64)
    # A slot past the bank's (num_slots + e) is expert e of the host stacks, reached in place at the
    # host_* element offsets from the slot tensors' bases (pinned memory, read over PCIe).
    slot64 = slot.to(tl.int64)
    outside = slot >= num_slots
    b_base = b_ptr + tl.where(outside, host_b + (slot64 - num_slots) * stride_be, slot64 * stride_be)
    s_base = s_ptr + tl.where(outside, host_s + (slot64 - num_slots) * stride_se, slot64 * stride_se)
    z_base = z_ptr + tl.where(outside, host_z + (slot64 - num_slots) * stride_se, slot64 * stride_se)
    bias_row = bias_ptr + slot64 * stride_bias_e   # experts with biases have no host reads

    if BITS > 0:
        if count == 1:   # one token on this expert (decode): the quantized GEMV, no padded dot
            if A_BY_TOKEN:
                a_row = pid // top_k
            else:
                a_row = pid
            acc, acc_up = quant_gemv(a_ptr + a_row.to(tl.int64) * stride_am, b_base, s_base, z_base, code_ptr, offs_bn,
                                     K, N, stride_ak, stride_bn, stride_sn, BLOCK_N, BLOCK_K, GATED, BITS, GROUP, NF,
                                     FP8, SCALE_ROWS, EVEN_K)
            if HAS_BIAS:
                acc += tl.load(bias_row + offs_bn).to(tl.float32)
                if GATED:
                    acc_up += tl.load(bias_row + N + offs_bn).to(tl.float32)
            if GATED:
                acc = activate(acc, acc_up, ACTIVATION, alpha, limit)
            if MUL_WEIGHT:
                acc = acc * tl.load(w_ptr + (pid // top_k) * stride_wt + (pid % top_k) * stride_wj).to(tl.float32)
            tl.store(c_ptr + pid.to(tl.int64) * stride_cm + offs_n * stride_cn, acc.to(c_ptr.dtype.element_ty),
                     mask=offs_n < N)
            return
    for first_row in range(0, count, BLOCK_M):
        rows = first_row + tl.arange(0, BLOCK_M)
        row_mask = rows < count
        # pair of row r = the offs_p whose rank is r (0 for the unused rows, masked)
        pair = tl.sum(tl.where(rank[None, :] == rows[:, None], offs_p[None, :], 0), axis=1)
        pair = pair.to(tl.int64)
        if A_BY_TOKEN:
            a_row = pair // top_k
        else:
            a_row = pair
        acc, acc_up = gated_dot(a_ptr + a_row * stride_am, b_base, s_base, z_base, code_ptr, offs_bn, row_mask, K, N,
                                stride_ak, stride_bk, stride_bn, stride_sn,
                                BLOCK_M, BLOCK_N, BLOCK_K, GATED, EVEN_K, DOT_PRECISION, BITS, GROUP, NF,
                                FP8, SCALE_ROWS)
        if HAS_BIAS:
            acc += tl.load(bias_row + offs_bn).to(tl.float32)[None, :]
            if GATED:
                acc_up += tl.load(bias_row + N + offs_bn).to(tl.float32)[None, :]
        if GATED:
            acc = activate(acc, acc_up, ACTIVATION, alpha, limit)
        if MUL_WEIGHT:
            w = tl.load(w_ptr + (pair // top_k) * stride_wt + (pair % top_k) * stride_wj,
                        mask=row_mask, other=0.0)
            acc = acc * w.to(tl.float32)[:, None]
        c_ptrs = c_ptr + pair[:, None] * stride_cm + offs_n[None, :] * stride_cn
        c_mask = row_mask[:, None] & (offs_n[None, :] < N)
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@dataclass(frozen=True)
class HostOperand:
    """A projection's experts outside the slots, read in place: `num` experts of host stacks laid
    out as the slots, at element offsets `b`, `s`, `z` from the slot tensors' packed bytes (or
    weights), scales and biases (`fused_moe_token.host_offset`)."""

    num: int = 0
    b: int = 0
    s: int = 0
    z: int = 0


@dataclass(frozen=True)
class QuantOperand:
    """A quantized bank tensor as the kernels read it: packed bytes (S, N, K·bits/8), scales and
    biases (S, N, groups; biases may be the scales for NF), the NF codebook (or any tensor).
    FP8 (`fp8`): bytes (S, N, K) of float8_e4m3fn bits and float32 scales (S, grid rows, grid
    columns) over blocks of `scale_rows` rows × `group` columns (biases and code: the scales, unused)."""

    qweight: Tensor
    scales: Tensor
    biases: Tensor
    code: Tensor
    bits: int
    group: int
    nf: bool
    fp8: bool = False
    scale_rows: int = 1


def quant_args(b: Tensor, quant: QuantOperand | None, block_k: int) -> tuple:
    """The kernels' extra arguments: (b, scales, biases, code, stride_se, stride_sn, bits, group,
    nf, block_k); a plain weight passes itself as the unused pointers and BITS = 0. A quantized
    tile is `block_k` deep at least, in whole groups and deep enough for its dots."""
    if quant is None:
        return b, b, b, b, 0, 0, 0, 1, False, block_k
    s = quant.scales
    if quant.fp8:   # a byte a value, scales read per value: any tile deep enough for its dots
        return (quant.qweight, s, s, s, s.stride(0), s.stride(1), 8, quant.group, False, max(block_k, 16))
    if quant.nf:   # codebook lookups go through shared memory: keep NF tiles shallow
        block_k = min(block_k, 128)
    return (quant.qweight, s, quant.biases, quant.code, s.stride(0), s.stride(1), quant.bits, quant.group,
            quant.nf, max(block_k, quant_block_k(quant.bits, quant.group)))


_fp8_hardware = Switch()


def fp8_hardware_conversion(enabled: bool):
    """Switch the hardware e4m3 conversion off (bit arithmetic instead) inside the block: the tests
    that check the portable conversion, and A/B runs."""
    return _fp8_hardware.set(enabled)


def fp8_args(quant: QuantOperand | None) -> dict:
    """The kernels' FP8 switches of an operand (off for plain and integer-quantized ones): the
    hardware conversion where the GPU has one (sm_89 and later; the interpreter too), else bit
    arithmetic."""
    if quant is None or not quant.fp8:
        return {}
    device = quant.qweight.device
    native = _fp8_hardware.on and (device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9))
    return {"FP8": FP8_NATIVE if native else FP8_PORTABLE, "SCALE_ROWS": quant.scale_rows}


def decode_launch(a: Tensor, b: Tensor, c: Tensor, slot_ids: Tensor, weights: Tensor, n: int, k: int,
            num_slots: int, a_by_token: bool, gated: bool, activation_code: int,
            mul_weight: bool, block_m: int, tile: DecodeTile, quant: QuantOperand | None = None,
            bias: Tensor | None = None, alpha: float = 1.0, limit: float = 0.0,
            host: HostOperand | None = None) -> None:
    num_pairs = slot_ids.numel()
    grid = (num_pairs, triton.cdiv(n, tile.block_n))
    b, s, z, code, stride_se, stride_sn, bits, group, nf, block_k = quant_args(b, quant, tile.block_k)
    host = host or HostOperand()
    _moe_decode_kernel[grid](
        a, b, c, slot_ids, weights, s, z, code, bias if bias is not None else b,
        n, k, num_pairs, num_slots, host.num, host.b, host.s, host.z, slot_ids.shape[1],
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        slot_ids.stride(0), slot_ids.stride(1), weights.stride(0), weights.stride(1), stride_se, stride_sn,
        bias.stride(0) if bias is not None else 0, float(alpha), float(limit),
        A_BY_TOKEN=a_by_token, GATED=gated, ACTIVATION=activation_code, MUL_WEIGHT=mul_weight,
        HAS_BIAS=bias is not None,
        PAIRS=max(16, triton.next_power_of_2(num_pairs)),
        BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=block_k,
        EVEN_K=k % block_k == 0,   # quantized: the tile's weight bytes (and 4-bit A columns) load unmasked
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BITS=bits, GROUP=group, NF=nf,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **pdl_args(a), **fp8_args(quant),
    )


def launch_decode_gemms(hidden: Tensor, gate_up: Tensor, down: Tensor, slot_ids: Tensor,
                        weights: Tensor, inter: Tensor, per_pair: Tensor, activation_code: int,
                        config: DecodeConfig | None = None, quant: tuple[QuantOperand, QuantOperand] | None = None,
                        intermediate: int | None = None, biases: tuple[Tensor, Tensor] | None = None,
                        alpha: float = 1.0, limit: float = 0.0,
                        host: tuple[HostOperand, HostOperand] | None = None) -> None:
    """The two decode launches: gate_up+activation into `inter` (T*k, I), hidden dtype; then
    down times routing weight into `per_pair` (T*k, H), fp32. Rows of unrouted pairs are left
    unwritten. Inputs are validated by the caller. With `quant` (gate_up, down operands), the
    bank is quantized and gate_up / down are ignored for their contents. With `host` (gate_up,
    down), slot ids past the bank's read experts of host stacks in place."""
    cfg = config if config is not None else (DEFAULT_DECODE_CONFIG if quant is None else QUANT_DECODE_CONFIG)
    S = gate_up.shape[0] if quant is None else quant[0].qweight.shape[0]
    H = hidden.shape[1]
    I = intermediate if intermediate is not None else gate_up.shape[1] // 2
    elt = hidden.element_size()
    if quant is None:
        gate_up_tile = fit_tile(cfg.gate_up, cfg.block_m, I, H, elt, True, _SMEM_BUDGET_BYTES)
        down_tile = fit_tile(cfg.down, cfg.block_m, H, I, elt, False, _SMEM_BUDGET_BYTES)
    else:   # no shared-memory pipeline to fit; only keep the tiles within the problem
        gate_up_tile = replace(cfg.gate_up, block_k=min(cfg.gate_up.block_k, triton.next_power_of_2(H)))
        down_tile = replace(cfg.down, block_k=min(cfg.down.block_k, triton.next_power_of_2(I)))
    decode_launch(hidden, gate_up, inter, slot_ids, weights, n=I, k=H, num_slots=S, a_by_token=True,
            gated=True, activation_code=activation_code, mul_weight=False,
            block_m=cfg.block_m, tile=gate_up_tile, quant=quant[0] if quant else None,
            bias=biases[0] if biases else None, alpha=alpha, limit=limit, host=host[0] if host else None)
    decode_launch(inter, down, per_pair, slot_ids, weights, n=H, k=I, num_slots=S, a_by_token=False,
            gated=False, activation_code=0, mul_weight=True, block_m=cfg.block_m,
            tile=down_tile, quant=quant[1] if quant else None, bias=biases[1] if biases else None,
            host=host[1] if host else None)
