"""The gated delta rule (Gated DeltaNet's token mixer) in plain torch: the reference both forms are held to.

Per head, a state S (Dk × Dv) carries the whole past. For each token t, with decay g_t <= 0 (log
space), write strength beta_t in (0, 1), key k_t, value v_t and query q_t:

    S   <- exp(g_t) · S                       forget a little of everything
    S   <- S + k_t ⊗ beta_t (v_t - Sᵀ k_t)    write v_t at k_t, replacing what k_t read (the delta rule)
    o_t  = Sᵀ q_t

`gated_delta_step` is that update for one token (decode: every row of the batch at once, each
with its own state). `chunk_gated_delta_rule` computes the same outputs and final state for a
whole sequence in chunks of C tokens (prefill): inside a chunk the sequential writes are folded
into one lower-triangular solve (the UT transform), so a chunk costs O(C²·D + C·D²) matrix work
instead of C dependent steps, and only the chunk-to-chunk state update is sequential.
`recurrent_gated_delta_rule` loops the step over a sequence: the definition, for tests.

`l2_normalise` is how q and k are normalised before any of them (`kernels.delta_rule` calls
these forms, or flash-linear-attention's kernels on CUDA).

Contract for all three: fp32 tensors, heads already expanded to the value heads, q and k already
normalised and q already scaled (the mixer does that); shapes q, k (B, H, L, Dk), v (B, H, L, Dv),
g, beta (B, H, L), state (B, H, Dk, Dv). Nothing here reads a value back to the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK = 64


def l2_normalise(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum x² + eps) over the last dim, as transformers (and FLA) normalise q and k."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                     state: Tensor) -> tuple[Tensor, Tensor]:
    """One token: q, k (B, H, Dk), v (B, H, Dv), g, beta (B, H), state (B, H, Dk, Dv) →
    (output (B, H, Dv), new state). The input state is not modified."""
    state = state * g.exp()[..., None, None]
    read = (state * k[..., None]).sum(dim=-2)                     # Sᵀ k: what k retrieves now
    delta = (v - read) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(dim=-2), state


def recurrent_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                               state: Tensor) -> tuple[Tensor, Tensor]:
    """The definition: `gated_delta_step` token after token. Output (B, H, L, Dv), final state."""
    out = []
    for t in range(q.shape[2]):
        o, state = gated_delta_step(q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t], beta[:, :, t], state)
        out.append(o)
    return torch.stack(out, dim=2), state


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                           chunk_size: int = CHUNK) -> tuple[Tensor, Tensor]:
    """The whole sequence in chunks of `chunk_size`, continuing from `state`: output (B, H, L, Dv)
    and the state after the last token. Agrees with `recurrent_gated_delta_rule` up to rounding.

    Padding the length to a multiple of the chunk with g = 0, beta = 0, k = 0 leaves the state as it
    is (no decay, no write), so the final state is that of the last real token.
    """
    B, H, L, Dk = k.shape
    Dv = v.shape[-1]
    pad = (-L) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (L + pad) // chunk_size
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(B, H, n, chunk_size, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    decay = g.reshape(B, H, n, chunk_size).cumsum(dim=-1)          # log of the decay from the chunk start
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    # pairwise[i, j] = decay from token j to token i (i >= j), 0 above the diagonal (exp(-inf)).
    pairwise = (decay[..., :, None] - decay[..., None, :]).masked_fill(upper, float("-inf")).exp()
    # UT transform: (I + strictly-lower(beta_i k_i·k_j decay_ij)) folds the chunk's sequential writes.
    system = (k_beta @ k.transpose(-1, -2)) * pairwise
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    keys_read = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False, unitriangular=True)
    within = (q @ k.transpose(-1, -2)) * pairwise                  # causal attention inside the chunk
    q_decayed = q * decay.exp()[..., None]
    k_to_end = k * (decay[..., -1:] - decay).exp()[..., None]      # each key decayed to the chunk's end
    chunk_decay = decay[..., -1].exp()[..., None, None]
    state = state.to(v.dtype)
    out = torch.empty(B, H, n, chunk_size, Dv, dtype=v.dtype, device=v.device)
    for i in range(n):
        new = values[:, :, i] - keys_read[:, :, i] @ state         # what each write adds beyond the old state
        out[:, :, i] = q_decayed[:, :, i] @ state + within[:, :, i] @ new
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ new
    return out.reshape(B, H, n * chunk_size, Dv)[:, :, :L], state
