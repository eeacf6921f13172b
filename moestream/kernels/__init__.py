"""Kernels, each beside its plain-torch reference (the reference is the spec).

`moe_reference`, `quant_moe_reference` and `quant_linear_reference` are plain torch and run
anywhere (they are the engine's CPU path). `fused_moe`, `fused_moe_quant` and `quant_linear` are
the Triton versions for CUDA; Triton is optional (absent from the CPU install), so importing this
package never imports it: each function below loads its `*_triton` module on first call. Use
`fused_moe_available()` / `fused_moe_quant_available()` to choose between them. The Triton
modules carry a `_triton` suffix so that importing one never shadows the function of the same
name on this package.
"""

from __future__ import annotations

import functools
import importlib

import torch
import torch.nn.functional as F
from torch import Tensor

from .moe_reference import moe_reference
from .paged_attention_reference import paged_decode_attention_reference, paged_kv_write_reference
from .quant_linear_reference import quant_linear_reference
from .quant_moe_reference import quant_moe_reference
from .switch import Switch

__all__ = ["moe_reference", "quant_linear_reference", "quant_moe_reference", "quant_linear", "paged_kv_write",
           "paged_decode_attention", "paged_kv_write_reference", "paged_decode_attention_reference",
           "fused_moe", "fused_moe_available", "prompt_tile_rows", "compiled_variants", "linear", "fused_moe_quant", "fused_moe_quant_available"]


@functools.cache
def _triton_module(name: str):
    """The Triton module `kernels/<name>_triton.py` (imported on first use, then cached)."""
    return importlib.import_module(f"{__name__}.{name}_triton")


def fused_moe(hidden: Tensor, gate_up: Tensor, down: Tensor, slot_ids: Tensor,
              weights: Tensor, activation="swiglu", gate_up_bias: Tensor | None = None,
              down_bias: Tensor | None = None, reduce: bool = True, slot_map: Tensor | None = None,
              host=None, layer_experts: int | None = None) -> Tensor:
    """Fused MoE dispatch over bank slots (Triton, CUDA); same contract as `moe_reference`
    (optional expert biases, an `Activation` with parameters, `reduce`), plus `slot_map`: with it,
    `slot_ids` are expert ids, looked up in that expert → slot table inside the kernels; and `host`
    (a `HostReads`): pinned stacks of every expert, which slot S + e reads in place (one token);
    `layer_experts`: the slots are some of a layer of that many experts (tiles sized for that layer).

    Loads Triton on first call; raises ImportError when it is not installed.
    """
    return _triton_module("fused_moe").fused_moe_with_config(hidden, gate_up, down, slot_ids, weights, activation,
                                                             gate_up_bias=gate_up_bias, down_bias=down_bias,
                                                             reduce=reduce, slot_map=slot_map, host=host,
                                                             layer_experts=layer_experts)


def sum_pairs(per_pair: Tensor, dtype, fused: bool) -> Tensor:
    """(T, H) from the (T, k, H) fp32 pair rows of `reduce=False` dispatches, summed exactly as the
    dispatch itself ends (`fused`: the Triton launch of `fused_moe`/`fused_moe_quant`, else the
    reference's sum), so rows gathered over several calls give the bits of one call."""
    if fused:
        return _triton_module("fused_moe").sum_pairs(per_pair, dtype)
    from .moe_reference import sum_pairs_reference

    return sum_pairs_reference(per_pair, dtype)


def cuda_module_available(module: str) -> bool:
    """True when a CUDA device is visible and `module` imports (a broken install — ImportError, a
    missing libcuda, a library built against another Triton — counts as absent)."""
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        importlib.import_module(module)
    except Exception:
        return False
    return True


@functools.lru_cache(maxsize=None)
def fused_moe_available() -> bool:
    """True when `fused_moe` can run here: a CUDA device is visible and Triton imports."""
    return cuda_module_available("triton")



def prompt_tile_rows(top_k: int, layer_experts: int, max_tokens: int) -> list[int]:
    """Token counts whose grouped calls, one each, compile every tile row the grouped path can take
    (Triton, CUDA): see `fused_moe_triton.prompt_tile_rows`."""
    return _triton_module("fused_moe").prompt_tile_rows(top_k, layer_experts, max_tokens)


