"""fused_moe (Triton) against moe_reference, on fresh random inputs.

fused_moe has two paths (decode: no align, T*k <= DECODE_MAX_PAIRS; grouped: align + grouped
GEMMs); the tests force each one with `fused_moe_with_config(..., path=...)` as well as going
through the automatic choice.

Two groups:
* CUDA tests (skipped unless `fused_moe_available()`): bf16 at the Qwen3-30B-A3B shape and a
  small odd shape, relative error against the fp32 reference on upcast inputs, NaN-poisoned
  workspaces, -1 and out-of-range slots, duplicate slots, determinism, the Triton align kernel
  against its torch spec (bit for bit), CUDA-graph capture (which fails on any host sync).
* An interpreter test (skipped unless Triton is installed, and skipped when CUDA is available)
  that runs the same kernels on the CPU under TRITON_INTERPRET=1 in a subprocess (the variable
  must be set before Triton is imported). The interpreter cannot do bf16 `tl.dot` (it
  multiplies the raw bit patterns, see triton-lang/triton#11584), so it checks fp32 and fp16.
"""

from __future__ import annotations

import os
import textwrap

import pytest
import torch

from moestream.kernels import fused_moe, fused_moe_available, moe_reference
from triton_interpreter import HAS_TRITON, INTERPRETER_SKIP, run_under_interpreter

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

    fused_moe allocates its intermediates and its output with torch.empty; allocating NaN
    tensors of the same sizes and freeing them makes those blocks come back NaN-filled, so any
    row the kernels forget to write, or read without having written it (padding, -1 slots),
    shows up as NaN in the output.
    """
    poison = [torch.full((T * k, I), float("nan"), dtype=dtype, device="cuda"),
              torch.full((T * k, H), float("nan"), dtype=torch.float32, device="cuda"),
              torch.full((T, H), float("nan"), dtype=dtype, device="cuda"),
              torch.full((T, k, H), float("nan"), dtype=torch.float32, device="cuda"),
              torch.full((T, H), float("nan"), dtype=torch.float32, device="cuda")]
    del poison


def kernel_module():
    """The Triton module behind `moestream.kernels.fused_moe`."""
    import moestream.kernels.fused_moe_triton as module

    return module


def fused(inputs, path: str = "auto", **kwargs) -> torch.Tensor:
    """fused_moe with the path forced ("decode" / "grouped") or chosen ("auto")."""
    return kernel_module().fused_moe_with_config(*inputs, path=path, **kwargs)


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
@pytest.mark.parametrize("path", ["decode", "grouped"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("T", [1, 2, 3, 8, 16])
def test_both_paths_around_the_threshold(T: int, shape: str, path: str) -> None:
    """Each path forced, at T on both sides of DECODE_MAX_PAIRS (64 pairs = T 8 at k 8)."""
    H, I = SHAPES[shape]
    S, k = (128, 8) if shape == "qwen3_30b_a3b" else (8, 2)
    inputs = make_inputs(T, H, I, S, k, torch.bfloat16, "cuda", seed=7 * T + len(path))
    inputs[3][0, -1] = S + 5                       # out of range counts as unrouted
    poison_allocator(T, k, H, I, torch.bfloat16)
    out = fused(inputs, path)
    assert out.shape == (T, H) and out.dtype == torch.bfloat16
    assert not out.isnan().any(), "unwritten (NaN-poisoned) rows reached the output"
    assert rel_err(out, fp32_reference(*inputs)) < 1e-2


@needs_cuda
@pytest.mark.parametrize("path", ["decode", "grouped"])
@pytest.mark.parametrize("T,k,S", [(8, 8, 3), (8, 8, 1), (3, 4, 128), (16, 4, 2)])
def test_duplicate_slots(T: int, k: int, S: int, path: str) -> None:
    """Many pairs on one slot, within a token and across tokens: (8, 8, 1) puts 63 of the 64
    pairs on slot 0 (the decode path's owner then loops over 4 blocks of 16 rows)."""
    H, I = 256, 96
    hidden, gate_up, down, _, weights = make_inputs(T, H, I, max(S, 8), k, torch.bfloat16,
                                                    "cuda", seed=T + k + S)
    gate_up, down = gate_up[:S].contiguous(), down[:S].contiguous()
    g = torch.Generator(device="cuda").manual_seed(S)
    slot_ids = torch.randint(0, S, (T, k), generator=g, device="cuda", dtype=torch.int32)
    slot_ids[0, 1] = slot_ids[0, 0]                 # a duplicate inside one token
    if k > 2:
        slot_ids[-1, 2] = -1
    inputs = (hidden, gate_up, down, slot_ids, weights)
    poison_allocator(T, k, H, I, torch.bfloat16)
    out = fused(inputs, path)
    assert not out.isnan().any()
    assert rel_err(out, fp32_reference(*inputs)) < 1e-2


@needs_cuda
@pytest.mark.parametrize("path", ["decode", "grouped"])
@pytest.mark.parametrize("dtype,tol", [(torch.float16, 1e-2), (torch.float32, 1e-4)])
def test_other_dtypes(dtype: torch.dtype, tol: float, path: str) -> None:
    inputs = make_inputs(13, 256, 96, 16, 4, dtype, "cuda", seed=5, slot_dtype=torch.int64)
    out = fused(inputs, path)
    assert out.dtype == dtype
    assert rel_err(out, fp32_reference(*inputs)) < tol


@needs_cuda
@pytest.mark.parametrize("path", ["decode", "grouped"])
def test_strided_inputs_and_low_precision_weights(path: str) -> None:
    """Non-contiguous hidden / slot_ids / weights (bf16 weights) are read through strides."""
    T, H, I, S, k = 6, 256, 96, 16, 4
    hidden, gate_up, down, slot_ids, weights = make_inputs(T, H, I, S, k, torch.bfloat16,
                                                           "cuda", seed=11)
    wide = torch.zeros(T, 2 * H, dtype=torch.bfloat16, device="cuda")
    wide[:, ::2] = hidden
    strided = (wide[:, ::2], gate_up, down, slot_ids.t().contiguous().t(),
               weights.to(torch.bfloat16).t().contiguous().t())
    assert not strided[0].is_contiguous() and not strided[3].is_contiguous()
    out = fused(strided, path)
    assert rel_err(out, fp32_reference(*strided)) < 1e-2


@needs_cuda
@pytest.mark.parametrize("path", ["decode", "grouped"])
def test_deterministic_and_paths_agree(path: str) -> None:
    """No atomics: two calls give the same bits; the two paths agree to bf16 rounding."""
    inputs = make_inputs(8, 2048, 768, 128, 8, torch.bfloat16, "cuda", seed=3)
    first, second = fused(inputs, path), fused(inputs, path)
    assert torch.equal(first, second)
    other = fused(inputs, "grouped" if path == "decode" else "decode")
    assert rel_err(first, other.float()) < 1e-2


@needs_cuda
@pytest.mark.parametrize("T,k,S,block_m", [(1, 8, 128, 16), (37, 8, 128, 16), (64, 8, 128, 64),
                                           (512, 8, 128, 64), (2048, 8, 128, 128),
                                           (300, 10, 512, 32), (20, 2, 8, 16)])
def test_align_kernel_matches_torch_spec(T: int, k: int, S: int, block_m: int) -> None:
    module = kernel_module()
    g = torch.Generator(device="cuda").manual_seed(T + S)
    slot_ids = torch.randint(-1, S + 2, (T, k), generator=g, device="cuda", dtype=torch.int32)
    got = module.moe_align_block_size(slot_ids, S, block_m)
    want = module.moe_align_block_size_torch(slot_ids, S, block_m)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@needs_cuda
def test_all_unrouted_gives_zeros_and_duplicates_add() -> None:
    hidden, gate_up, down, slot_ids, weights = make_inputs(4, 256, 96, 8, 2, torch.bfloat16,
                                                           "cuda", seed=9)
    poison_allocator(4, 2, 256, 96, torch.bfloat16)
    none = torch.full_like(slot_ids, -1)
    same = torch.tensor([[3, 3]] * 4, device="cuda", dtype=torch.int32)
    for path in ("decode", "grouped"):
        out = fused((hidden, gate_up, down, none, weights), path)
        assert torch.equal(out, torch.zeros_like(out))
        out = fused((hidden, gate_up, down, same, weights), path)
        assert rel_err(out, fp32_reference(hidden, gate_up, down, same, weights)) < 1e-2


@needs_cuda
@pytest.mark.parametrize("T", [1, 8, 256])        # decode, decode at the threshold, grouped
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
    from moestream.kernels.fused_moe_triton import (DecodeConfig, DecodeTile, GemmConfig, MoeConfig,
                                             fused_moe_with_config, moe_align_block_size,
                                             moe_align_block_size_torch)
    import moestream.kernels.moe_align as moe_align
    from moestream.kernels import moe_reference

    _empty = torch.empty
    def nan_empty(*args, **kwargs):
        # Poison every workspace fused_moe allocates: a row the kernels forget shows up as NaN.
        t = _empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-7)
    torch.empty = nan_empty

    def check_alignment(slot_ids, S, block_m):
        pair_ids, block_slot = moe_align_block_size(slot_ids, S, block_m)
        want = moe_align_block_size_torch(slot_ids, S, block_m)
        assert torch.equal(pair_ids, want[0]) and torch.equal(block_slot, want[1])
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
    tiny_decode = DecodeConfig(DecodeTile(16, 16, 4, 2), DecodeTile(16, 32, 4, 2))
    cases = [  # T, H, I, S, k, dtype, grouped config, decode config
        (1, 64, 32, 8, 4, torch.float32, None, None),
        (7, 40, 24, 5, 3, torch.float32, small, tiny_decode),   # odd H/I: masked K, wrapped N
        (13, 64, 48, 6, 4, torch.float16, grouped, None),       # several blocks per slot
        (9, 96, 32, 4, 2, torch.float16, None, None),
        (8, 64, 48, 2, 8, torch.float16, None, None),           # 64 pairs on 2 slots:
    ]                                                           # decode owners loop row blocks
    for i, (T, H, I, S, k, dtype, cfg, dcfg) in enumerate(cases):
        hidden, gate_up, down, slot_ids, weights = make(T, H, I, S, k, dtype, seed=i)
        for block_m in (16, 32):
            check_alignment(slot_ids, S, block_m)
        ref = moe_reference(hidden.float(), gate_up.float(), down.float(), slot_ids, weights)
        tol = 1e-5 if dtype == torch.float32 else 3e-3
        for path, c in (("grouped", cfg), ("decode", dcfg), ("auto", None)):
            out = fused_moe_with_config(hidden, gate_up, down, slot_ids, weights, config=c,
                                        path=path)
            err = float((out.float() - ref).norm() / ref.norm())
            assert out.dtype == dtype and not out.isnan().any(), (i, path, out)
            assert err < tol, (i, path, err)
            again = fused_moe_with_config(hidden, gate_up, down, slot_ids, weights, config=c,
                                          path=path)
            assert torch.equal(out, again), (i, path, "not deterministic")
            print(f"case {i}: T={T} H={H} I={I} S={S} k={k} {dtype} {path:7s} rel_err={err:.2e}")
        for path in ("grouped", "decode"):
            none = fused_moe_with_config(hidden, gate_up, down, torch.full_like(slot_ids, -1),
                                         weights, path=path)
            assert torch.equal(none, torch.zeros_like(none)), path

    # The align kernel with several chunks per program and several programs.
    g = torch.Generator().manual_seed(0)
    moe_align._MAX_PROGRAMS = 3
    for T, k, S, block_m in ((300, 8, 128, 16), (50, 8, 130, 64), (9, 2, 4, 16)):
        slot_ids = torch.randint(-1, S + 2, (T, k), generator=g).int()
        check_alignment(slot_ids, S, block_m)
        check_alignment(slot_ids.long().t().contiguous().t(), S, block_m)
    print("interpreter ok")
