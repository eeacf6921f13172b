"""Plain-torch MoE dispatch over bank slots: the spec of `fused_moe`, and the engine's CPU path.

What it computes, for every token t and routed position j (slot s = slot_ids[t, j]):

    out[t] = sum_j  weights[t, j] * (down[s] @ act(gate_up[s] @ hidden[t] + gate_up_bias[s]) + down_bias[s])

(s >= 0 only; the biases are optional, GPT-OSS's experts have them) where `gate_up[s]` holds the
gate rows first and the up rows second (its bias likewise), and the activation is `swiglu`,
`silu(gate) * up`, Gemma 4's `geglu_tanh`, `gelu_tanh(gate) * up`, or GPT-OSS's `swiglu_clamped`: gate clamped above at `limit`, up to
[-limit, limit], then `(up + 1) * gate * sigmoid(alpha * gate)`. A slot of -1 (expert not
resident) contributes nothing, its biases included.

Why this shape of code: the reference is also what the engine runs on the CPU, so it must be
fast there, not just obviously right. It groups the (token, position) pairs by slot with one
stable sort and then loops over the slots that are actually used (at most min(T*k, S) of them),
running two dense GEMMs per used slot on the gathered rows. The alternative, gathering each
pair's expert weights and running one batched `bmm`, copies `T*k` whole experts per call
(75 MB per token for Qwen3-30B-A3B) and is several times slower on a CPU. The loop reads
`.tolist()` once to learn the group sizes; that host sync is free on the CPU and acceptable for
a reference on CUDA, which is why the CUDA hot path uses the Triton kernel instead.

Precision: GEMMs run in the bank's dtype (torch's bf16/fp16 GEMMs accumulate in fp32 on both
CPU and CUDA, and a native bf16 GEMM is ~3-4x faster on a CPU than upcasting the expert to
fp32), the activation is computed in fp32, and the sum over the k routed experts accumulates
in fp32 before one cast to the hidden dtype at the end. For fp32 inputs everything is fp32.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

__all__ = ["moe_reference", "HostReads", "split_outside", "Activation", "ACTIVATIONS", "FUSED_ACTIVATIONS", "PLANNED_ACTIVATIONS", "check_moe_inputs",
           "get_activation"]


@dataclass(frozen=True)
class Activation:
    """An expert activation by name, with its parameters: an activation with parameters cannot be a
    bare name. `alpha` and `limit` are read by `swiglu_clamped` only; their defaults are GPT-OSS's
    (transformers' swiglu_alpha / swiglu_limit). A plain string names the activation with defaults."""

    name: str = "swiglu"
    alpha: float = 1.702
    limit: float = 7.0

    @staticmethod
    def of(activation: str | Activation) -> Activation:
        return activation if isinstance(activation, Activation) else Activation(activation)


def _swiglu(gate_up_out: Tensor, act: Activation) -> Tensor:
    """SwiGLU on a (n, 2I) gate_up product: `silu(gate) * up`, gate = first I columns."""
    gate, up = gate_up_out.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _swiglu_clamped(gate_up_out: Tensor, act: Activation) -> Tensor:
    """GPT-OSS's SwiGLU (transformers' GptOssExperts._apply_gate): the gate clamped above at `limit`,
    up clamped to [-limit, limit], then `(up + 1) * gate * sigmoid(alpha * gate)`. Gate = first I
    columns here: the checkpoint's interleaved gate/up columns are split when an expert is read."""
    gate, up = gate_up_out.chunk(2, dim=-1)
    gate = gate.clamp(max=act.limit)
    up = up.clamp(min=-act.limit, max=act.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * act.alpha))


def _geglu_tanh(gate_up_out: Tensor, act: Activation) -> Tensor:
    """Gemma's GeGLU: `gelu(gate) * up` with the tanh approximation of gelu (transformers'
    gelu_pytorch_tanh, Gemma 4's experts), gate = first I columns."""
    gate, up = gate_up_out.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


# Activation name -> function on the (n, 2I) fp32 gate_up product (and the activation's
# parameters), returning (n, I). The Triton kernel has a matching integer code per name (see
# moe_activation.ACTIVATION_CODES); a new activation is added in both places, reference first.
ACTIVATIONS: dict[str, Callable[[Tensor, Activation], Tensor]] = {"swiglu": _swiglu,
                                                                 "swiglu_clamped": _swiglu_clamped,
                                                                 "geglu_tanh": _geglu_tanh}

