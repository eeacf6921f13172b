"""What the memory plan holds for attention: a prompt chunk's mask and additive bias over the whole
context, and scores only where a mixer computes them itself (SDPA keeps none)."""

from __future__ import annotations

import pytest
import torch

import moestream
from moestream.archs import ARCHS
from moestream.model.context import prefill_context
from moestream.model.decoder import attention_workspace_bytes
from moestream.model.sink_attention import BLOCK_ELEMENTS, SinkAttention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_sdpa_models_chunk_holds_its_mask_and_bias_and_no_scores(tiny_qwen3, dtype):
    """The last chunk of a full context, as the runner builds it: the plan's figure is exactly the
    mask and bias that chunk's context allocates (a T × S × heads score tensor would be far more)."""
    engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32", max_context=96)
    config, spec = engine.config, ARCHS[engine.config.arch]
    S, T = 96, 32
    ctx = prefill_context(engine.runner.rotary_table(), engine.model.new_cache(1, S, dtype, torch.device("cpu")),
                          0, S - T, T, dtype)
    held = ctx.mask.nbytes + ctx.attn_bias.nbytes
    assert attention_workspace_bytes(config, spec, T, S, dtype) == held
    assert held < T * config.num_heads * S * 4
    assert attention_workspace_bytes(config, spec, 1, S, dtype) == 0   # one token: nothing to mask


def test_sink_attention_counts_its_block_of_scores(tiny_checkpoints):
    """GPT-OSS's sink attention computes its scores itself, a block of queries at a time (at most
    BLOCK_ELEMENTS scores): the plan holds that block on top of the mask, and no more for a longer
    chunk once a block is full."""
    config = moestream.load(tiny_checkpoints["gpt_oss"][0], device="cpu", dtype="float32").config
    spec = ARCHS[config.arch]
    mask = 64 * 128 * 5
    small = attention_workspace_bytes(config, spec, 64, 128, torch.float32)
    assert small - mask == 64 * config.num_heads * 128 * 8 + 64 * 128   # every score, twice, and the mask's block
    S = 1 << 16
    assert SinkAttention.score_bytes(config, 4096, S, torch.float32) == \
        SinkAttention.score_bytes(config, 16384, S, torch.float32) <= BLOCK_ELEMENTS * 9
