"""Fused MoE dispatch over bank slots in Triton: the CUDA hot path of `moe_reference`.

Two paths with one contract, picked from host-known shapes (`DECODE_MAX_PAIRS`):

**One token** (T = 1, a dense bank: `fused_moe_token.py`): two GEMV launches, the sum over k inside
the second, the slot map read in the kernels. Batch-1 decode, the hot path of a single stream.

**Decode** (T*k <= DECODE_MAX_PAIRS, `fused_moe_decode.py`): no alignment at all. Two launches
over a (pair, N-tile) grid read the routing directly; the first pair routed to a slot computes
every pair of that slot, so each used expert is streamed once. Then one launch sums the k rows
of each token. 3 launches in all, memory-bound GEMV shapes.

**Grouped** (vLLM's fused_moe shape, written afresh here for a bank of slots):

1. **Align** (`moe_align.py`, one Triton launch, no host sync): the T*k (token, position) pairs
   are grouped by slot and each slot's group is padded to a multiple of BLOCK_M, so every
   M-block of the grouped GEMM belongs to exactly one slot. Pairs whose slot is -1 (not
   resident) go to a trailing "unrouted" group whose blocks are tagged slot -1. The padded
   length has a host-side upper bound, T*k + min(S+1, T*k) * (BLOCK_M-1), so the grid size is
   known without reading anything back from the device.
2. **gate_up GEMM + activation**, one launch: each program loads the gate tile and the matching
   up tile of its slot, keeps two fp32 accumulators and writes `silu(gate) * up` (T*k, I) in
   the hidden dtype. Fusing the activation halves the intermediate traffic and saves a launch.
3. **down GEMM**, one launch, routing weight multiplied in the epilogue, written in fp32 to a
   (T*k, H) buffer.

Experts with biases (GPT-OSS) add their slot's bias rows to the fp32 accumulators in the same
epilogues (gate_up's before the activation, down's before the routing weight), and the clamped
SwiGLU is one more activation code (`moe_activation.py`); both paths share those epilogues.

Both paths end with the same launch (`_sum_over_k_kernel`): out[t] = sum over j of the fp32 rows
of the routed pairs, in a fixed reduction order (deterministic, no atomics), cast to the hidden
dtype. Rows of unrouted pairs (slot -1 or outside [0, S)) are never written and never read.

Block sizes of the grouped path come from a small table keyed by the expected rows per used
slot (`select_config`). It was chosen from first principles and vLLM-style H100 settings, not
measured here; `benchmarks/fused_moe_kernel.py --tune` searches around it on the GPU (and
`--tune-decode` around the decode path's `DEFAULT_DECODE_CONFIG`).

This module imports Triton at the top; the package `moestream.kernels` loads it lazily.
It also runs under `TRITON_INTERPRET=1` on CPU tensors (that is how CI checks the kernel logic).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from torch import Tensor

from .fused_moe_decode import (
    DEFAULT_DECODE_CONFIG,
    DecodeConfig,
    DecodeTile,
    HostOperand,
    QuantOperand,
    fp8_args,
    launch_decode_gemms,
    quant_args,
)
from .fused_moe_token import TokenConfig, host_offset, token_moe
from .pdl import pdl_args, release_consumer, wait_for_producer
from .moe_activation import ACTIVATION_CODES as _ACTIVATION_CODES
from .moe_activation import activate
from .moe_align import moe_align_block_size, moe_align_block_size_torch
from .moe_reference import Activation, HostReads, check_expert_biases, check_moe_inputs, get_activation
from .moe_tiles import fit_tile, gated_dot

__all__ = [
    "fused_moe",
    "fused_moe_with_config",
    "moe_align_block_size",
    "moe_align_block_size_torch",
    "select_config",
    "GemmConfig",
    "MoeConfig",
    "DecodeConfig",
    "DecodeTile",
    "DEFAULT_DECODE_CONFIG",
    "DECODE_MAX_PAIRS",
]

# `fused_moe` takes the decode path when T*k is at most this (8 tokens at k=8). A first guess:
# `benchmarks/fused_moe_kernel.py` times both paths per T so the crossover can be read off.
DECODE_MAX_PAIRS = 64
# The decode path keeps all T*k slot ids of a program in registers; forcing it past this many
# pairs is refused (the grouped path is the right one there anyway).
_DECODE_FORCED_MAX_PAIRS = 1024
_PATHS = ("auto", "token", "decode", "grouped")

# Shared memory we let one program's pipeline use (H100 allows 227 KiB per block).
_SMEM_BUDGET_BYTES = 192 * 1024


@dataclass(frozen=True)
class GemmConfig:
    """Tile shape and pipelining of one grouped GEMM launch."""

    block_n: int      # output columns per program (for gate_up: activated columns, 2x weight rows)
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 1  # M-blocks that walk the N-tiles together, for L2 reuse of weight tiles


@dataclass(frozen=True)
class MoeConfig:
    """BLOCK_M (shared by the alignment and both GEMMs) and the per-GEMM tiles."""

    block_m: int
    gate_up: GemmConfig
    down: GemmConfig


# (max expected rows per used slot, config). Rows per used slot r = T*k / min(S, T*k): 1 for
# decode, ~T/16 for Qwen3-30B-A3B prefill. While r is small the GEMM is memory-bound on the
# expert weights, so BLOCK_M is chosen to cover a slot's rows in one block (weights read once)
# and BLOCK_N small enough to give every SM work; at large r it becomes a compute tile.
_CONFIG_TABLE: tuple[tuple[float, MoeConfig], ...] = (
    (4, MoeConfig(16, GemmConfig(32, 128, 4, 4), GemmConfig(64, 128, 4, 4))),
    (12, MoeConfig(16, GemmConfig(64, 128, 4, 3), GemmConfig(128, 128, 4, 3))),
    (24, MoeConfig(32, GemmConfig(64, 128, 4, 3), GemmConfig(128, 64, 4, 4, group_m=8))),
    (48, MoeConfig(64, GemmConfig(64, 64, 4, 4, group_m=8), GemmConfig(128, 64, 4, 4, group_m=8))),
    (float("inf"), MoeConfig(128, GemmConfig(128, 64, 8, 4, group_m=8),
                             GemmConfig(256, 64, 8, 4, group_m=8))),
)


def select_config(num_tokens: int, top_k: int, num_slots: int, quantized: bool = False) -> MoeConfig:
    """Pick block sizes from host-side shapes only (no sync): see `_CONFIG_TABLE`, and
    `_QUANT_CONFIG_TABLE` for quantized experts."""
    pairs = max(num_tokens * top_k, 1)
    rows_per_slot = pairs / max(min(num_slots, pairs), 1)
    table = _QUANT_CONFIG_TABLE if quantized else _CONFIG_TABLE
    for limit, config in table:
        if rows_per_slot <= limit:
            return config
    return table[-1][1]


def _register_tiles(config: MoeConfig) -> MoeConfig:
    """A quantized operand's dequantized tiles live in registers: BLOCK_N at most 64, two stages."""
    return replace(config, gate_up=replace(config.gate_up, block_n=min(config.gate_up.block_n, 64), num_stages=2),
                   down=replace(config.down, block_n=min(config.down.block_n, 64), num_stages=2))


