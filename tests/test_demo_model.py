"""The bundled demo model: same logits as transformers, the model card's perplexity, a working default."""

import json

import pytest
import torch

import moestream
from moestream.cli import DEMO_MODEL, main as cli_main

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def engine():
    return moestream.load(DEMO_MODEL, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def reference():
    return transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32).eval()


def test_demo_logits_match_transformers(engine, reference):
    text = (DEMO_MODEL / "heldout_sample.txt").read_text()[:4000]
    ids = engine.tokenizer(text, add_special_tokens=False).input_ids
    batch = torch.tensor([ids[:300], ids[300:600]])
    with torch.no_grad():
        ref = reference(batch).logits
    out = engine.logits(batch)
    assert (out - ref).abs().max() / ref.abs().max() <= 1e-4


def test_demo_greedy_generation_matches_transformers(engine, reference):
    prompt = "def fibonacci(n):"
    ids = engine.tokenizer(prompt).input_ids
    with torch.no_grad():
        ref = reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
    ours = engine.generate(ids, max_tokens=24)
    assert ours == ref[:len(ours)] and len(ours) > 0
    assert engine.generate(prompt, max_tokens=24) == engine.tokenizer.decode(ours, skip_special_tokens=True)


def test_perplexity_matches_the_model_card(capsys):
    stats = json.loads((DEMO_MODEL / "training_stats.json").read_text())
    card = stats["evaluation"]["perplexity"]
    assert f"{card:.3f}" in (DEMO_MODEL / "MODEL_CARD.md").read_text()
    assert cli_main(["perplexity", "--file", str(DEMO_MODEL / "heldout_sample.txt"), "--device", "cpu", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert abs(result["perplexity"] - card) / card <= 0.01
    assert result["tokens"] == stats["evaluation"]["scored_tokens"]


def test_run_without_model_uses_the_demo(capsys):
    assert cli_main(["run", "-p", "def fibonacci(n):", "--max-tokens", "24", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert len(out.strip()) > 0


def test_perplexity_rejects_a_missing_file(tmp_path, capsys):
    assert cli_main(["perplexity", "--file", str(tmp_path / "nope.py"), "--device", "cpu"]) == 1
    assert capsys.readouterr().err.startswith("moestream: error:")