""")


@pytest.mark.skipif(**INTERPRETER_SKIP)
def test_kernels_under_triton_interpreter() -> None:
    result = run_under_interpreter(_INTERPRETER_SCRIPT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "interpreter ok" in result.stdout


@pytest.mark.skipif(**INTERPRETER_SKIP)
def test_calls_over_some_of_a_layers_experts_give_the_whole_layers_bits_under_triton_interpreter() -> None:
    """A bank computes a prompt's pairs over its slots and staging buffers, each call seeing some of the
    layer's experts (the other pairs -1): told the layer's expert count, each call takes the tiles a
    call over the whole layer takes, so every pair row has the bits of full residency (rows per slot
    alone would pick other tiles here: half the experts, twice the rows)."""
    result = run_under_interpreter("""
        import torch
        from moestream.kernels.fused_moe_triton import fused_moe_with_config, select_config
        g = torch.Generator().manual_seed(0)
        E, H, I, k, T = 8, 128, 128, 2, 48
        gate_up, down = torch.randn(E, 2 * I, H, generator=g) * 0.1, torch.randn(E, H, I, generator=g) * 0.1
        hidden = torch.randn(T, H, generator=g)
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        w = torch.rand(T, k, generator=g)
        assert select_config(T, k, E) != select_config(T, k, E // 2)
        full = fused_moe_with_config(hidden, gate_up, down, ids, w, reduce=False, path="grouped")
        parts = []
        for lo in (0, E // 2):
            local = torch.where((ids >= lo) & (ids < lo + E // 2), ids - lo, -1)
            parts.append(fused_moe_with_config(hidden, gate_up[lo:lo + E // 2], down[lo:lo + E // 2], local, w,
                                               reduce=False, path="grouped", layer_experts=E))
        assert torch.equal(parts[0] + parts[1], full)
        print("interpreter ok")
    """)
    assert result.returncode == 0 and "interpreter ok" in result.stdout, result.stdout + result.stderr[-3000:]


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_cpu_tensors_are_refused_and_package_name_stays_the_function() -> None:
    import moestream.kernels as kernels

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("CPU tensors are allowed under the interpreter")
    hidden = torch.zeros(2, 32)
    with pytest.raises(ValueError, match="CUDA"):
        kernels.fused_moe(hidden, torch.zeros(4, 32, 32), torch.zeros(4, 32, 16),
                          torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, 2))
    # Loading the Triton modules must not replace the package's functions.
    import moestream.kernels.fused_moe_quant_triton  # noqa: F401
    import moestream.kernels.quant_linear_triton  # noqa: F401
    for name in ("fused_moe", "fused_moe_quant", "quant_linear"):
        assert callable(getattr(kernels, name)) and getattr(kernels, name).__module__ == "moestream.kernels"


# ------------------------------------------------- expert biases and the clamped SwiGLU (GPT-OSS)

def with_biases(inputs, seed: int):
    """The inputs plus per-slot gate_up (S, 2I) and down (S, H) biases of the same dtype."""
    hidden, gate_up, down = inputs[:3]
    g = torch.Generator(device=hidden.device.type).manual_seed(seed)
    S, two_i, H = gate_up.shape
    gate_up_bias = (torch.randn(S, two_i, generator=g, device=hidden.device) * 0.5).to(hidden.dtype)
    down_bias = (torch.randn(S, H, generator=g, device=hidden.device) * 0.5).to(hidden.dtype)
    return gate_up_bias, down_bias


def clamped_reference(inputs, biases, act) -> torch.Tensor:
    hidden, gate_up, down, slot_ids, weights = inputs
    return moe_reference(hidden.float(), gate_up.float(), down.float(), slot_ids, weights.float(), act,
                         biases[0].float(), biases[1].float())


@needs_cuda
@pytest.mark.parametrize("path", ["decode", "grouped"])
@pytest.mark.parametrize("T", [1, 3, 64])
def test_biases_and_clamped_swiglu_match_reference(T: int, path: str) -> None:
    """GPT-OSS-like experts (H = I, k = 4) in bf16: the clamp binds (limit 0.7), -1 slots skip
    their biases too, nothing is left unwritten."""
    from moestream.kernels.moe_reference import Activation

    H = I = 320
    inputs = make_inputs(T, H, I, 32, 4, torch.bfloat16, "cuda", seed=17 + T)
    biases = with_biases(inputs, T)
    act = Activation("swiglu_clamped", alpha=1.702, limit=0.7)
    poison_allocator(T, 4, H, I, torch.bfloat16)
    out = fused(inputs, path, activation=act, gate_up_bias=biases[0], down_bias=biases[1])
    assert not out.isnan().any()
    want = clamped_reference(inputs, biases, act)
    assert rel_err(out, want) < 1e-2
    assert rel_err(clamped_reference(inputs, biases, Activation("swiglu_clamped", 1.702, 1e4)), want) > 5e-2


_INTERPRETER_BIAS_SCRIPT = textwrap.dedent("""
    import torch
    from moestream.kernels.fused_moe_triton import fused_moe_with_config
    from moestream.kernels import moe_reference
    from moestream.kernels.moe_reference import Activation

    g = torch.Generator().manual_seed(0)
    for T, H, I, S, k, dtype in ((1, 40, 24, 5, 3, torch.float32), (9, 64, 32, 4, 2, torch.float16),
                                 (20, 48, 40, 6, 4, torch.float32)):
        hidden = torch.randn(T, H, generator=g).to(dtype)
        gate_up = (torch.randn(S, 2 * I, H, generator=g) / H ** 0.5).to(dtype)
        down = (torch.randn(S, H, I, generator=g) / I ** 0.5).to(dtype)
        gate_up_bias = (torch.randn(S, 2 * I, generator=g) * 0.5).to(dtype)
        down_bias = (torch.randn(S, H, generator=g) * 0.5).to(dtype)
        slot_ids = torch.randint(0, S, (T, k), generator=g)
        slot_ids[torch.rand(T, k, generator=g) < 0.25] = -1
        weights = torch.rand(T, k, generator=g)
        weights[slot_ids < 0] = float("nan")
        slot_ids = slot_ids.int()
        # GPT-OSS's clamped SwiGLU and the plain one with biases; Gemma 4's GeGLU with and without them
        runs = [(Activation("swiglu_clamped", 1.3, 0.6), True), (Activation("swiglu"), True),
                (Activation("geglu_tanh"), True), (Activation("geglu_tanh"), False)]
        for act, biased in runs:
            biases = (gate_up_bias, down_bias) if biased else (None, None)
            ref = moe_reference(hidden.float(), gate_up.float(), down.float(), slot_ids, weights, act,
                                *(b.float() if b is not None else None for b in biases))
            tol = 1e-5 if dtype == torch.float32 else 3e-3
            for path in ("decode", "grouped"):
                out = fused_moe_with_config(hidden, gate_up, down, slot_ids, weights, act, path=path,
                                            gate_up_bias=biases[0], down_bias=biases[1])
                err = float((out.float() - ref).norm() / ref.norm())
                assert not out.isnan().any() and err < tol, (T, act, biased, path, err)
    print("interpreter ok")
""")


@needs_cuda
@pytest.mark.parametrize("path", ["decode", "grouped"])
@pytest.mark.parametrize("T", [1, 3, 64])
def test_geglu_tanh_matches_reference(T: int, path: str) -> None:
    """Gemma 4-like experts (no biases, k = 8, I a quarter of H) in bf16: the kernel's gelu_tanh(gate) * up
    against the reference's fp32 torch gelu(approximate="tanh"), -1 slots skipped; a SwiGLU epilogue
    would be far off, so the activation really is the one asked for."""
    from moestream.kernels.moe_reference import Activation

    inputs = make_inputs(T, 320, 80, 32, 8, torch.bfloat16, "cuda", seed=29 + T)
    act = Activation("geglu_tanh")
    poison_allocator(T, 8, 320, 80, torch.bfloat16)
    out = fused(inputs, path, activation=act)
    assert not out.isnan().any()
    hidden, gate_up, down, slot_ids, weights = inputs
    want = moe_reference(hidden.float(), gate_up.float(), down.float(), slot_ids, weights.float(), act)
    assert rel_err(out, want) < 1e-2
    swiglu = moe_reference(hidden.float(), gate_up.float(), down.float(), slot_ids, weights.float(), "swiglu")
    assert rel_err(swiglu, want) > 5e-2


@pytest.mark.skipif(**INTERPRETER_SKIP)
def test_biases_and_clamped_swiglu_under_triton_interpreter() -> None:
    result = run_under_interpreter(_INTERPRETER_BIAS_SCRIPT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "interpreter ok" in result.stdout