# The same rows-per-slot steps for quantized experts. Rows 12, 24 and 48 (a 128-, 256- and 512-token
# chunk over 128 experts) were swept on an H100 for int4-g64 (`benchmarks/fused_moe_kernel.py --format
# int4 --tune --tokens 128 256 512`): 545, 781 and 964 us against 690, 1,257 and 2,378 for the register
# tiles they replaced (BENCHMARKS.md); the other rows keep the bf16 row's tiles narrowed to registers.
_QUANT_TUNED: dict[float, MoeConfig] = {
    12: MoeConfig(16, GemmConfig(64, 256, 4, 3, group_m=1), GemmConfig(128, 256, 4, 3, group_m=1)),
    24: MoeConfig(16, GemmConfig(64, 256, 4, 2, group_m=1), GemmConfig(128, 256, 4, 3, group_m=1)),
    48: MoeConfig(64, GemmConfig(64, 128, 4, 3, group_m=8), GemmConfig(64, 128, 4, 3, group_m=8)),
}
_QUANT_CONFIG_TABLE: tuple[tuple[float, MoeConfig], ...] = tuple(
    (limit, _QUANT_TUNED.get(limit) or _register_tiles(config)) for limit, config in _CONFIG_TABLE)


def prompt_tile_rows(top_k: int, layer_experts: int, max_tokens: int) -> list[int]:
    """The least token count of each tile row (each config of `_CONFIG_TABLE` or `_QUANT_CONFIG_TABLE`) a
    grouped call of up to `max_tokens` tokens over a layer of `layer_experts` experts can take: one call of
    each compiles every variant the grouped path will use (rules of the hot path, 9), so a server can
    compile them at start rather than stall its first step of each size."""
    counts, seen = [], set()
    for tokens in range(DECODE_MAX_PAIRS // top_k + 1, max_tokens + 1):
        configs = (select_config(tokens, top_k, layer_experts), select_config(tokens, top_k, layer_experts, True))
        if any(c not in seen for c in configs):
            seen.update(configs)
            counts.append(tokens)
    return counts

# Sizes that change with every call (pairs, blocks, a staged group's slot range) are not specialized: Triton would
# compile a variant for each new pattern of them (divisible by 16, equal to 1), a stall of seconds the first time a
# served step of a new token count meets one. ARCHITECTURE.md, rules of the hot path, 9.
@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks", "slot_lo", "slot_hi"])
def _moe_grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, w_ptr, pair_ids_ptr, block_slot_ptr, s_ptr, z_ptr, code_ptr, bias_ptr,
    N, K, num_pairs, num_m_blocks,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn, stride_se, stride_sn,
    stride_bias_e, alpha, limit, slot_lo, slot_hi,
    A_ROW_DIV: tl.constexpr,      # A row of a pair = pair // A_ROW_DIV (top_k for hidden, 1 after)
    GATED: tl.constexpr,          # B holds gate rows [0, N) then up rows [N, 2N); apply activation
    ACTIVATION: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,     # multiply each row by its routing weight w[pair]
    HAS_BIAS: tl.constexpr,       # add the slot's bias row (gated: gate bias [0, N), up bias [N, 2N))
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BITS: tl.constexpr, GROUP: tl.constexpr, NF: tl.constexpr,   # B quantized (BITS > 0): see load_b_tile
    FP8: tl.constexpr = 0, SCALE_ROWS: tl.constexpr = 1,     # B FP8 e4m3 (BITS = 8): see gated_dot
):
    """C[pair, :] = epilogue(A[pair // A_ROW_DIV, :] @ B[slot]^T) for one (M-block, N-tile).

    Every M-block belongs to one slot (see moe_align_block_size); B is a (S, N or 2N, K) bank
    tensor with K contiguous, read as [BLOCK_K, BLOCK_N] tiles of that slot. Only the M-blocks of
    slots [slot_lo, slot_hi) run, B holding those slots from its first (a group of a layer's slots).
    """
    pid = tl.program_id(0)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    # Grouped ordering: GROUP_M consecutive M-blocks (usually the same slot) sweep the N-tiles
    # together, so a weight tile fetched for one is found in L2 by the others.
    pids_per_group = GROUP_M * num_n_tiles
    first_m = (pid // pids_per_group) * GROUP_M
    group_size = min(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % pids_per_group) % group_size
    pid_n = (pid % pids_per_group) // group_size

    slot = tl.load(block_slot_ptr + pid_m)
    if (slot < slot_lo) | (slot >= slot_hi):   # unrouted pairs, unused tail blocks, another group's slots
        return
    slot -= slot_lo
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_ids_ptr + offs_m)
    row_mask = pair < num_pairs
    pair = pair.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + pair[:, None] * stride_cm + offs_n[None, :] * stride_cn
    c_mask = row_mask[:, None] & (offs_n[None, :] < N)

    # Columns past N wrap around instead of being masked: loads stay unmasked along N (the
    # store is masked), which keeps the weight loads wide.
    offs_bn = (offs_n % N).to(tl.int64)
    slot = slot.to(tl.int64)
    acc, acc_up = gated_dot(a_ptr + (pair // A_ROW_DIV) * stride_am, b_ptr + slot * stride_be,
                            s_ptr + slot * stride_se, z_ptr + slot * stride_se, code_ptr, offs_bn, row_mask, K, N,
                            stride_ak, stride_bk, stride_bn, stride_sn,
                            BLOCK_M, BLOCK_N, BLOCK_K, GATED, EVEN_K, DOT_PRECISION, BITS, GROUP, NF,
                            FP8, SCALE_ROWS)
    if HAS_BIAS:
        bias_row = bias_ptr + slot * stride_bias_e
        acc += tl.load(bias_row + offs_bn).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_row + N + offs_bn).to(tl.float32)[None, :]
    if GATED:
        acc = activate(acc, acc_up, ACTIVATION, alpha, limit)
    if MUL_WEIGHT:
        w = tl.load(w_ptr + pair, mask=row_mask, other=0.0)
        acc = acc * w.to(tl.float32)[:, None]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def _launch_grouped_gemm(a: Tensor, b: Tensor, c: Tensor, w: Tensor, pair_ids: Tensor,
                         block_slot: Tensor, n: int, k: int, num_pairs: int, a_row_div: int,
                         gated: bool, activation_code: int, mul_weight: bool,
                         block_m: int, cfg: GemmConfig, quant: QuantOperand | None = None,
                         bias: Tensor | None = None, alpha: float = 1.0, limit: float = 0.0,
                         slot_range: tuple[int, int] | None = None) -> None:
    """One launch of `_moe_grouped_gemm_kernel` over all M-blocks and N-tiles; `bias` (S, N or 2N)
    per-slot bias rows, or None. `slot_range` (lo, hi): only the blocks of those slots, which `b`
    holds from its first (default: every slot of `b`)."""
    lo, hi = slot_range if slot_range is not None else (0, b.shape[0] if quant is None else quant.qweight.shape[0])
    num_m_blocks = block_slot.numel()
    grid = (num_m_blocks * triton.cdiv(n, cfg.block_n),)
    b, s, z, code, stride_se, stride_sn, bits, group, nf, block_k = quant_args(b, quant, cfg.block_k)
    _moe_grouped_gemm_kernel[grid](
        a, b, c, w, pair_ids, block_slot, s, z, code, bias if bias is not None else b,
        n, k, num_pairs, num_m_blocks,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        stride_se, stride_sn, bias.stride(0) if bias is not None else 0, float(alpha), float(limit), lo, hi,
        A_ROW_DIV=a_row_div, GATED=gated, ACTIVATION=activation_code, MUL_WEIGHT=mul_weight,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, GROUP_M=cfg.group_m,
        EVEN_K=k % block_k == 0,   # quantized: the tile's weight bytes (and 4-bit A columns) load unmasked
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BITS=bits, GROUP=group, NF=nf,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **fp8_args(quant),
    )