# Activations the fused Triton kernels implement (moe_activation.ACTIVATION_CODES, kept here so
# that asking needs no Triton import). Any other runs on this reference on every device: on CUDA
# it reads the routing back (`ExpertFormat.dispatch_syncs`), so such a model decodes without CUDA
# graphs. Today every activation has its kernel.
FUSED_ACTIVATIONS: frozenset[str] = frozenset({"swiglu", "swiglu_clamped", "geglu_tanh"})

# Names an ArchSpec may already ask for but whose reference is not written yet (none today).
PLANNED_ACTIVATIONS: frozenset[str] = frozenset()


def get_activation(activation: str | Activation) -> Callable[[Tensor], Tensor]:
    """The function of an activation (its parameters bound); say clearly when it is planned but not
    implemented, or unknown."""
    act = Activation.of(activation)
    try:
        fn = ACTIVATIONS[act.name]
    except KeyError:
        if act.name in PLANNED_ACTIVATIONS:
            raise NotImplementedError(
                f"MoE activation {act.name!r} is not implemented yet; the implemented ones are "
                f"{sorted(ACTIVATIONS)}"
            ) from None
        raise ValueError(
            f"unknown MoE activation {act.name!r}; use one of {sorted(ACTIVATIONS)}"
        ) from None
    return functools.partial(fn, act=act)


def check_moe_inputs(hidden: Tensor, gate_up: Tensor, down: Tensor, slot_ids: Tensor,
                     weights: Tensor) -> tuple[int, int, int, int, int]:
    """Validate shapes and dtypes shared by both implementations; return (T, H, S, I, k).

    Only metadata is read here (no values), so the check costs no device sync.
    """
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be (T, H), got shape {tuple(hidden.shape)}")
    T, H = hidden.shape
    if gate_up.dim() != 3 or gate_up.shape[2] != H or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be (S, 2*I, H={H}), got shape {tuple(gate_up.shape)}")
    S, two_i, _ = gate_up.shape
    I = two_i // 2
    if tuple(down.shape) != (S, H, I):
        raise ValueError(f"down must be (S={S}, H={H}, I={I}), got shape {tuple(down.shape)}")
    if slot_ids.dim() != 2 or slot_ids.shape[0] != T:
        raise ValueError(f"slot_ids must be (T={T}, k), got shape {tuple(slot_ids.shape)}")
    k = slot_ids.shape[1]
    if tuple(weights.shape) != (T, k):
        raise ValueError(f"weights must be (T={T}, k={k}), got shape {tuple(weights.shape)}")
    if slot_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_ids must be int32 or int64, got {slot_ids.dtype}")
    if gate_up.dtype != hidden.dtype or down.dtype != hidden.dtype:
        raise ValueError(
            f"hidden, gate_up and down must share one dtype, got "
            f"{hidden.dtype}, {gate_up.dtype}, {down.dtype}"
        )
    return T, H, S, I, k


def check_expert_biases(gate_up_bias: Tensor | None, down_bias: Tensor | None, S: int, H: int, I: int,
                        dtype: torch.dtype) -> None:
    """Optional per-slot biases: both or neither, (S, 2I) and (S, H), in the weights' dtype."""
    if (gate_up_bias is None) != (down_bias is None):
        raise ValueError("gate_up_bias and down_bias come together: pass both or neither")
    if gate_up_bias is None:
        return
    if tuple(gate_up_bias.shape) != (S, 2 * I):
        raise ValueError(f"gate_up_bias must be (S={S}, 2*I={2 * I}), got shape {tuple(gate_up_bias.shape)}")
    if tuple(down_bias.shape) != (S, H):
        raise ValueError(f"down_bias must be (S={S}, H={H}), got shape {tuple(down_bias.shape)}")
    if gate_up_bias.dtype != dtype or down_bias.dtype != dtype:
        raise ValueError(f"the expert biases must be {dtype} like the weights, got "
                         f"{gate_up_bias.dtype}, {down_bias.dtype}")


