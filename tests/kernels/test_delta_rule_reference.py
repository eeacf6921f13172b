"""The gated delta rule's two forms: chunked (prefill) and one token at a time (decode) agree."""

from __future__ import annotations

import pytest
import torch

from moestream.kernels.delta_rule_reference import (chunk_gated_delta_rule, gated_delta_step,
                                                     recurrent_gated_delta_rule)


def inputs(B: int, H: int, L: int, Dk: int, Dv: int, seed: int):
    """Normalised keys and scaled queries as the mixer hands them over; decays of every strength."""
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, H, L, Dk, generator=g), dim=-1) * Dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(B, H, L, Dk, generator=g), dim=-1)
    v = torch.randn(B, H, L, Dv, generator=g)
    decay = -torch.rand(B, H, L, generator=g) * torch.tensor([0.01, 0.3, 3.0])[torch.arange(H) % 3][None, :, None]
    beta = torch.rand(B, H, L, generator=g)
    state = torch.randn(B, H, Dk, Dv, generator=g)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("L", [1, 63, 64, 65, 200])
def test_chunked_equals_the_token_by_token_definition(L):
    q, k, v, g, beta, state = inputs(2, 3, L, 16, 8, seed=L)
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, state)
    want, want_final = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    assert out.shape == (2, 3, L, 8) and final.shape == state.shape
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, want_final, atol=1e-5, rtol=1e-5)


def test_chunk_size_does_not_change_the_result():
    q, k, v, g, beta, state = inputs(1, 3, 150, 16, 16, seed=5)
    out64, state64 = chunk_gated_delta_rule(q, k, v, g, beta, state)
    out16, state16 = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=16)
    torch.testing.assert_close(out16, out64, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state16, state64, atol=1e-5, rtol=1e-5)


def test_a_sequence_split_anywhere_continues_from_the_state():
    """Chunked prefill across steps: each piece starts from the state the previous one left."""
    q, k, v, g, beta, state = inputs(2, 3, 170, 8, 8, seed=7)
    whole, final = chunk_gated_delta_rule(q, k, v, g, beta, state)
    pieces, s = [], state
    for lo, hi in ((0, 50), (50, 51), (51, 130), (130, 170)):
        out, s = chunk_gated_delta_rule(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], g[:, :, lo:hi],
                                        beta[:, :, lo:hi], s)
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces, dim=2), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, final, atol=1e-5, rtol=1e-5)


def test_decode_steps_after_a_chunked_prefill_match_the_whole_sequence():
    q, k, v, g, beta, state = inputs(2, 2, 90, 8, 4, seed=11)
    whole, final = chunk_gated_delta_rule(q, k, v, g, beta, state)
    _, s = chunk_gated_delta_rule(q[:, :, :80], k[:, :, :80], v[:, :, :80], g[:, :, :80], beta[:, :, :80], state)
    for t in range(80, 90):
        before = s.clone()
        out, s_next = gated_delta_step(q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t], beta[:, :, t], s)
        assert torch.equal(s, before)   # the input state is left as it was (a repeated step is harmless)
        torch.testing.assert_close(out, whole[:, :, t], atol=1e-5, rtol=1e-5)
        s = s_next
    torch.testing.assert_close(s, final, atol=1e-5, rtol=1e-5)


def test_a_full_write_replaces_what_the_key_held():
    """beta = 1, no decay, a unit key: the state then returns exactly the value written at that key."""
    k = torch.zeros(1, 1, 4)
    k[..., 2] = 1.0
    state = torch.randn(1, 1, 4, 3)
    v = torch.tensor([[[1.0, -2.0, 3.0]]])
    out, state = gated_delta_step(k, k, v, torch.zeros(1, 1), torch.ones(1, 1), state)
    torch.testing.assert_close(out, v)
    torch.testing.assert_close(state[0, 0, 2], v[0, 0])
