"""fused_moe (Triton) against moe_reference, on fresh random inputs.

Two groups:
* CUDA tests (skipped unless `fused_moe_available()`): bf16 at the Qwen3-30B-A3B shape and a
  small odd shape, relative error against the fp32 reference on upcast inputs, NaN-poisoned
  workspaces, -1 slots, CUDA-graph capture (which fails on any host sync).
* An interpreter test (skipped unless Triton is installed) that runs the same kernels on the
  CPU under TRITON_INTERPRET=1 in a subprocess (the variable must be set before Triton is
  imported). The interpreter cannot do bf16 `tl.dot` (it multiplies the raw bit patterns, see
  triton-lang/triton#11584), so it checks fp32 and fp16 only.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from moestream.kernels import fused_moe, fused_moe_available, moe_reference

REPO = Path(__file__).resolve().parents[2]
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_cuda = pytest.mark.skipif(not fused_moe_available(),
                                reason="fused_moe needs CUDA and Triton")


def make_inputs(T: int, H: int, I: int, S: int, k: int, dtype: torch.dtype, device: str,
                seed: int, unrouted: float = 0.15, slot_dtype: torch.dtype = torch.int32):
    """Per token, k distinct slots out of S (as a router would give), ~`unrouted` set to -1."""
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(T, H, generator=g, device=device).to(dtype)
    gate_up = (torch.randn(S, 2 * I, H, generator=g, device=device) / H ** 0.5).to(dtype)
    down = (torch.randn(S, H, I, generator=g, device=device) / I ** 0.5).to(dtype)
    slot_ids = torch.rand(T, S, generator=g, device=device).topk(k, dim=1).indices
    slot_ids[torch.rand(T, k, generator=g, device=device) < unrouted] = -1
    weights = torch.rand(T, k, generator=g, device=device).softmax(dim=1)
    return hidden, gate_up, down, slot_ids.to(slot_dtype), weights


def fp32_reference(hidden, gate_up, down, slot_ids, weights) -> torch.Tensor:
    return moe_reference(hidden.float(), gate_up.float(), down.float(), slot_ids, weights.float())


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def poison_allocator(T: int, k: int, H: int, I: int, dtype: torch.dtype) -> None:
    """Leave NaNs in the blocks the caching allocator will hand to fused_moe's workspaces.

    fused_moe allocates its intermediates with torch.empty; allocating NaN tensors of the same
    sizes and freeing them makes those blocks come back NaN-filled, so any row the kernels
    forget to write (padding, -1 slots) shows up as NaN in the output.
    """
    poison = [torch.full((T * k, I), float("nan"), dtype=dtype, device="cuda"),
              torch.full((T * k, H), float("nan"), dtype=torch.float32, device="cuda"),
              torch.full((T, k, H), float("nan"), dtype=torch.float32, device="cuda"),
              torch.full((T, H), float("nan"), dtype=torch.float32, device="cuda")]
    del poison


# ---------------------------------------------------------------------------------- CUDA


SHAPES = {"qwen3_30b_a3b": (2048, 768), "small_odd": (200, 72)}


@needs_cuda
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("S", [8, 128])
@pytest.mark.parametrize("T", [1, 2, 8, 64, 512, 2048])
def test_bf16_matches_reference(T: int, S: int, shape: str) -> None:
    H, I = SHAPES[shape]
    k = 2 if S == 8 else 8            # Mixtral-like for 8 slots, Qwen3-like for 128
    inputs = make_inputs(T, H, I, S, k, torch.bfloat16, "cuda", seed=T * 1000 + S)
    poison_allocator(T, k, H, I, torch.bfloat16)
    out = fused_moe(*inputs)
    assert out.shape == (T, H) and out.dtype == torch.bfloat16
    assert not out.isnan().any(), "fused_moe left unwritten (NaN-poisoned) rows in its output"
    assert rel_err(out, fp32_reference(*inputs)) < 1e-2


@needs_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float16, 1e-2), (torch.float32, 1e-4)])
def test_other_dtypes(dtype: torch.dtype, tol: float) -> None:
    inputs = make_inputs(33, 256, 96, 16, 4, dtype, "cuda", seed=5, slot_dtype=torch.int64)
    out = fused_moe(*inputs)
    assert out.dtype == dtype
    assert rel_err(out, fp32_reference(*inputs)) < tol


@needs_cuda
def test_all_unrouted_gives_zeros_and_duplicates_add() -> None:
    hidden, gate_up, down, slot_ids, weights = make_inputs(4, 256, 96, 8, 2, torch.bfloat16,
                                                           "cuda", seed=9)
    poison_allocator(4, 2, 256, 96, torch.bfloat16)
    out = fused_moe(hidden, gate_up, down, torch.full_like(slot_ids, -1), weights)
    assert torch.equal(out, torch.zeros_like(out))
    same = torch.tensor([[3, 3]] * 4, device="cuda", dtype=torch.int32)
    out = fused_moe(hidden, gate_up, down, same, weights)
    assert rel_err(out, fp32_reference(hidden, gate_up, down, same, weights)) < 1e-2


@needs_cuda
@pytest.mark.parametrize("T", [1, 256])
def test_no_host_sync_and_cuda_graph_capture(T: int) -> None:
    """A host sync inside fused_moe raises under sync-debug mode and breaks graph capture."""
    H, I, S, k = 512, 128, 32, 8
    hidden, gate_up, down, slot_ids, weights = make_inputs(T, H, I, S, k, torch.bfloat16,
                                                           "cuda", seed=T)
    fused_moe(hidden, gate_up, down, slot_ids, weights)          # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused_moe(hidden, gate_up, down, slot_ids, weights)
    finally:
        torch.cuda.set_sync_debug_mode("default")

    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_moe(hidden, gate_up, down, slot_ids, weights)      # warm-up on the side stream
        with torch.cuda.graph(graph, stream=stream):
            static_out = fused_moe(hidden, gate_up, down, slot_ids, weights)
    torch.cuda.current_stream().wait_stream(stream)
    # Replay with new routing written in place: the graph must follow it.
    new = make_inputs(T, H, I, S, k, torch.bfloat16, "cuda", seed=T + 1)
    hidden.copy_(new[0])
    slot_ids.copy_(new[3])
    weights.copy_(new[4])
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(static_out, fp32_reference(hidden, gate_up, down, slot_ids, weights)) < 1e-2


# --------------------------------------------------------------------------- interpreter

_INTERPRETER_SCRIPT = textwrap.dedent("""
    import torch
    from moestream.kernels.fused_moe import (GemmConfig, MoeConfig, fused_moe_with_config,
                                             moe_align_block_size)
    from moestream.kernels import moe_reference

    _empty = torch.empty
    def nan_empty(*args, **kwargs):
        # Poison every workspace fused_moe allocates: a row the kernels forget shows up as NaN.
        t = _empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    torch.empty = nan_empty

    def check_alignment(slot_ids, S, block_m):
        pair_ids, block_slot = moe_align_block_size(slot_ids, S, block_m)
        M = slot_ids.numel()
        flat = slot_ids.reshape(-1).long()
        rows = pair_ids.view(-1, block_m)
        seen = sorted(p for p in pair_ids.tolist() if p < M)
        assert seen == list(range(M)), "every pair appears exactly once"
        for b, s in enumerate(block_slot.tolist()):
            real = [p for p in rows[b].tolist() if p < M]
            want = s if s >= 0 else None
            for p in real:
                got = int(flat[p])
                got = got if 0 <= got < S else None
                assert got == want, (b, s, p, got)

    def make(T, H, I, S, k, dtype, seed, unrouted=0.25):
        g = torch.Generator().manual_seed(seed)
        hidden = torch.randn(T, H, generator=g).to(dtype)
        gate_up = (torch.randn(S, 2 * I, H, generator=g) / H ** 0.5).to(dtype)
        down = (torch.randn(S, H, I, generator=g) / I ** 0.5).to(dtype)
        slot_ids = torch.randint(0, S, (T, k), generator=g)
        slot_ids[torch.rand(T, k, generator=g) < unrouted] = -1
        slot_ids[0, 0] = S + 3                      # out of range counts as unrouted
        weights = torch.rand(T, k, generator=g)
        weights[(slot_ids < 0) | (slot_ids >= S)] = float("nan")   # skipped, never multiplied
        return hidden, gate_up, down, slot_ids.int(), weights

    small = MoeConfig(16, GemmConfig(16, 32, 4, 2), GemmConfig(32, 32, 4, 2))
    grouped = MoeConfig(32, GemmConfig(32, 16, 4, 2, group_m=2),
                        GemmConfig(16, 64, 4, 2, group_m=3))
    cases = [  # T, H, I, S, k, dtype, config
        (1, 64, 32, 8, 4, torch.float32, None),
        (7, 40, 24, 5, 3, torch.float32, small),       # odd H/I: masked K, wrapped N
        (13, 64, 48, 6, 4, torch.float16, grouped),    # several blocks per slot, GROUP_M
        (9, 96, 32, 4, 2, torch.float16, None),
    ]
    for i, (T, H, I, S, k, dtype, cfg) in enumerate(cases):
        hidden, gate_up, down, slot_ids, weights = make(T, H, I, S, k, dtype, seed=i)
        for block_m in (16, 32):
            check_alignment(slot_ids, S, block_m)
        out = fused_moe_with_config(hidden, gate_up, down, slot_ids, weights, config=cfg)
        ref = moe_reference(hidden.float(), gate_up.float(), down.float(), slot_ids, weights)
        err = float((out.float() - ref).norm() / ref.norm())
        tol = 1e-5 if dtype == torch.float32 else 3e-3
        assert out.dtype == dtype and not out.isnan().any(), (i, out)
        assert err < tol, (i, err)
        print(f"case {i}: T={T} H={H} I={I} S={S} k={k} {dtype} rel_err={err:.2e}")
    none = fused_moe_with_config(hidden, gate_up, down, torch.full_like(slot_ids, -1), weights)
    assert torch.equal(none, torch.zeros_like(none))
    print("interpreter ok")
""")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the compiled kernel is tested directly (Triton 3.6's interpreter trips on numpy 2.5)")
def test_kernels_under_triton_interpreter() -> None:
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    result = subprocess.run([sys.executable, "-c", _INTERPRETER_SCRIPT], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "interpreter ok" in result.stdout


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_cpu_tensors_are_refused_and_package_name_stays_the_function() -> None:
    import moestream.kernels as kernels

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("CPU tensors are allowed under the interpreter")
    hidden = torch.zeros(2, 32)
    with pytest.raises(ValueError, match="CUDA"):
        kernels.fused_moe(hidden, torch.zeros(4, 32, 32), torch.zeros(4, 32, 16),
                          torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, 2))
    # Loading kernels/fused_moe.py must not leave the submodule where the function was.
    assert callable(kernels.fused_moe) and kernels.fused_moe.__name__ == "_fused_moe_entry"
