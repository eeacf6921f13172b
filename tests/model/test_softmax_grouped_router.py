"""The softmax_grouped router (DeepSeek-V2) against transformers' DeepseekV2TopkRouter on random inputs,
greedy and group-limited, and the rule that is easy to get wrong: a group is ranked by its best expert."""

import pytest
import torch
import transformers
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

from moestream.archs import ARCHS, model_config_from_hf
from moestream.model.routers import ROUTERS, SoftmaxGrouped

HIDDEN = 32


def _raw(**overrides) -> dict:
    """A minimal deepseek_v2 config.json."""
    return {"model_type": "deepseek_v2", "vocab_size": 64, "hidden_size": HIDDEN, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 48,
            "moe_intermediate_size": 16, **overrides}


def _routers(seed: int, **overrides) -> tuple[SoftmaxGrouped, DeepseekV2TopkRouter]:
    """Ours and transformers' for the same config, holding the same random weight."""
    raw = _raw(**overrides)
    config = model_config_from_hf(raw, ARCHS["deepseek_v2"])
    assert ARCHS["deepseek_v2"].router == "softmax_grouped"
    ours = ROUTERS["softmax_grouped"](config)
    theirs = DeepseekV2TopkRouter(transformers.DeepseekV2Config(**raw))
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(theirs.weight.shape, generator=torch.Generator().manual_seed(seed)) * 0.5)
    ours.load_state_dict({"weight": theirs.weight})
    return ours, theirs


def _by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both sorted by expert id per token: transformers returns its top-k unsorted."""
    ids, order = ids.sort(dim=-1)
    return weights.gather(-1, order), ids


CASES = [
    dict(n_routed_experts=64, num_experts_per_tok=6, topk_method="greedy", routed_scaling_factor=1.0),  # V2-Lite
    dict(n_routed_experts=16, num_experts_per_tok=4, topk_method="greedy", n_group=4, topk_group=1),  # groups unused
    dict(n_routed_experts=16, num_experts_per_tok=4, topk_method="group_limited_greedy", n_group=4, topk_group=2,
         routed_scaling_factor=16.0),                                                                  # V2's shape
    dict(n_routed_experts=8, num_experts_per_tok=2, topk_method="group_limited_greedy", n_group=8, topk_group=3,
         routed_scaling_factor=2.5),                                                     # one expert a group
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


def test_groups_are_ranked_by_their_best_expert():
    ours, _ = _routers(2, n_routed_experts=8, num_experts_per_tok=2, topk_method="group_limited_greedy",
                       n_group=2, topk_group=1, routed_scaling_factor=2.0)
    # group 0 holds the single best expert, group 1 the better pair: V2 keeps group 0 (V3 would keep group 1)
    probs = torch.tensor([[0.30, 0.03, 0.02, 0.01, 0.20, 0.20, 0.12, 0.12]])
    weights, ids = ours.select(probs.log())
    assert sorted(ids[0].tolist()) == [0, 1]
    # unnormalised softmax scores, times routed_scaling_factor
    assert sorted(weights[0].tolist()) == pytest.approx([0.03 * 2.0, 0.30 * 2.0], rel=1e-5)


def test_greedy_ignores_the_groups_a_config_names():
    ours, _ = _routers(3, n_routed_experts=8, num_experts_per_tok=2, topk_method="greedy", n_group=2, topk_group=1)
    probs = torch.tensor([[0.30, 0.03, 0.02, 0.01, 0.20, 0.20, 0.12, 0.12]])
    assert sorted(ours.select(probs.log())[1][0].tolist()) == [0, 4]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_routing_reads_nothing_back_on_the_gpu():
    ours, _ = _routers(6, n_routed_experts=16, num_experts_per_tok=4, topk_method="group_limited_greedy",
                       n_group=4, topk_group=2)
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
