"""The correctness oracle: our fp32 CPU logits and greedy tokens against transformers, per family."""

import pytest
import torch

import moestream
from tiny_models import ARCHS


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers_on_a_padded_batch(arch, tiny_checkpoints):
    folder, ref_model = tiny_checkpoints[arch]
    engine = moestream.load(folder, device="cpu", dtype="float32")
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 160, (2, 17), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0  # second sequence is shorter (right padding)
    with torch.no_grad():
        ref = ref_model(ids, attention_mask=mask).logits
    out = engine.logits(ids, mask)
    real = mask.bool()
    rel = (out - ref)[real].abs().max() / ref[real].abs().max()
    assert rel <= 1e-4, f"{arch}: max |diff| / max |ref| = {rel:.2e}"


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_transformers_generate(arch, tiny_checkpoints):
    folder, ref_model = tiny_checkpoints[arch]
    engine = moestream.load(folder, device="cpu", dtype="float32")
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 160, (n,), generator=gen).tolist() for n in (5, 13)]
    expected = []
    for p in prompts:
        out = ref_model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=32, min_new_tokens=32, do_sample=False)
        expected.append(out[0, len(p):].tolist())
    # one at a time, and both together in one batch of different lengths
    assert engine.generate(prompts[0], max_tokens=32, ignore_eos=True) == expected[0]
    assert engine.generate(prompts, max_tokens=32, ignore_eos=True) == expected


def test_prefill_in_chunks_equals_one_pass(tiny_qwen3):
    engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32")
    prompt = torch.randint(2, 160, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    whole = engine.generate(prompt, max_tokens=8, ignore_eos=True)
    engine.runner.prefill_chunk = 7
    assert engine.generate(prompt, max_tokens=8, ignore_eos=True) == whole
