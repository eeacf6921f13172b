"""The fused small ops against the torch path: compiled on a GPU, under the interpreter on the CPU,
and the whole model with them against the model without them (GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fused_ops_checks import check_all
from triton_interpreter import INTERPRETER_SKIP, check_all_under_interpreter

from moestream.kernels import fused_moe_available

needs_cuda = pytest.mark.skipif(not fused_moe_available(), reason="needs CUDA and Triton")


@pytest.mark.skipif(**INTERPRETER_SKIP)
def test_fused_ops_under_interpreter():
    check_all_under_interpreter(Path(__file__).parent / "fused_ops_checks.py")


@needs_cuda
def test_fused_ops_on_gpu():
    check_all("cuda", (torch.float32, torch.bfloat16, torch.float16))


@needs_cuda
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen3_next", "gpt_oss", "glm4_moe"])
def test_model_with_fused_ops_matches_the_torch_ops(arch, tiny_checkpoints):
    """Every family whose layers use the fused ops: fp32 logits and greedy tokens (decode through
    CUDA graphs) the same with and without them."""
    import moestream
    from moestream.kernels import fused_ops

    folder = tiny_checkpoints[arch][0]
    ids = torch.randint(2, 160, (2, 21), generator=torch.Generator().manual_seed(3))
    prompts = [ids[0, :5].tolist(), ids[1].tolist()]
    with fused_ops(False):
        plain = moestream.load(folder, device="cuda", dtype="float32")
        ref_logits = plain.logits(ids).float()
        ref_tokens = plain.generate(prompts, max_tokens=12, ignore_eos=True)
    fused = moestream.load(folder, device="cuda", dtype="float32")
    logits = fused.logits(ids).float()
    assert (logits - ref_logits).abs().max() / ref_logits.abs().max() < 1e-4
    assert fused.generate(prompts, max_tokens=12, ignore_eos=True) == ref_tokens
