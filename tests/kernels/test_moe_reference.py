"""moe_reference against the definition, evaluated naively in float64 (CPU, runs in CI)."""

from __future__ import annotations

import pytest
import torch

from moestream.kernels import moe_reference
from moestream.kernels.moe_reference import Activation


def naive_moe(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
              slot_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The definition, one token and one routed expert at a time, in float64."""
    T, H = hidden.shape
    I = down.shape[2]
    S = gate_up.shape[0]
    out = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        x = hidden[t].double()
        for j in range(slot_ids.shape[1]):
            s = int(slot_ids[t, j])
            if s < 0 or s >= S:
                continue
            h = gate_up[s].double() @ x
            gate, up = h[:I], h[I:]
            act = torch.nn.functional.silu(gate) * up
            out[t] += float(weights[t, j]) * (down[s].double() @ act)
    return out


def make_inputs(T: int, H: int, I: int, S: int, k: int, dtype: torch.dtype, seed: int,
                unrouted: float = 0.2, slot_dtype: torch.dtype = torch.int64):
    """Fresh random inputs; scaled so every stage stays O(1). About `unrouted` of slots are -1."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(dtype)
    gate_up = (torch.randn(S, 2 * I, H, generator=g) / H ** 0.5).to(dtype)
    down = (torch.randn(S, H, I, generator=g) / I ** 0.5).to(dtype)
    slot_ids = torch.randint(0, S, (T, k), generator=g)
    slot_ids[torch.rand(T, k, generator=g) < unrouted] = -1
    weights = torch.rand(T, k, generator=g)
    return hidden, gate_up, down, slot_ids.to(slot_dtype), weights


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))


@pytest.mark.parametrize("T", [1, 2, 37])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_fp32_matches_naive(T: int, slot_dtype: torch.dtype) -> None:
    # S=5 with k=4 forces duplicate slots across tokens (and often within a token).
    inputs = make_inputs(T, H=48, I=20, S=5, k=4, dtype=torch.float32, seed=T,
                         slot_dtype=slot_dtype)
    out = moe_reference(*inputs)
    assert out.dtype == torch.float32 and out.shape == (T, 48)
    assert rel_err(out, naive_moe(*inputs)) < 1e-5


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
def test_half_precision_matches_naive(dtype: torch.dtype, tol: float) -> None:
    inputs = make_inputs(37, H=64, I=32, S=7, k=3, dtype=dtype, seed=11)
    out = moe_reference(*inputs)
    assert out.dtype == dtype
    assert rel_err(out, naive_moe(*inputs)) < tol


def test_weights_in_hidden_dtype() -> None:
    hidden, gate_up, down, slot_ids, weights = make_inputs(9, 32, 16, 4, 2, torch.bfloat16, 3)
    weights = weights.to(torch.bfloat16)
    out = moe_reference(hidden, gate_up, down, slot_ids, weights)
    assert rel_err(out, naive_moe(hidden, gate_up, down, slot_ids, weights)) < 2e-2


def test_unrouted_slots_contribute_nothing() -> None:
    hidden, gate_up, down, slot_ids, weights = make_inputs(6, 32, 16, 4, 3, torch.float32, 5,
                                                           unrouted=0.0)
    base = moe_reference(hidden, gate_up, down, slot_ids, weights)
    # Add a -1 position and an out-of-range slot whose weights are NaN: nothing changes
    # (they are skipped, not multiplied by zero).
    extra = torch.tensor([[-1, 99]] * 6)
    out = moe_reference(hidden, gate_up, down, torch.cat([slot_ids, extra], 1),
                        torch.cat([weights, torch.full((6, 2), float("nan"))], 1))
    torch.testing.assert_close(out, base)
    all_missing = torch.full_like(slot_ids, -1)
    assert torch.equal(moe_reference(hidden, gate_up, down, all_missing, weights),
                       torch.zeros(6, 32))


