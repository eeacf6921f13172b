"""Checks of the one-token MoE path (fused_moe_token.py) against moe_reference and against itself.

One body for both places it runs: compiled on a GPU (test_fused_moe_token.py) and under Triton's
interpreter on the CPU (CI).
"""

from __future__ import annotations

import torch

from moestream.kernels import moe_reference
from moestream.kernels.moe_reference import Activation, HostReads

ACTIVATIONS = [("swiglu", False), (Activation("swiglu_clamped", alpha=1.702, limit=7.0), True), ("geglu_tanh", False)]
# (H, I, S, E, k) of each activation: whole K steps in both launches (H and I powers of two), partial
# ones with k = 3 of a K_PAD of 4, partial ones with k = 8
SHAPES = ((64, 32, 8, 12, 4), (72, 40, 6, 10, 3), (160, 48, 8, 10, 8))
# The same properties at about half the programs (the interpreter runs each one in Python): widths of
# the host and shared-pair checks too
INTERPRETER_SHAPES = dict(shapes=((32, 16, 8, 12, 4), (40, 24, 6, 10, 3), (48, 24, 8, 10, 8)), host=(48, 24),
                          shared=(48, 32), batches=(3,))


def _inputs(H: int, I: int, S: int, E: int, k: int, dtype: torch.dtype, device: str, seed: int, bias: bool):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, H, generator=g).to(device, dtype)
    gate_up = (torch.randn(S, 2 * I, H, generator=g) / H ** 0.5).to(device, dtype)
    down = (torch.randn(S, H, I, generator=g) / I ** 0.5).to(device, dtype)
    biases = ((torch.randn(S, 2 * I, generator=g) / 4).to(device, dtype),
              (torch.randn(S, H, generator=g) / 4).to(device, dtype)) if bias else (None, None)
    # Experts 0..S-1 sit in the slots (shuffled), the others in none. Expert ids: k-1 distinct
    # resident ones and the last expert (no slot); one pair is held nowhere (-1).
    mapped = min(S, E - 1)
    ids = torch.cat([torch.randperm(mapped, generator=g)[: k - 1], torch.tensor([E - 1])])
    ids[k // 2] = -1
    slot_map = torch.full((E + 1,), -1, dtype=torch.int32)
    slot_map[:mapped] = torch.randperm(S, generator=g)[:mapped].int()
    weights = torch.rand(1, k, generator=g).softmax(dim=1)
    return (hidden, gate_up, down, ids.view(1, k).to(device, torch.int32), weights.to(device),
            biases, slot_map.to(device))


def check_token_path(device: str, dtype: torch.dtype, shapes=SHAPES) -> None:
    from moestream.kernels.fused_moe_triton import fused_moe_with_config, sum_pairs

    tol = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}[dtype]
    for (H, I, S, E, k), (activation, bias) in zip(shapes, ACTIVATIONS, strict=True):
        hidden, gate_up, down, ids, weights, (gub, db), slot_map = _inputs(H, I, S, E, k, dtype, device, H + k, bias)
        slots = slot_map[ids.long()]
        slots[0, -1] = S + 2                                    # out of range: unrouted
        ref = moe_reference(hidden.float(), gate_up.float(), down.float(), slots, weights, activation,
                            gub.float() if bias else None, db.float() if bias else None)

        def run(slot_ids, reduce=True, smap=None):
            return fused_moe_with_config(hidden, gate_up, down, slot_ids, weights, activation, gate_up_bias=gub,
                                         down_bias=db, reduce=reduce, slot_map=smap)
        out = run(slots)
        assert out.shape == (1, H) and out.dtype == dtype
        err = float((out.float() - ref).norm() / ref.norm())
        assert err < tol, (H, activation, err)
        rows = run(slots, reduce=False)
        assert rows.shape == (1, k, H) and rows.dtype == torch.float32
        assert torch.equal(rows[0, -1], torch.zeros_like(rows[0, -1])), "an unrouted pair's row is zero"
        assert torch.equal(sum_pairs(rows, dtype), out), "pair rows summed as a dispatch ends give its bits"
        ids2 = ids.clone()
        ids2[0, 0] = E - 1                                      # an expert the map gives no slot
        slots2 = slot_map[ids2.long()]
        assert torch.equal(run(ids2, smap=slot_map), run(slots2)), "the slot map read in the kernels"
        none = run(torch.full_like(ids, -1))
        assert torch.equal(none, torch.zeros_like(none))