@triton.jit(do_not_specialize=["num_slots"])
def _sum_over_k_kernel(
    src_ptr, slot_ptr, out_ptr, N, num_slots, top_k,
    stride_sm, stride_st, stride_sj, stride_om,
    K_PAD: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    """out[t, n-tile] = sum over routed j of src[t*k + j, n-tile] (fp32), cast to out dtype.

    The k rows are added in pair order from 0 (the loop is unrolled, so every load is in flight
    at once): deterministic, and the order the one-token path (fused_moe_token.py) sums in, so
    pair rows summed here give its bits. Rows of unrouted pairs are masked, never read.
    """
    wait_for_producer(USE_PDL)
    release_consumer(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(K_PAD):
        slot = tl.load(slot_ptr + t * stride_st + j * stride_sj, mask=j < top_k, other=-1)
        routed = (slot >= 0) & (slot < num_slots)
        acc += tl.load(src_ptr + (t * top_k + j) * stride_sm + offs_n, mask=routed & (offs_n < N), other=0.0)
    tl.store(out_ptr + t * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=offs_n < N)


def _launch_sum_over_k(per_pair: Tensor, slot_ids: Tensor, out: Tensor, num_slots: int) -> None:
    T, k = slot_ids.shape
    H = out.shape[1]
    k_pad = triton.next_power_of_2(k)
    block_n = min(max(16, 2048 // k_pad), max(16, triton.next_power_of_2(H)))
    _sum_over_k_kernel[(T, triton.cdiv(H, block_n))](
        per_pair, slot_ids, out, H, num_slots, k,
        per_pair.stride(0), slot_ids.stride(0), slot_ids.stride(1), out.stride(0),
        K_PAD=k_pad, BLOCK_N=block_n, num_warps=4, **pdl_args(per_pair),
    )


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def choose_path(num_tokens: int, top_k: int, one_token: bool = True) -> str:
    """The path `fused_moe` takes: token for one token (`one_token`: a dense bank), decode when
    T*k <= DECODE_MAX_PAIRS, else grouped."""
    if one_token and num_tokens == 1:
        return "token"
    return "decode" if num_tokens * top_k <= DECODE_MAX_PAIRS else "grouped"


def fused_moe_with_config(hidden: Tensor, gate_up: Tensor, down: Tensor, slot_ids: Tensor,
                          weights: Tensor, activation: str | Activation = "swiglu",
                          config: MoeConfig | DecodeConfig | TokenConfig | None = None,
                          path: str = "auto", gate_up_bias: Tensor | None = None,
                          down_bias: Tensor | None = None, reduce: bool = True,
                          slot_map: Tensor | None = None, host: HostReads | None = None,
                          layer_experts: int | None = None) -> Tensor:
    """`fused_moe` with an explicit path and block sizes; for tuning, benchmarks and tests.
    `layer_experts`: see `run_paths`.

    Args:
        path: "auto" (`choose_path`, or the path `config`'s type names), "token" (T = 1 only),
            "decode" or "grouped".
        config: a `TokenConfig` (token path), a `DecodeConfig` (decode path) or a `MoeConfig`
            (grouped path); None = defaults (`DEFAULT_TOKEN_CONFIG`, `DEFAULT_DECODE_CONFIG`,
            `select_config`).
    """
    T, H, S, I, k = check_moe_inputs(hidden, gate_up, down, slot_ids, weights)
    check_expert_biases(gate_up_bias, down_bias, S, H, I, gate_up.dtype)
    get_activation(activation)                   # same errors as the reference
    act = Activation.of(activation)
    if act.name not in _ACTIVATION_CODES:
        raise NotImplementedError(f"fused_moe has no Triton epilogue for activation {act.name!r}")
    if not hidden.is_cuda and not _interpreting():
        raise ValueError(
            "fused_moe needs CUDA tensors (or TRITON_INTERPRET=1 for CPU debugging); "
            "use moe_reference on the CPU"
        )
    for name, t in (("gate_up", gate_up), ("down", down), ("slot_ids", slot_ids),
                    ("weights", weights), ("gate_up_bias", gate_up_bias), ("down_bias", down_bias)):
        if t is not None and t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device} but hidden is on {hidden.device}")
    path = resolve_path(host_path(path, config, T, k) if host is not None else path, config, T, k)
    biases = None if gate_up_bias is None else (gate_up_bias, down_bias)
    if slot_map is not None and slot_map.device != hidden.device:
        raise ValueError(f"slot_map is on {slot_map.device} but hidden is on {hidden.device}")
    if host is not None and (path == "grouped" or biases is not None):
        raise ValueError("experts read from a host stack take the one-token or decode path, without biases; "
                         f"this call takes the {path} path{' with biases' if biases is not None else ''}")
    if host is not None and path == "decode" and host.cpu_take is not None:
        raise ValueError("a split by cpu_take is a one-token call's; a larger call's map splits its pairs")
    if path == "token":
        return token_moe(hidden, gate_up, down, slot_ids, weights, _ACTIVATION_CODES[act.name], I,
                         slot_map=slot_map, biases=biases, alpha=act.alpha, limit=act.limit, reduce=reduce,
                         config=config, host=host)
    if slot_map is not None:
        slot_ids = slot_map[slot_ids.long()]
    operands = None
    if host is not None:   # slot ids S + e: expert e of the pinned stacks, read in place
        E = host.gate_up.shape[0]
        operands = (HostOperand(E, host_offset(host.gate_up, gate_up)), HostOperand(E, host_offset(host.down, down)))
    return run_paths(hidden, gate_up, down, slot_ids, weights, _ACTIVATION_CODES[act.name], config, path, S, I,
                     biases=biases, alpha=act.alpha, limit=act.limit, reduce=reduce, host=operands,
                     layer_experts=layer_experts)


def host_path(path: str, config, num_tokens: int, top_k: int) -> str:
    """The path of a call that reads experts from host stacks in place: the one-token path for one token,
    else the decode path (its owner programs read each expert once for all its tokens), at any pair
    count it handles, where the caller named none."""
    if path != "auto" or config is not None or num_tokens == 1:
        return path
    if num_tokens * top_k > _DECODE_FORCED_MAX_PAIRS:
        raise ValueError(f"experts read from host stacks take at most {_DECODE_FORCED_MAX_PAIRS} (token, expert) "
                         f"pairs a call, got {num_tokens * top_k}")
    return "decode"


def resolve_path(path: str, config, num_tokens: int, top_k: int, one_token: bool = True) -> str:
    """The path a call takes: given, implied by the config's type, or `choose_path`. `one_token`:
    whether the one-token path exists for the bank (dense experts, and quantized formats with a
    one-token kernel)."""
    if path not in _PATHS:
        raise ValueError(f"path must be one of {_PATHS}, got {path!r}")
    configs = {"token": TokenConfig, "decode": DecodeConfig, "grouped": MoeConfig}
    if path == "auto":
        implied = [name for name, kind in configs.items() if isinstance(config, kind)]
        path = implied[0] if implied else choose_path(num_tokens, top_k, one_token)
    if path == "token" and (num_tokens != 1 or not one_token):
        raise ValueError(f"the token path takes one token of a dense bank, got {num_tokens} tokens"
                         + ("" if one_token else " of quantized experts whose format has one"))
    wanted = configs[path]
    if config is not None and not isinstance(config, wanted):
        raise TypeError(f"the {path} path takes a {wanted.__name__}, got {type(config).__name__}")
    return path


def run_paths(hidden: Tensor, gate_up: Tensor, down: Tensor, slot_ids: Tensor, weights: Tensor,
              activation_code: int, config, path: str, num_slots: int, intermediate: int,
              quant: tuple[QuantOperand, QuantOperand] | None = None,
              biases: tuple[Tensor, Tensor] | None = None, alpha: float = 1.0, limit: float = 0.0,
              reduce: bool = True, host: tuple[HostOperand, HostOperand] | None = None,
              layer_experts: int | None = None) -> Tensor:
    """Allocate, run the decode or grouped GEMMs (plain or quantized bank), sum over k. `biases`:
    per-slot (gate_up_bias (S, 2I), down_bias (S, H)) rows added in the epilogues, or None;
    `alpha` / `limit`: the activation's parameters (read by the clamped SwiGLU only). `reduce`
    False: the (T, k, H) fp32 rows of every pair instead (zero where unrouted), for `sum_pairs`.
    `host`: the decode path reads slot ids S + e from host stacks in place (`HostOperand`).
    `layer_experts`: the slots are some of a layer of that many experts (a bank's, or its staging
    buffer's): the grouped tiles are sized for that layer's rows per expert, T·k / layer_experts,
    the tiles a call over the whole layer takes (so each pair's bits are the same in either), not
    for T·k over these slots, most of whose pairs are routed elsewhere."""
    if host is not None and path != "decode":
        raise ValueError(f"experts read from host stacks take the decode path, not the {path} path")
    T, k = slot_ids.shape
    H = hidden.shape[1]
    num_pairs = T * k
    if num_pairs == 0:
        return torch.zeros_like(hidden) if reduce else hidden.new_zeros((T, k, H), dtype=torch.float32)
    if path == "decode" and num_pairs > _DECODE_FORCED_MAX_PAIRS:
        raise ValueError(f"the decode path handles at most {_DECODE_FORCED_MAX_PAIRS} "
                         f"(token, expert) pairs, got T*k = {num_pairs}; use the grouped path")
    out = torch.empty((T, H), dtype=hidden.dtype, device=hidden.device)
    # unrouted pairs' rows are never written: zeros when they are handed out unsummed
    per_pair = (torch.empty if reduce else torch.zeros)((num_pairs, H), dtype=torch.float32, device=hidden.device)
    activated = torch.empty((num_pairs, intermediate), dtype=hidden.dtype, device=hidden.device)

    with torch.cuda.device(hidden.device) if hidden.is_cuda else contextlib.nullcontext():
        if path == "decode":
            launch_decode_gemms(hidden, gate_up, down, slot_ids, weights, activated, per_pair,
                                activation_code, config, quant=quant, intermediate=intermediate,
                                biases=biases, alpha=alpha, limit=limit, host=host)
        else:
            _grouped_gemms(hidden, gate_up, down, slot_ids, weights, activated, per_pair,
                           activation_code, config, quant=quant, intermediate=intermediate,
                           biases=biases, alpha=alpha, limit=limit, layer_experts=layer_experts)
        if not reduce:
            return per_pair.view(T, k, H)
        _launch_sum_over_k(per_pair, slot_ids, out, num_slots + (host[0].num if host else 0))
    return out


def sum_pairs(per_pair: Tensor, dtype: torch.dtype) -> Tensor:
    """(T, H) in `dtype` from (T, k, H) fp32 pair rows, by the very launch that ends `fused_moe`: pair
    rows gathered from several calls (each pair computed by one of them, zero in the others) sum to
    the same bits as one call over all of them."""
    T, k, H = per_pair.shape
    out = torch.empty((T, H), dtype=dtype, device=per_pair.device)
    if T:
        with torch.cuda.device(per_pair.device) if per_pair.is_cuda else contextlib.nullcontext():
            _launch_sum_over_k(per_pair.reshape(T * k, H), per_pair.new_zeros((T, k), dtype=torch.int32), out, 1)
    return out


def _grouped_gemms(hidden: Tensor, gate_up: Tensor, down: Tensor, slot_ids: Tensor,
                   weights: Tensor, activated: Tensor, per_pair: Tensor, activation_code: int,
                   config: MoeConfig | None, quant: tuple[QuantOperand, QuantOperand] | None = None,
                   intermediate: int | None = None, biases: tuple[Tensor, Tensor] | None = None,
                   alpha: float = 1.0, limit: float = 0.0, layer_experts: int | None = None) -> None:
    """Align + the two grouped GEMM launches; rows of unrouted pairs are left unwritten."""
    T, k = slot_ids.shape
    S = gate_up.shape[0] if quant is None else quant[0].qweight.shape[0]
    H = hidden.shape[1]
    I = intermediate if intermediate is not None else gate_up.shape[1] // 2
    tiles = _grouped_tiles(T, k, S, H, I, hidden.element_size(), config, quant is not None, layer_experts)
    pair_ids, block_slot = moe_align_block_size(slot_ids, S, tiles[0].block_m)
    _pair_launches(hidden, gate_up, down, activated, per_pair, weights.reshape(-1), pair_ids, block_slot, tiles,
                   H, I, k, activation_code, quant, biases, alpha, limit)


def _pair_launches(hidden: Tensor, gate_up: Tensor, down: Tensor, activated: Tensor, per_pair: Tensor,
                   flat_weights: Tensor, pair_ids: Tensor, block_slot: Tensor,
                   tiles: tuple[MoeConfig, GemmConfig, GemmConfig], H: int, I: int, k: int, activation_code: int = 0,
                   quant: tuple[QuantOperand, QuantOperand] | None = None, biases: tuple[Tensor, Tensor] | None = None,
                   alpha: float = 1.0, limit: float = 0.0, slot_range: tuple[int, int] | None = None) -> None:
    """The grouped path's two launches over aligned pairs: gate_up with the activation into
    `activated`, then down times each pair's routing weight into `per_pair` (`slot_range`: only
    those slots' blocks)."""
    cfg, gate_up_cfg, down_cfg = tiles
    num_pairs = per_pair.shape[0]
    _launch_grouped_gemm(hidden, gate_up, activated, flat_weights, pair_ids, block_slot,
                         n=I, k=H, num_pairs=num_pairs, a_row_div=k, gated=True,
                         activation_code=activation_code, mul_weight=False,
                         block_m=cfg.block_m, cfg=gate_up_cfg, quant=quant[0] if quant else None,
                         bias=biases[0] if biases else None, alpha=alpha, limit=limit, slot_range=slot_range)
    _launch_grouped_gemm(activated, down, per_pair, flat_weights, pair_ids, block_slot,
                         n=H, k=I, num_pairs=num_pairs, a_row_div=1, gated=False,
                         activation_code=0, mul_weight=True,
                         block_m=cfg.block_m, cfg=down_cfg, quant=quant[1] if quant else None,
                         bias=biases[1] if biases else None, slot_range=slot_range)


def _grouped_tiles(T: int, k: int, S: int, H: int, I: int, elt: int, config: MoeConfig | None, quantized: bool,
                   layer_experts: int | None) -> tuple[MoeConfig, GemmConfig, GemmConfig]:
    """The grouped path's config and its two launches' tiles (fitted to shared memory)."""
    cfg = config if config is not None else select_config(T, k, layer_experts or S, quantized=quantized)
    return (cfg, fit_tile(cfg.gate_up, cfg.block_m, I, H, elt, True, _SMEM_BUDGET_BYTES),
            fit_tile(cfg.down, cfg.block_m, H, I, elt, False, _SMEM_BUDGET_BYTES))


def grouped_by_slot_groups(hidden: Tensor, slot_ids: Tensor, weights: Tensor, num_slots: int, intermediate: int,
                           group: int, load_group: Callable[[int, int], tuple[Tensor, Tensor]],
                           config: MoeConfig | None = None, layer_experts: int | None = None,
                           reduce: bool = True) -> Tensor:
    """The plain grouped path (SwiGLU, no biases) over `num_slots` slots whose weights exist `group`
    slots at a time: `load_group(start, count)` gives the (count, 2I, H) gate_up and (count, H, I) down
    of slots [start, start + count) (the quantized long calls dequantize them into one scratch). The
    routing is aligned once and each group's two launches run only its slots' M-blocks, so every
    pair's row, and their sum, are the bits of one call over all the slots. `reduce` False: the
    (T, k, H) fp32 pair rows instead (zero where unrouted), as `run_paths` gives them."""
    T, k = slot_ids.shape
    H = hidden.shape[1]
    num_pairs = T * k
    if num_pairs == 0:
        return torch.zeros_like(hidden) if reduce else hidden.new_zeros((T, k, H), dtype=torch.float32)
    out = torch.empty((T, H), dtype=hidden.dtype, device=hidden.device)
    per_pair = (torch.empty if reduce else torch.zeros)((num_pairs, H), dtype=torch.float32, device=hidden.device)
    activated = torch.empty((num_pairs, intermediate), dtype=hidden.dtype, device=hidden.device)
    tiles = _grouped_tiles(T, k, num_slots, H, intermediate, hidden.element_size(), config, False, layer_experts)
    flat_weights = weights.reshape(-1)
    with torch.cuda.device(hidden.device) if hidden.is_cuda else contextlib.nullcontext():
        pair_ids, block_slot = moe_align_block_size(slot_ids, num_slots, tiles[0].block_m)
        for start in range(0, num_slots, group):
            count = min(group, num_slots - start)
            gate_up, down = load_group(start, count)
            _pair_launches(hidden, gate_up, down, activated, per_pair, flat_weights, pair_ids, block_slot, tiles,
                           H, intermediate, k, slot_range=(start, start + count))
        if not reduce:
            return per_pair.view(T, k, H)
        _launch_sum_over_k(per_pair, slot_ids, out, num_slots)
    return out


def fused_moe(hidden: Tensor, gate_up: Tensor, down: Tensor, slot_ids: Tensor, weights: Tensor,
              activation: str | Activation = "swiglu", gate_up_bias: Tensor | None = None,
              down_bias: Tensor | None = None, slot_map: Tensor | None = None,
              host: HostReads | None = None) -> Tensor:
    """Routed-expert FFN over bank slots in Triton; contract of `moe_reference`.

    One token takes the one-token path (2 launches), T*k <= DECODE_MAX_PAIRS the decode path
    (3 launches), larger batches the grouped path (4 launches); see the module docstring.

    Args:
        hidden: (T, H) bf16/fp16/fp32 CUDA tensor.
        gate_up: (S, 2*I, H) bank slots, gate rows first then up rows, same dtype.
        down: (S, H, I) bank slots.
        slot_ids: (T, k) int32/int64; -1 (or any slot outside [0, S)) contributes nothing.
        weights: (T, k) routing weights, fp32 or hidden dtype.
        activation: "swiglu", or an `Activation` ("swiglu_clamped" with alpha and limit).
        gate_up_bias, down_bias: optional (S, 2*I) and (S, H) per-slot biases, same dtype.
        slot_map: optional (E + 1,) int32 expert → slot table (its last entry -1); then slot_ids
            holds expert ids (-1: none) and each is looked up in it (in the kernels at T = 1).
        host: optional `HostReads`: stacks of every expert in pinned host memory, which slot
            S + e reads in place over PCIe (one token, no biases), less the pairs its `cpu_take`
            leaves to a CPU worker.

    Returns:
        (T, H) in hidden's dtype, accumulated in fp32, deterministic (no atomics). No host
        sync; safe to capture in a CUDA graph (all shapes depend only on T, k, S, H, I).
    """
    return fused_moe_with_config(hidden, gate_up, down, slot_ids, weights, activation,
                                 gate_up_bias=gate_up_bias, down_bias=down_bias, slot_map=slot_map, host=host)
