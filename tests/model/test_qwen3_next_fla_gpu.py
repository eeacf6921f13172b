"""The hybrid families' engine in bf16 on a GPU with flash-linear-attention's gated delta rule
against the same engine on the torch reference path (`fused_ops(False)`), skipped without CUDA or
fla-core. The tiny checkpoints get heads of 32 (fla's kernels need multiples of 16).

Run with fla installed, this file and tests/kernels/test_delta_rule_gpu.py only (see there why).
"""

from __future__ import annotations

import pytest
import torch

import moestream
from moestream.kernels import delta_rule, fused_ops
from tiny_models import make_tiny_checkpoint

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(not delta_rule.fla_available(), reason="needs flash-linear-attention (fla-core)")]

PROMPTS = [torch.randint(2, 160, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 150)]


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_moe"])
def folder(tmp_path_factory, request):
    out = tmp_path_factory.mktemp("fla") / request.param
    make_tiny_checkpoint(request.param, out, linear_key_head_dim=32, linear_value_head_dim=32)
    return out


@pytest.fixture(scope="module")
def reference_engine(folder):
    with fused_ops(False):   # the choice is made per call: every call on it needs the switch again
        return moestream.load(folder, device="cuda", dtype="bfloat16")


@pytest.fixture
def fla_calls(monkeypatch):
    """Sequence lengths of every call that reached fla."""
    calls, real = [], delta_rule._fla

    def counted(q, *args):
        calls.append(q.shape[1])
        return real(q, *args)

    monkeypatch.setattr(delta_rule, "_fla", counted)
    return calls


def test_logits_of_a_left_padded_batch_match_the_reference_path(folder, reference_engine, fla_calls):
    ids = torch.tensor([PROMPTS[1], PROMPTS[1][::-1]])
    mask = torch.ones_like(ids)
    mask[1, :50] = 0
    with fused_ops(False):
        want = reference_engine.logits(ids, mask).float()
    engine = moestream.load(folder, device="cuda", dtype="bfloat16")
    out = engine.logits(ids, mask).float()
    assert fla_calls and all(n == 150 for n in fla_calls)
    real = mask.bool().to(out.device)
    assert float((out - want)[real].norm() / want[real].norm()) < 3e-2
    assert (out.argmax(-1) == want.argmax(-1))[real].float().mean() >= 0.9


def test_greedy_tokens_decoded_through_cuda_graphs_are_the_reference_paths_choice(folder, reference_engine,
                                                                                   fla_calls):
    """Two prompts of different lengths decode together (rows at different positions) through the
    captured graphs; each generated token is the reference path's argmax over the same prefix, up to
    bf16 near-ties (within 3% of the row's largest logit)."""
    engine = moestream.load(folder, device="cuda", dtype="bfloat16")
    assert engine.runner.cuda_graphs
    generated = engine.generate(PROMPTS, max_tokens=16, ignore_eos=True)
    assert 1 in fla_calls and any(n > 1 for n in fla_calls)   # decode steps and prefill both ran fla
    for prompt, tokens in zip(PROMPTS, generated):
        with fused_ops(False):
            logits = reference_engine.logits(torch.tensor([prompt + tokens]))[0].float()
        rows = logits[len(prompt) - 1:-1]
        chosen = rows.gather(1, torch.tensor(tokens, device=rows.device)[:, None])[:, 0]
        best = rows.max(dim=1).values
        assert (chosen >= best - 3e-2 * rows.abs().max(dim=1).values).all(), (tokens, (best - chosen).tolist())