def test_duplicate_slot_within_token_counts_twice() -> None:
    hidden, gate_up, down, _, _ = make_inputs(3, 32, 16, 4, 1, torch.float32, 7)
    once = moe_reference(hidden, gate_up, down, torch.tensor([[2], [0], [3]]), torch.ones(3, 1))
    twice = moe_reference(hidden, gate_up, down, torch.tensor([[2, 2], [0, 0], [3, 3]]),
                          torch.ones(3, 2))
    torch.testing.assert_close(twice, 2 * once)


def test_empty_batch() -> None:
    hidden, gate_up, down, slot_ids, weights = make_inputs(0, 32, 16, 4, 2, torch.float32, 1)
    assert moe_reference(hidden, gate_up, down, slot_ids, weights).shape == (0, 32)


def test_activation_names() -> None:
    inputs = make_inputs(2, 32, 16, 4, 2, torch.float32, 2)
    # a bare name takes the activation's default parameters (GPT-OSS's alpha 1.702 and limit 7)
    torch.testing.assert_close(moe_reference(*inputs, activation="swiglu_clamped"),
                               moe_reference(*inputs, activation=Activation("swiglu_clamped", 1.702, 7.0)))
    with pytest.raises(ValueError, match="unknown MoE activation"):
        moe_reference(*inputs, activation="gelu_tanh_typo")
    with pytest.raises(ValueError, match="unknown MoE activation"):
        moe_reference(*inputs, activation=Activation("gelu_tanh_typo"))


def naive_clamped_moe(hidden, gate_up, down, slot_ids, weights, gate_up_bias, down_bias, alpha, limit):
    """GPT-OSS's expert, one token and one routed expert at a time, in float64: biases on both
    products, the gate clamped above and up on both sides at `limit`, (up + 1) * gate * sigmoid(alpha * gate)."""
    T, H = hidden.shape
    I, S = down.shape[2], gate_up.shape[0]
    out = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(slot_ids.shape[1]):
            s = int(slot_ids[t, j])
            if s < 0 or s >= S:
                continue
            h = gate_up[s].double() @ hidden[t].double() + gate_up_bias[s].double()
            gate, up = h[:I].clamp(max=limit), h[I:].clamp(-limit, limit)
            act = (up + 1) * gate * torch.sigmoid(alpha * gate)
            out[t] += float(weights[t, j]) * (down[s].double() @ act + down_bias[s].double())
    return out


def clamped_inputs(T: int, H: int, I: int, S: int, k: int, dtype: torch.dtype, seed: int):
    hidden, gate_up, down, slot_ids, weights = make_inputs(T, H, I, S, k, dtype, seed)
    g = torch.Generator().manual_seed(seed + 100)
    gate_up_bias = (torch.randn(S, 2 * I, generator=g) * 0.5).to(dtype)
    down_bias = (torch.randn(S, H, generator=g) * 0.5).to(dtype)
    return hidden, gate_up, down, slot_ids, weights, gate_up_bias, down_bias


@pytest.mark.parametrize("T", [1, 5, 37])
def test_biases_and_clamped_swiglu_match_naive(T: int) -> None:
    inputs = clamped_inputs(T, H=48, I=20, S=5, k=4, dtype=torch.float32, seed=T)
    act = Activation("swiglu_clamped", alpha=1.3, limit=0.6)
    out = moe_reference(*inputs[:5], activation=act, gate_up_bias=inputs[5], down_bias=inputs[6])
    want = naive_clamped_moe(*inputs, alpha=1.3, limit=0.6)
    assert rel_err(out, want) < 1e-5
    # the clamp binds on these inputs: without it (a huge limit) the result differs
    unclamped = moe_reference(*inputs[:5], activation=Activation("swiglu_clamped", 1.3, 1e9),
                              gate_up_bias=inputs[5], down_bias=inputs[6])
    assert rel_err(unclamped, want) > 1e-2