def _host_case(device: str, dtype: torch.dtype, H: int, I: int, seed: int):
    """12 experts in host stacks (pinned on CUDA), 4 of them in slots; one token routed to 6 pairs:
    pairs 1 and 3 (experts 2 and 5) read from the host stacks, expert 11 with no source, one -1.
    Returns host_gu, host_down, gate_up, down, hidden, ids, weights and the source map."""
    S, E, k = 4, 12, 6
    g = torch.Generator().manual_seed(seed)
    host_gu = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(dtype)
    host_down = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dtype)
    if device == "cuda":
        host_gu, host_down = host_gu.pin_memory(), host_down.pin_memory()
    resident = [3, 7, 1, 10]                                    # slot s holds expert resident[s]
    gate_up, down = host_gu[resident].to(device), host_down[resident].to(device)
    hidden = torch.randn(1, H, generator=g).to(device, dtype)
    ids = torch.tensor([[7, 2, 10, 5, 11, -1]], dtype=torch.int32, device=device)
    weights = torch.rand(1, k, generator=g).softmax(dim=1).to(device)
    source = torch.full((E + 1,), -1, dtype=torch.int32)
    source[resident] = torch.arange(S, dtype=torch.int32)
    source[2], source[5] = S + 2, S + 5                        # read from the host stack; 11: no source
    return host_gu, host_down, gate_up, down, hidden, ids, weights, source.to(device)


def check_host_reads(device: str, dtype: torch.dtype, H: int = 96, I: int = 40) -> None:
    """Experts read in place from a host stack (map values S + e) give the bits of the same experts
    held in slots, and the reference's host form agrees."""
    from moestream.kernels.fused_moe_triton import fused_moe_with_config

    host_gu, host_down, gate_up, down, hidden, ids, weights, source = _host_case(device, dtype, H, I, seed=7)
    host = HostReads(host_gu, host_down)
    out = fused_moe_with_config(hidden, gate_up, down, ids, weights, slot_map=source, host=host)
    # The same experts all in slots: identity map over a full device copy.
    full_gu, full_down = host_gu.to(device), host_down.to(device)
    full_ids = ids.clone()
    full_ids[0, 4] = -1
    full = fused_moe_with_config(hidden, full_gu, full_down, full_ids, weights)
    assert torch.equal(out, full), "an expert read from the host stack gives the bits of one in a slot"
    ref = moe_reference(hidden, gate_up, down, ids, weights, slot_map=source, host=host)
    tol = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}[dtype]
    assert float((out.float() - ref.float()).norm() / ref.float().norm()) < tol
    assert torch.equal(ref, moe_reference(hidden, full_gu, full_down, full_ids, weights))
    # The split: pairs 1 and 3 (experts 2 and 5) are outside the slots; take[2] = 1 leaves the first
    # of them (pair 1) to the CPU, so only pair 3 is read here; take[2] = 2 leaves both.
    for take2, skipped in ((1, [1]), (2, [1, 3]), (0, [])):
        take = torch.tensor([0, 1, take2, 2, 2, 2, 2], dtype=torch.int32, device=device)
        split = fused_moe_with_config(hidden, gate_up, down, ids, weights, slot_map=source,
                                      host=HostReads(host_gu, host_down, take))
        kept = full_ids.clone()
        kept[0, skipped] = -1
        assert torch.equal(split, fused_moe_with_config(hidden, full_gu, full_down, kept, weights)), take2
        assert torch.equal(moe_reference(hidden, gate_up, down, ids, weights, slot_map=source,
                                         host=HostReads(host_gu, host_down, take)),
                           moe_reference(hidden, full_gu, full_down, kept, weights))


