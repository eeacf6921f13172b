"""flash-linear-attention's gated delta rule against the plain-torch reference on a GPU (skipped
without CUDA or without fla-core): both forms on fresh random bf16 inputs at Qwen3-Next's head
sizes (2 value heads per key head, Dk = Dv = 128), a state carried across calls, a left-padded
row, and the decode step captured in a CUDA graph.

Run with fla installed, this file and tests/model/test_qwen3_next_fla_gpu.py only: transformers
uses fla for its own Qwen3-Next layers whenever fla imports, on every device, so the suite's CPU
comparisons with transformers cannot run in that environment.
"""

from __future__ import annotations

import pytest
import torch

from moestream.kernels import delta_rule, fused_ops

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(not delta_rule.fla_available(), reason="needs flash-linear-attention (fla-core)")]

# bf16 inputs, fla's bf16 tiles against the reference's fp32 on the same inputs.
TOL = 2e-2


def mixer_inputs(B: int, L: int, seed: int, Hk: int = 2, Hv: int = 4, D: int = 128):
    """q, k, v as the conv gives them (bf16, unnormalised, key heads only), decays of every strength."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k = (torch.randn(B, L, Hk, D, generator=g, device="cuda").bfloat16() for _ in range(2))
    v = torch.randn(B, L, Hv, D, generator=g, device="cuda").bfloat16()
    strength = torch.tensor([0.01, 0.1, 1.0, 5.0], device="cuda")[torch.arange(Hv, device="cuda") % 4]
    decay = torch.nn.functional.logsigmoid(torch.randn(B, L, Hv, generator=g, device="cuda")) * strength
    beta = torch.rand(B, L, Hv, generator=g, device="cuda").bfloat16()
    state = torch.randn(B, Hv, D, D, generator=g, device="cuda") * 0.05
    return q, k, v, decay, beta, state


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def reference(*args):
    with fused_ops(False):
        return delta_rule.gated_delta_rule(*args)


@pytest.mark.parametrize("L", [1, 2, 63, 64, 150])
def test_fla_matches_the_reference_from_a_carried_state(L):
    args = mixer_inputs(3, L, seed=L)
    assert delta_rule.uses_fla(args[1], args[2])
    out, state = delta_rule.gated_delta_rule(*args)
    want, want_state = reference(*args)
    assert out.shape == want.shape and out.dtype == torch.bfloat16 and state.dtype == torch.float32
    assert rel(out, want) < TOL and rel(state, want_state) < TOL


def test_a_state_carried_across_calls_continues_the_sequence():
    """Prefill in two chunks (a boundary inside fla's chunk of 64), then two decode steps, against
    the reference over the whole sequence at once."""
    q, k, v, g, beta, state = mixer_inputs(2, 152, seed=7)
    parts = [(0, 100), (100, 150), (150, 151), (151, 152)]
    outs, s = [], state
    for lo, hi in parts:
        o, s = delta_rule.gated_delta_rule(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi], s)
        outs.append(o)
    want, want_state = reference(q, k, v, g, beta, state)
    assert rel(torch.cat(outs, dim=1), want) < TOL and rel(s, want_state) < TOL


def test_left_padding_stays_out_of_the_state():
    """A batch row whose first 40 positions are padding (zero q, k, v, as the mixer makes them, from
    a zero state) gives the outputs and final state of its real tokens run alone."""
    q, k, v, g, beta, _ = mixer_inputs(2, 130, seed=11)
    for t in (q, k, v):
        t[1, :40] = 0
    zero = torch.zeros(2, 4, 128, 128, device="cuda")
    out, state = delta_rule.gated_delta_rule(q, k, v, g, beta, zero)
    alone, alone_state = delta_rule.gated_delta_rule(q[1:, 40:], k[1:, 40:], v[1:, 40:], g[1:, 40:], beta[1:, 40:],
                                                     zero[1:])
    assert out[1, :40].abs().max() == 0
    assert rel(out[1:, 40:], alone) < TOL and rel(state[1:], alone_state) < TOL
    want, want_state = reference(q, k, v, g, beta, zero)
    assert rel(out, want) < TOL and rel(state, want_state) < TOL


def test_decode_step_replays_from_a_cuda_graph():
    """fla's recurrent step captured with static inputs, replayed on new values: the eager result."""
    static = mixer_inputs(4, 1, seed=3)
    delta_rule.gated_delta_rule(*static)   # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, state = delta_rule.gated_delta_rule(*static)
    for seed in (4, 5):
        fresh = mixer_inputs(4, 1, seed=seed)
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        want, want_state = delta_rule.gated_delta_rule(*fresh)
        assert torch.equal(out, want) and torch.equal(state, want_state)