def test_biases_of_unrouted_slots_are_not_added() -> None:
    hidden, gate_up, down, _, _, gate_up_bias, down_bias = clamped_inputs(4, 32, 16, 4, 1, torch.float32, 9)
    none = torch.full((4, 2), -1)
    out = moe_reference(hidden, gate_up, down, none, torch.ones(4, 2), "swiglu_clamped", gate_up_bias, down_bias)
    assert torch.equal(out, torch.zeros(4, 32))


def test_clamped_experts_match_transformers_gpt_oss_experts() -> None:
    """Our slot layout (gate rows, then up rows; de-interleaved from the checkpoint) through the
    reference gives transformers' GptOssExperts on its own (E, H, 2I) interleaved parameters."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    E, H, I, T, k = 6, 32, 16, 9, 2
    config = transformers.GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, swiglu_limit=0.5,
                                       swiglu_alpha=1.5)
    g = torch.Generator().manual_seed(3)
    experts = GptOssExperts(config)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    hidden = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g).softmax(-1)
    with torch.no_grad():
        want = experts(hidden, ids, weights)
        gate_up = torch.cat([experts.gate_up_proj[:, :, 0::2], experts.gate_up_proj[:, :, 1::2]], 2).transpose(1, 2)
        bias = torch.cat([experts.gate_up_proj_bias[:, 0::2], experts.gate_up_proj_bias[:, 1::2]], 1)
        out = moe_reference(hidden, gate_up.contiguous(), experts.down_proj.transpose(1, 2).contiguous(), ids, weights,
                            Activation("swiglu_clamped", 1.5, 0.5), bias, experts.down_proj_bias)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


def test_bias_shape_errors_name_the_tensor() -> None:
    hidden, gate_up, down, slot_ids, weights, gate_up_bias, down_bias = clamped_inputs(2, 32, 16, 4, 2,
                                                                                       torch.float32, 2)
    with pytest.raises(ValueError, match="gate_up_bias"):
        moe_reference(hidden, gate_up, down, slot_ids, weights, "swiglu", gate_up_bias[:, :8], down_bias)
    with pytest.raises(ValueError, match="down_bias"):
        moe_reference(hidden, gate_up, down, slot_ids, weights, "swiglu", gate_up_bias, down_bias[:, :8])
    with pytest.raises(ValueError, match="both or neither"):
        moe_reference(hidden, gate_up, down, slot_ids, weights, "swiglu", gate_up_bias, None)


def test_shape_errors_name_the_tensor() -> None:
    hidden, gate_up, down, slot_ids, weights = make_inputs(2, 32, 16, 4, 2, torch.float32, 2)
    with pytest.raises(ValueError, match="down"):
        moe_reference(hidden, gate_up, down[:, :, :8], slot_ids, weights)
    with pytest.raises(ValueError, match="weights"):
        moe_reference(hidden, gate_up, down, slot_ids, weights[:, :1])
    with pytest.raises(ValueError, match="slot_ids"):
        moe_reference(hidden, gate_up, down, slot_ids.float(), weights)


def test_package_import_does_not_import_triton() -> None:
    """Nor does importing the engine, the hybrid policy's hand-off or a follower rank's module: a
    process that never launches a kernel (the CLI, a follower, a CPU run) does not load Triton."""
    import subprocess
    import sys

    code = ("import sys, moestream.kernels as k; "
            "assert 'triton' not in sys.modules, 'importing moestream.kernels imported triton'; "
            "assert callable(k.fused_moe) and callable(k.fused_moe_available); "
            "import moestream.engine.follower, moestream.kernels.handoff; "
            "assert 'triton' not in sys.modules, 'importing the engine imported triton'")
    subprocess.run([sys.executable, "-c", code], check=True, env=_env_with_repo_on_path())


def _env_with_repo_on_path() -> dict[str, str]:
    import os
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
    return env