def compiled_variants() -> dict[str, int]:
    """Kernel name → Triton variants compiled so far in this process, over every kernel module of this
    package that has been imported ({} without Triton): a step that compiles shows as a count that grew."""
    import sys

    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return {}
    counts = {}
    for name, module in list(sys.modules.items()):
        if name.startswith(__name__) and module is not None:
            for attr, fn in vars(module).items():
                if isinstance(fn, JITFunction):
                    counts[f"{name}.{attr}"] = sum(len(cache[0]) for cache in fn.device_caches.values())
    return counts

def fused_moe_quant(hidden: Tensor, slots, slot_ids: Tensor, weights: Tensor, spec, reduce: bool = True,
                    host=None, slot_map: Tensor | None = None, layer_experts: int | None = None) -> Tensor:
    """Fused MoE dispatch over quantized bank slots (Triton, CUDA); same contract as `quant_moe_reference`
    (`host`: a `QuantHostReads`, read in place by calls of a few tokens), plus `slot_map` and
    `layer_experts` as `fused_moe`'s."""
    return _triton_module("fused_moe_quant").fused_moe_quant(hidden, slots, slot_ids, weights, spec, reduce=reduce,
                                                             host=host, slot_map=slot_map,
                                                             layer_experts=layer_experts)


@functools.lru_cache(maxsize=None)
def fused_moe_quant_available() -> bool:
    """True when the dequantizing Triton kernels can run here (the same needs as `fused_moe`)."""
    return fused_moe_available()


def quant_linear(x: Tensor, qweight: Tensor, scales: Tensor, biases, spec, bias=None) -> Tensor:
    """x @ dequantize(weight)ᵀ (+ bias): the Triton kernel on CUDA when it exists; on the CPU, a decode
    step's few tokens through the C kernel's row dot products (the weight is never dequantized into
    memory: a vocabulary's LM head would be a GB a token), where it builds; else the reference."""
    if x.is_cuda and fused_moe_quant_available():
        return _triton_module("quant_linear").quant_linear(x, qweight, scales, biases, spec, bias)
    if not x.is_cuda and x.shape[0] <= _cpu_moe().QLINEAR_MAX_TOKENS and _cpu_qlinear_reads(spec):
        out = _cpu_moe().cpu_quant_linear(x, qweight, scales, biases, spec)
        return (out if bias is None else out + bias.float()).to(x.dtype)
    return quant_linear_reference(x, qweight, scales, biases, spec, bias)


def _cpu_moe():
    from . import cpu_moe   # imported at first use: it builds its C kernel then
    return cpu_moe


@functools.cache
def _cpu_qlinear_reads(spec) -> bool:
    """`cpu_moe.reads(spec)`, once per spec: asked by every quantized linear of every decode step."""
    return _cpu_moe().reads(spec)


# ---- fused small ops of a decoder layer (norms, q/k norm + rotary, the router's choice) ---------
# The model calls these instead of its torch ops when `fused_ops_enabled(tensor)` says so: a CUDA
# tensor, Triton present, and not switched off by `fused_ops(False)` (the A/B benchmarks and the
# tests that compare both paths). The torch ops stay the reference and the CPU path.

_fused_ops_on = Switch()
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)

# How a norm applies its weight (see norm_rope_triton.py), and the order of a router's two steps.
SCALE_NONE, SCALE_CAST_THEN_WEIGHT, SCALE_ONE_PLUS_WEIGHT_FP32, SCALE_WEIGHT_FP32 = 0, 1, 2, 3
SOFTMAX_THEN_TOPK, TOPK_THEN_SOFTMAX = 0, 1


def fused_ops_enabled(t: Tensor) -> bool:
    """True when the model should use the fused Triton ops for tensor `t`."""
    return _fused_ops_on.on and t.is_cuda and fused_moe_available()


def fused_ops(enabled: bool):
    """Switch the fused small ops on or off inside the block (graphs captured inside keep the choice)."""
    return _fused_ops_on.set(enabled)


def count_mapped(ids: Tensor, table: Tensor, counter: Tensor) -> None:
    """counter (a 0-d int64 on ids' device) += how many of `ids` map to an entry >= 0 of `table`: one
    launch where the fused ops run (inside a decode graph), the torch ops otherwise."""
    if fused_ops_enabled(ids):
        _triton_module("count_mapped").count_mapped(ids, table, counter)
    else:
        counter += (table[ids.long()] >= 0).sum()


