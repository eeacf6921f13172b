"""The two-launch top-k draw (the sampled decode step's last launches): compiled on a GPU, under the
interpreter on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


pytest.importorskip("triton", reason="the kernels are Triton code: install the test extra on Linux")
from sampling_checks import CASES, check_draw  # noqa: E402
from triton_interpreter import INTERPRETER_SKIP, run_checks_under_interpreter  # noqa: E402

from moestream.kernels import fused_moe_available  # noqa: E402
from moestream.kernels.sampling_triton import takes_kernel  # noqa: E402


def test_the_kernel_takes_the_common_top_k_and_leaves_large_ones_to_torch():
    assert takes_kernel(151936, 20) and takes_kernel(151936, 64) and takes_kernel(32000, 1)
    assert not takes_kernel(151936, 200), "more candidates than the draw holds"
    assert not takes_kernel(100, 100) and not takes_kernel(100, 0)


@pytest.mark.skipif(**INTERPRETER_SKIP)
def test_sampling_kernel_under_interpreter():
    """Two cases: several chunks with min-p, and top-p with a bf16 row's ties (the GPU test takes every
    case in two dtypes), each on 16 rows instead of 64: the interpreter runs every row's programs in
    Python, and the rows are alike but for their draws (rows 0 and 1, the best token and the last one
    kept, are among them; with 16 rows the 97 % agreement asks that every draw agree)."""
    run_checks_under_interpreter(Path(__file__).with_name("sampling_checks.py"), """
        check_draw("cpu", torch.float32, *CASES[1], rows=16)
        check_draw("cpu", torch.bfloat16, *CASES[0], rows=16)
    """, timeout=600)


@pytest.mark.skipif(not fused_moe_available(), reason="needs CUDA and Triton")
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sampling_kernel_on_gpu(case, dtype):
    check_draw("cuda", dtype, *case)


@pytest.mark.skipif(not fused_moe_available(), reason="needs CUDA and Triton")
def test_sampled_decode_draws_through_the_kernel_as_the_reference_does():
    """`sample` on CUDA: the kernel and the reference give the same tokens from the same seed."""
    from moestream.runtime.sampling import SamplingParams, draw_kernel, make_generator, sample

    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.8, seed=5)
    logits = torch.randn(8, 151936, generator=torch.Generator().manual_seed(0)).cuda() * 4
    got = sample(logits, params, make_generator(params, logits.device))
    with draw_kernel(False):
        want = sample(logits, params, make_generator(params, logits.device))
    assert torch.equal(got, want)


@pytest.mark.parametrize("vocab", [8192, 32000, 129280, 151936, 201088])
def test_one_draw_at_each_listed_top_k_meets_every_variant_a_top_k_can_take(vocab):
    """`top_k_variants` (what `Engine.warm_up` samples at): the least k of each padded width pair the draw is
    compiled for, so every k the two launches take shares its variant with a listed one."""
    from moestream.kernels.sampling_triton import _padded, takes_kernel, top_k_variants

    listed = top_k_variants(vocab)
    assert listed == sorted(set(listed)) and listed[0] == 1
    widths = {_padded(vocab, k): k for k in listed}
    assert len(widths) == len(listed)   # one k per variant
    k = 1
    while takes_kernel(vocab, k):
        assert _padded(vocab, k) in widths and widths[_padded(vocab, k)] <= k
        k += 1
    assert k > listed[-1] and not takes_kernel(vocab, k)