def check_shared_pair(device: str, dtype: torch.dtype, H: int = 96, I: int = 64) -> None:
    """A pair the CPU shares (`HostReads.cpu_cut`): the launches compute its intermediate rows from
    the cut on, reading none below it; that part plus the rows below the cut computed apart give the
    whole expert (to rounding), and the reference's host form agrees with the launches."""
    from moestream.kernels.fused_moe_triton import fused_moe_with_config
    from moestream.kernels.moe_reference import get_activation

    host_gu, host_down, gate_up, down, hidden, ids, weights, source = _host_case(device, dtype, H, I, seed=8)
    act = get_activation("swiglu")
    for take2, cut2, shared, whole_cpu in ((0, I // 4, 1, []), (1, 3 * I // 4, 3, [1]), (1, 0, None, [1])):
        take = torch.tensor([0, 0, take2, 2, 2, 2, 2], dtype=torch.int32, device=device)
        cut = torch.tensor([0, 0, cut2, 0, 0, 0, 0], dtype=torch.int32, device=device)
        host = HostReads(host_gu, host_down, take, cut)
        out = fused_moe_with_config(hidden, gate_up, down, ids, weights, slot_map=source, host=host)
        ref = moe_reference(hidden, gate_up, down, ids, weights, slot_map=source, host=host)
        tol = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}[dtype]
        assert float((out.float() - ref.float()).norm() / ref.float().norm()) < tol, (take2, cut2)
        # add what the CPU computes: whole pairs, and the shared pair's rows below the cut
        cpu = torch.zeros(1, H, dtype=torch.float32, device=device)
        for j in whole_cpu + ([shared] if shared is not None else []):
            e = int(ids[0, j])
            rows = slice(0, cut2 if j == shared else I)
            gu = torch.cat([host_gu[e, rows], host_gu[e, I + rows.start:I + rows.stop]]).to(device)
            h = act(torch.nn.functional.linear(hidden, gu).float())
            cpu += torch.nn.functional.linear(h.to(dtype), host_down[e, :, rows].to(device)).float() * weights[0, j]
        full_ids = ids.clone()
        full_ids[0, 4] = -1                                    # expert 11 has no source anywhere
        full = moe_reference(hidden, host_gu.to(device), host_down.to(device), full_ids, weights)
        got = out.float() + cpu
        assert float((got - full.float()).norm() / full.float().norm()) < 3 * tol, (take2, cut2)


def check_batch_host_reads(device: str, dtype: torch.dtype, H: int = 96, I: int = 40, batches=(3, 12)) -> None:
    """A batch reads the experts its map sends to the host stacks (S + e) in place, on the decode path
    at any pair count (12 tokens x 6 pairs: past the decode path's usual 64), and leaves those the map
    gives nobody (-1: the CPU's) out: the bits of the same experts held in slots, minus the CPU's."""
    import pytest

    from moestream.kernels.fused_moe_triton import fused_moe_with_config

    host_gu, host_down, gate_up, down, _, _, _, source = _host_case(device, dtype, H, I, seed=9)
    source[6] = -1                                              # outside the bank, the CPU's (as 11 and others)
    source[8] = 4 + 8                                           # outside the bank, read in place (as 2 and 5)
    full_gu, full_down = host_gu.to(device), host_down.to(device)
    g = torch.Generator().manual_seed(10)
    E, k = host_gu.shape[0], 6
    for T in batches:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(device, torch.int32)
        hidden = torch.randn(T, H, generator=g).to(device, dtype)
        weights = torch.rand(T, k, generator=g).softmax(dim=1).to(device)
        out = fused_moe_with_config(hidden, gate_up, down, ids, weights, slot_map=source, host=HostReads(host_gu, host_down))
        kept = torch.where(source[ids.long()] >= 0, ids, -1)      # the same experts, all in slots, less the CPU's
        want = fused_moe_with_config(hidden, full_gu, full_down, kept, weights, path="decode")
        assert torch.equal(out, want), (T, "a batch's experts read from the host stacks give the bits of slots")
        ref = moe_reference(hidden, gate_up, down, ids, weights, slot_map=source, host=HostReads(host_gu, host_down))
        assert torch.equal(ref, moe_reference(hidden, full_gu, full_down, kept, weights)), T
        tol = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}[dtype]
        assert float((out.float() - ref.float()).norm() / ref.float().norm()) < tol, T
    take = torch.zeros(k + 1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="one-token"):            # tables split one token's pairs, not a batch's
        fused_moe_with_config(hidden, gate_up, down, ids, weights, slot_map=source,
                              host=HostReads(host_gu, host_down, take))


def check_all(device: str, dtypes: tuple[torch.dtype, ...], shapes=SHAPES, host=(96, 40), shared=(96, 64),
              batches=(3, 12)) -> None:
    for dtype in dtypes:
        check_token_path(device, dtype, shapes)
        check_host_reads(device, dtype, *host)
        check_batch_host_reads(device, dtype, *host, batches=batches)
        if device == "cuda" or dtype == dtypes[0]:   # the interpreter is slow: one dtype there
            check_shared_pair(device, dtype, *shared)
