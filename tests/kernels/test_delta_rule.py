"""`kernels.delta_rule`, the gated delta rule as the mixer calls it: the reference path's grouped
heads, normalisation and layout against the per-token definition, and which path it chooses (the
CPU never runs flash-linear-attention, even where fla imports). fla against the reference on a GPU:
test_delta_rule_gpu.py."""

from __future__ import annotations

import pytest
import torch

from moestream.kernels import delta_rule


def mixer_inputs(B: int, L: int, Hk: int, Hv: int, Dk: int, Dv: int, seed: int, dtype=torch.float32):
    """What the mixer hands over: q, k straight from the conv (not normalised, key heads only)."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, L, Hk, Dk, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(B, L, Hv, Dv, generator=g).to(dtype)
    decay = -torch.rand(B, L, Hv, generator=g)
    beta = torch.rand(B, L, Hv, generator=g).to(dtype)
    state = torch.randn(B, Hv, Dk, Dv, generator=g) * 0.1
    return q, k, v, decay, beta, state


def definition(q, k, v, g, beta, state):
    """Token by token, value head j reading key head j // (Hv / Hk), q and k unit length, q / sqrt(Dk)."""
    B, L, Hk, Dk = q.shape
    Hv = v.shape[2]
    q, k = (torch.nn.functional.normalize(t.float(), dim=-1) for t in (q, k))
    state = state.clone()
    out = torch.empty(B, L, Hv, v.shape[-1])
    for t in range(L):
        for j in range(Hv):
            h = j // (Hv // Hk)
            s = state[:, j] * g[:, t, j].exp()[:, None, None]
            read = torch.einsum("bk,bkv->bv", k[:, t, h], s)
            s = s + k[:, t, h, :, None] * ((v[:, t, j].float() - read) * beta[:, t, j, None].float())[:, None, :]
            out[:, t, j] = torch.einsum("bk,bkv->bv", q[:, t, h] * Dk ** -0.5, s)
            state[:, j] = s
    return out, state


@pytest.mark.parametrize("L", [1, 70])
def test_reference_path_follows_the_definition_with_grouped_heads(L):
    q, k, v, g, beta, state = mixer_inputs(2, L, 2, 4, 16, 8, seed=L)
    before = state.clone()
    out, final = delta_rule.gated_delta_rule(q, k, v, g, beta, state)
    want, want_final = definition(q, k, v, g, beta, state)
    assert out.shape == (2, L, 4, 8) and out.dtype == v.dtype and final.dtype == torch.float32
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, want_final, atol=1e-5, rtol=1e-5)
    assert torch.equal(state, before)   # the caller's state is read, never written


def test_output_comes_back_in_the_values_dtype():
    q, k, v, g, beta, state = mixer_inputs(1, 5, 1, 2, 16, 16, seed=1, dtype=torch.bfloat16)
    out, final = delta_rule.gated_delta_rule(q, k, v, g, beta, state)
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32


def test_cpu_runs_the_reference_even_where_fla_imports(monkeypatch):
    monkeypatch.setattr(delta_rule, "fla_available", lambda: True)

    def no_fla(*args):
        raise AssertionError("flash-linear-attention called for CPU tensors")

    monkeypatch.setattr(delta_rule, "_fla", no_fla)
    q, k, v, g, beta, state = mixer_inputs(1, 3, 1, 2, 16, 16, seed=2, dtype=torch.bfloat16)
    assert not delta_rule.uses_fla(k, v)
    delta_rule.gated_delta_rule(q, k, v, g, beta, state)


def test_fla_is_chosen_only_for_half_precision_and_head_dims_its_kernels_take(monkeypatch):
    """The choice itself, with the device check answered as a CUDA tensor would answer it."""
    monkeypatch.setattr(delta_rule, "fla_available", lambda: True)
    monkeypatch.setattr(delta_rule, "fused_ops_enabled", lambda t: True)

    def chosen(dtype, Dk=128, Dv=128):
        return delta_rule.uses_fla(torch.empty(1, 1, 1, Dk, dtype=dtype), torch.empty(1, 1, 1, Dv, dtype=dtype))

    assert chosen(torch.bfloat16) and chosen(torch.float16) and chosen(torch.bfloat16, 16, 256)
    assert not chosen(torch.float32)                     # fp32 stays exact: the reference
    assert not chosen(torch.bfloat16, Dk=8) and not chosen(torch.bfloat16, Dv=24) and not chosen(torch.bfloat16, 512)
    monkeypatch.setattr(delta_rule, "fla_available", lambda: False)
    assert not chosen(torch.bfloat16)


def test_fla_is_unavailable_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU machine's answer")
    assert delta_rule.fla_available() is False
