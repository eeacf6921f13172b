"""Checks of the two-launch top-k draw (sampling_triton.py) against `draw_top_k_reference`; one body
for the GPU test (compiled) and the CPU test (Triton's interpreter)."""

from __future__ import annotations

import torch

from moestream.kernels.sampling_triton import CHUNK, sample_top_k, takes_kernel
from moestream.runtime.sampling import SamplingParams, draw_top_k_reference

# (vocab, k, temperature, top_p, min_p): whole and partial chunks, a last chunk shorter than k, the
# filters alone and together
CASES = ((3000, 20, 0.7, 0.8, 0.0), (2 * CHUNK + 7, 12, 1.0, 1.0, 0.05), (CHUNK + 5, 9, 0.6, 0.95, 0.02),
         (500, 40, 1.3, 0.9, 0.0))


def check_draw(device: str, dtype: torch.dtype, V: int, k: int, temperature: float, top_p: float, min_p: float,
               rows: int = 64) -> None:
    params = SamplingParams(temperature=temperature, top_k=k, top_p=top_p, min_p=min_p)
    params.validate()
    assert takes_kernel(V, k)
    g = torch.Generator().manual_seed(V + k)
    logits = (torch.randn(rows, V, generator=g) * 3).to(device, dtype)
    logits[:, :50] = float("-inf")                       # never drawn, never in the way
    uniform = torch.rand(rows, generator=g).to(device)
    uniform[0], uniform[1] = 0.0, 1.0 - 2 ** -24         # the best token; the last one kept
    got = sample_top_k(logits, k, temperature, top_p, min_p, uniform)
    want = draw_top_k_reference(logits, params, uniform)
    assert got.shape == (rows,) and got.dtype == torch.int64
    assert int(got[0]) == int(logits[0].float().argmax())
    # equal logits (common in bf16) may rank in another order than torch.topk's: compare the drawn logits
    picked = logits.float().gather(1, torch.stack([got, want], 1))
    same = (picked[:, 0] == picked[:, 1]).float().mean().item()
    assert same >= 0.97, (V, k, same)                     # a rounding at a boundary may move a draw
    assert picked[1, 0] == picked[1, 1], "the last token kept"

    # ties: equal logits rank by index, as the keys pack them; the k best of a row full of ties
    flat = torch.zeros(2, V, device=device, dtype=dtype)
    flat[1, V - 3:] = 1.0                                # three best at the row's end, past a chunk's start
    u = torch.tensor([0.0, 0.0], device=device)
    tied = sample_top_k(flat, k, temperature, 1.0, 0.0, u)
    assert tied.tolist() == [0, V - 3]


def check_all(device: str, dtypes: tuple[torch.dtype, ...], cases=CASES) -> None:
    for case in cases:
        for dtype in dtypes:
            check_draw(device, dtype, *case)