def rms_norm(x: Tensor, weight: Tensor | None, eps: float, scale: int,
             residual: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """RMSNorm of x (of residual + x when given) in one launch: (normed, residual + x or None).
    `scale`: one of the `SCALE_*` above, the way the norm class applies its weight."""
    return _triton_module("norm_rope").rms_norm(x, weight, eps, scale, residual)


def norm_rope(x: Tensor, weight: Tensor | None, eps: float, scale: int, cos: Tensor, sin: Tensor) -> Tensor:
    """Per-head RMSNorm (none when weight is None) then rotary, x (B, L, heads, D) → new (B, L, heads, D)."""
    return _triton_module("norm_rope").norm_rope(x, weight, eps, scale, cos, sin)


def qk_rope_paged(q: Tensor, k: Tensor, v: Tensor, q_weight: Tensor | None, k_weight: Tensor | None, eps: float,
                  scale: int, cos: Tensor, sin: Tensor, k_pool: Tensor, v_pool: Tensor, tables: Tensor, rows: Tensor,
                  positions: Tensor) -> Tensor:
    """`norm_rope` of q and of k, then k and v written into their paged blocks (`paged_kv_write`), in
    one launch; returns the new q (B, L, heads, D). Both norms are of one kind (`scale`, `eps`)."""
    return _triton_module("norm_rope").qk_rope_paged(q, k, v, q_weight, k_weight, eps, scale, cos, sin, k_pool,
                                                     v_pool, tables, rows, positions)


def router_topk(logits: Tensor, k: int, mode: int, renormalise: bool) -> tuple[Tensor, Tensor]:
    """A router's weights (T, k) fp32 and ids (T, k) from its logits in one launch (`mode`:
    SOFTMAX_THEN_TOPK or TOPK_THEN_SOFTMAX)."""
    return _triton_module("router_topk").router_topk(logits, k, mode, renormalise)


def uniform_topk(logits: Tensor, k: int, draws: Tensor, seed: int) -> tuple[Tensor, Tensor]:
    """Benchmark routing in one launch (Triton, CUDA): k distinct experts per row drawn uniformly,
    weighted by the router's softmax at them, renormalised; `draws` counts rows drawn (device)."""
    return _triton_module("router_topk").uniform_topk(logits, k, draws, seed)


def sampling_kernel_takes(logits: Tensor, k: int) -> bool:
    """Whether `sample_top_k` serves these logits (B, V) at top-k k: CUDA with Triton, k within
    what its draw launch holds."""
    return logits.is_cuda and fused_moe_available() and _triton_module("sampling").takes_kernel(logits.shape[-1], k)


def sampling_top_k_variants(vocab: int) -> list[int]:
    """The least top-k of each variant `sample_top_k` compiles for rows of `vocab` logits (Triton): a draw at
    each compiles them all."""
    return _triton_module("sampling").top_k_variants(vocab)


def sample_top_k(logits: Tensor, k: int, temperature: float, top_p: float, min_p: float, uniform: Tensor) -> Tensor:
    """A token per row among its k best logits after temperature, min-p and top-p, at the row's
    uniform number (Triton, two launches); `runtime.sampling.draw_top_k_reference` is the spec."""
    return _triton_module("sampling").sample_top_k(logits, k, temperature, top_p, min_p, uniform)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear`, except for one row of a CUDA tensor with the fused ops on: there the Triton GEMV
    (gemv_triton.py), which reaches more of the memory bandwidth than cuBLAS on a decoder layer's
    batch-1 projections."""
    if (x.numel() == x.shape[-1] and x.dtype == weight.dtype and weight.dtype in _FLOATS
            and weight.stride(-1) == 1 and fused_ops_enabled(x)):
        return _triton_module("gemv").gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def paged_kv_write(k: Tensor, v: Tensor, k_pool: Tensor, v_pool: Tensor, tables: Tensor, rows: Tensor,
                   positions: Tensor) -> None:
    """A step's keys and values (B, L, kv_heads, D) into their blocks, in one launch (Triton; the
    reference where the fused ops are off)."""
    if fused_ops_enabled(k):
        return _triton_module("paged_attention").paged_kv_write(k, v, k_pool, v_pool, tables, rows, positions)
    return paged_kv_write_reference(k, v, k_pool, v_pool, tables, rows, positions)


def paged_decode_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, tables: Tensor, seq_lens: Tensor,
                           max_len: int, scale: float | None = None) -> Tensor:
    """One query per row (B, heads, D) attending to its first seq_lens[b] positions straight from the
    paged pools (flash-decoding, Triton); `max_len` bounds seq_lens on the host."""
    return _triton_module("paged_attention").paged_decode_attention(q, k_pool, v_pool, tables, seq_lens, max_len,
                                                                    scale)