@dataclass(frozen=True)
class HostReads:
    """Every expert of a layer in (pinned) host memory, which slot id S + e reads in place (stacks
    (E, 2*I, H) and (E, H, I), the slots' dtype, no biases). With `cpu_take` ((k + 1,) int32), a
    one-token call's pairs outside the slots are split: of its m such pairs, the first cpu_take[m]
    in routing order are computed elsewhere (a CPU worker) and contribute nothing here. With
    `cpu_cut` too, the next pair is shared: the CPU computes its intermediate rows [0, cpu_cut[m])
    (gate and up rows, and those columns of down), the device the rest."""

    gate_up: Tensor
    down: Tensor
    cpu_take: Tensor | None = None
    cpu_cut: Tensor | None = None   # (k + 1,) int32: the CPU also computes intermediate rows [0, cpu_cut[m])
                                    # of the pair after its cpu_take[m] (0: none), the device the rest of them


def split_outside(ids: Tensor, num_slots: int, cpu_take: Tensor | None) -> Tensor:
    """(T, k) sources with `HostReads.cpu_take`'s pairs set to -1: per row, of the m sources at or past
    num_slots, the first cpu_take[m] in order."""
    return split_outside_cut(ids, num_slots, cpu_take, None)[0]


def split_outside_cut(ids: Tensor, num_slots: int, cpu_take: Tensor | None,
                      cpu_cut: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """`split_outside`, and with `cpu_cut` the first intermediate row each pair's device part starts
    at ((T, k) int64: cpu_cut[m] for the pair right after the CPU's take[m] of a row's m sources past
    num_slots, 0 elsewhere), or None."""
    if cpu_take is None:
        return ids, None
    outside = (ids >= num_slots).long()
    m = outside.sum(1)
    take = cpu_take.to(ids.device).long()[m]
    rank = outside.cumsum(1) - outside
    split = torch.where((outside > 0) & (rank < take[:, None]), -1, ids)
    if cpu_cut is None:
        return split, None
    cut = cpu_cut.to(ids.device).long()[m]
    lo = torch.where((outside > 0) & (rank == take[:, None]), cut[:, None], 0)
    return split, lo


def _pairs_from(lo_pairs: Tensor, hidden: Tensor, gate_up: Tensor, down: Tensor, ids: Tensor, weights: Tensor,
                activation) -> Tensor:
    """(T, k, H) fp32 rows of the pairs with a cut (lo > 0): expert ids[t, j]'s intermediate rows
    [lo, I) only, times the routing weight; zero elsewhere."""
    T, k = ids.shape
    I = down.shape[-1]
    act = get_activation(activation)
    out = torch.zeros(T, k, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    for t, j in (lo_pairs > 0).nonzero().tolist():
        e, lo = int(ids[t, j]), int(lo_pairs[t, j])
        rows = torch.cat([gate_up[e, lo:I], gate_up[e, I + lo:]])
        h = act(torch.nn.functional.linear(hidden[t:t + 1], rows).float())
        y = torch.nn.functional.linear(h.to(hidden.dtype), down[e, :, lo:]).float()
        out[t, j] = y[0] * weights[t, j].float()
    return out


def moe_reference(hidden: Tensor, gate_up: Tensor, down: Tensor, slot_ids: Tensor,
                  weights: Tensor, activation: str | Activation = "swiglu",
                  gate_up_bias: Tensor | None = None, down_bias: Tensor | None = None,
                  reduce: bool = True, slot_map: Tensor | None = None,
                  host: HostReads | None = None) -> Tensor:
    """Routed-expert FFN over bank slots, in plain torch (the spec of `fused_moe`).

    Args:
        hidden: (T, H) token activations, bf16/fp16/fp32.
        gate_up: (S, 2*I, H) bank slots, gate rows first then up rows, same dtype as hidden.
        down: (S, H, I) bank slots.
        slot_ids: (T, k) int32/int64 slot per routed expert; -1 = not resident, contributes 0.
        weights: (T, k) routing weights (fp32 or hidden dtype).
        activation: "swiglu" (silu(gate) * up), or an `Activation` (with parameters:
            `Activation("swiglu_clamped", alpha, limit)`).
        gate_up_bias: optional (S, 2*I) bias of the gate_up product (gate first, then up).
        down_bias: optional (S, H) bias of the down product; added before the routing weight
            multiplies the expert's output (as transformers' GptOssExperts does).

        reduce: False returns the (T, k, H) fp32 row of every pair instead (zero where unrouted):
            rows of several calls added up, then `sum_pairs_reference`, equal one call's result.
        slot_map: optional (E + 1,) expert → slot table (its last entry -1); then slot_ids holds
            expert ids (-1: none), each looked up in it first.
        host: optional `HostReads`: a slot id S + e then means expert e read from its stacks (no
            biases), less the pairs its `cpu_take` leaves to the CPU.

    Returns:
        (T, H) in hidden's dtype; the sum over the k experts is accumulated in fp32.
    """
    if slot_map is not None:
        slot_ids = slot_map[slot_ids.long()]
    if host is not None:
        if gate_up_bias is not None:
            raise ValueError("experts read from a host stack take no biases")
        S = gate_up.shape[0]
        ids, lo = split_outside_cut(slot_ids.long().reshape(hidden.shape[0], -1), S, host.cpu_take, host.cpu_cut)
        host_gate_up, host_down = host.gate_up.to(hidden.device), host.down.to(hidden.device)   # plainly: a reference
        whole = ids if lo is None else torch.where(lo > 0, -1, ids)
        pairs = (moe_reference(hidden, gate_up, down, torch.where(whole < S, whole, -1), weights, activation,
                               reduce=False)
                 + moe_reference(hidden, host_gate_up, host_down, torch.where(whole >= S, whole - S, -1), weights,
                                 activation, reduce=False))
        if lo is not None and bool((lo > 0).any()):   # the device's rows of a pair the CPU shares
            pairs = pairs + _pairs_from(lo, hidden, host_gate_up, host_down, ids - S, weights, activation)
        return sum_pairs_reference(pairs, hidden.dtype) if reduce else pairs
    T, H, S, I, k = check_moe_inputs(hidden, gate_up, down, slot_ids, weights)
    check_expert_biases(gate_up_bias, down_bias, S, H, I, gate_up.dtype)
    act = get_activation(activation)
    if T == 0 or k == 0 or not ((slot_ids >= 0) & (slot_ids < S)).any():
        return torch.zeros_like(hidden) if reduce else hidden.new_zeros((T, k, H), dtype=torch.float32)

    flat_slots = slot_ids.reshape(-1).to(torch.int64)
    # Out-of-range slots are treated like -1 (not resident): the fused kernel cannot raise on
    # the device without a sync, so both implementations agree on "ignore" instead.
    valid = (flat_slots >= 0) & (flat_slots < S)
    pairs = valid.nonzero().squeeze(1)                      # flat (t*k + j) indices
    pair_slots = flat_slots[pairs]
    order = torch.argsort(pair_slots, stable=True)
    pairs, pair_slots = pairs[order], pair_slots[order]
    used_slots, counts = torch.unique_consecutive(pair_slots, return_counts=True)
    flat_weights = weights.reshape(-1).to(torch.float32)
    # One fp32 row per (token, position), summed over k at the end: the same order of
    # summation as the kernel, and plain row writes (pairs are unique). Scattering into (T, H)
    # with index_add_ instead was measured at tens of ms per call on a CPU, even for one row.
    per_pair = torch.zeros(T * k, H, dtype=torch.float32, device=hidden.device)

    start = 0
    for slot, n in zip(used_slots.tolist(), counts.tolist()):   # the one host sync
        group = pairs[start:start + n]
        start += n
        tokens = group // k
        x = hidden.index_select(0, tokens)                  # (n, H)
        h = torch.nn.functional.linear(x, gate_up[slot]).float()        # (n, 2I) fp32
        if gate_up_bias is not None:
            h = h + gate_up_bias[slot].float()
        h = act(h)                                          # (n, I) fp32
        y = torch.nn.functional.linear(h.to(hidden.dtype), down[slot]).float()  # (n, H)
        if down_bias is not None:
            y = y + down_bias[slot].float()
        per_pair[group] = y * flat_weights[group, None]
    return sum_pairs_reference(per_pair.view(T, k, H), hidden.dtype) if reduce else per_pair.view(T, k, H)


def sum_pairs_reference(per_pair: Tensor, dtype: torch.dtype) -> Tensor:
    """(T, H) in `dtype` from (T, k, H) fp32 pair rows: the sum `moe_reference` ends with."""
    return per_pair.sum(dim=1).to(dtype)
