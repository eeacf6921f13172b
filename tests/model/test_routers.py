"""The sigmoid_grouped router (GLM-4.5, DeepSeek-V3) against transformers' own router module, and
the two rules that are easy to get wrong: the correction bias chooses but never weighs, and groups
are ranked by their best two experts."""

import pytest
import torch
import transformers
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

from moestream.archs import ARCHS, model_config_from_hf
from moestream.model.routers import ROUTERS, SigmoidGrouped

HIDDEN = 32


def _raw(**overrides) -> dict:
    """A minimal glm4_moe config.json."""
    return {"model_type": "glm4_moe", "vocab_size": 64, "hidden_size": HIDDEN, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48,
            "moe_intermediate_size": 16, **overrides}


def _routers(seed: int, **overrides) -> tuple[SigmoidGrouped, Glm4MoeTopkRouter]:
    """Ours and transformers' for the same config, holding the same random weight and bias."""
    raw = _raw(**overrides)
    ours = ROUTERS["sigmoid_grouped"](model_config_from_hf(raw, ARCHS["glm4_moe"]))
    theirs = Glm4MoeTopkRouter(transformers.Glm4MoeConfig(**raw))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(theirs.weight.shape, generator=gen) * 0.5)
        theirs.e_score_correction_bias.copy_(torch.randn(theirs.e_score_correction_bias.shape, generator=gen) * 0.3)
    ours.load_state_dict({"weight": theirs.weight, "e_score_correction_bias": theirs.e_score_correction_bias})
    return ours, theirs


def _by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both sorted by expert id per token: transformers returns its top-k unsorted."""
    ids, order = ids.sort(dim=-1)
    return weights.gather(-1, order), ids


CASES = [
    dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5),
    dict(n_routed_experts=16, num_experts_per_tok=3, n_group=8, topk_group=3, norm_topk_prob=False),
    dict(n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=1.8),
    dict(n_routed_experts=12, num_experts_per_tok=4, n_group=1, topk_group=1),   # GLM-4.5's own setting
]


@pytest.mark.parametrize("case", CASES)
def test_routing_equals_transformers_router(case):
    ours, theirs = _routers(0, **case)
    h = torch.randn(257, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, want_w, want_ids = theirs(h)
        got_w, got_ids = ours(h)
    assert got_w.dtype == torch.float32 and got_ids.shape == (257, case["num_experts_per_tok"])
    assert torch.equal(ours.logits(h), logits)
    want_w, want_ids = _by_id(want_w, want_ids)
    got_w, got_ids = _by_id(got_w, got_ids)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)
    assert torch.equal(ours.predict(h).sort(-1).values, got_ids)   # prefetch predicts the real choice


def test_the_correction_bias_chooses_but_does_not_weigh():
    ours, _ = _routers(2, n_routed_experts=8, num_experts_per_tok=2, routed_scaling_factor=2.0)
    scores = torch.tensor([[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2]])
    logits = torch.logit(scores)
    with torch.no_grad():
        ours.e_score_correction_bias.zero_()
        ours.e_score_correction_bias[7] = 1.0   # the weakest expert now wins the choice
        weights, ids = ours.select(logits)
    assert sorted(ids[0].tolist()) == [0, 7]
    # its weight is its own, unbiased score, renormalised with expert 0's, then scaled
    expected = {0: 0.9 / 1.1 * 2.0, 7: 0.2 / 1.1 * 2.0}
    for w, e in zip(weights[0].tolist(), ids[0].tolist()):
        assert w == pytest.approx(expected[e], rel=1e-6)


def test_groups_are_ranked_by_their_best_two_experts():
    ours, _ = _routers(3, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1)
    # group 0 holds the single best expert (0.95) but group 1 the better pair (0.7 + 0.7 > 0.95 + 0.2)
    scores = torch.tensor([[0.95, 0.2, 0.1, 0.1, 0.7, 0.7, 0.1, 0.1],
                           [0.95, 0.5, 0.1, 0.1, 0.7, 0.7, 0.1, 0.1]])   # here group 0's pair wins
    with torch.no_grad():
        ours.e_score_correction_bias.zero_()
        _, ids = ours.select(torch.logit(scores))
    assert sorted(ids[0].tolist()) == [4, 5]
    assert sorted(ids[1].tolist()) == [0, 1]


def test_experts_outside_the_kept_groups_are_never_chosen():
    ours, _ = _routers(4, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2)
    h = torch.randn(500, HIDDEN, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        _, ids = ours(h)
    groups_used = torch.stack([(torch.bincount(row // 4, minlength=4) > 0).sum() for row in ids])
    assert groups_used.max() <= 2 and groups_used.min() >= 1
    assert (groups_used == 2).any()   # the test would pass vacuously if tokens used one group only


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_routing_reads_nothing_back_on_the_gpu():
    ours, _ = _routers(6, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2)
    ours = ours.cuda()
    h = torch.randn(64, HIDDEN, device="cuda")
    ours(h)   # warm-up: first calls may initialise kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ours(h)
        ours.predict(h)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_the_selection_bias_stays_fp32_in_a_bf16_engine(tiny_checkpoints):
    import moestream

    engine = moestream.load(tiny_checkpoints["glm4_moe"][0], device="cpu", dtype="bfloat16")
    routers = [block.router for block in engine.model.moe_blocks()]
    assert routers and all(r.e_score_correction_bias.dtype == torch.float32 for r in routers)
    assert all(r.weight.dtype == torch.bfloat16 for r in routers)
