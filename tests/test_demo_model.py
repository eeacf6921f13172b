"""The bundled demo model: same logits as transformers, the model card's perplexity, a working default."""

import json
import math

import pytest
import torch

import moestream
from moestream.cli import DEMO_MODEL, main as cli_main
from moestream.runtime.perplexity import sliding_window_scores

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


def test_the_model_cards_perplexity_is_the_recorded_one_over_every_token_of_the_sample(engine):
    """The card's figure is the one training recorded (fp32, transformers eager: the reference the logits
    tests above hold moestream to), scored over every token of the shipped sample after the first, which
    is what the sliding windows of `moestream perplexity` score (checked here with uniform logits, whose
    perplexity is the vocabulary's size; the CLI's own figure is checked against the reference below)."""
    stats = json.loads((DEMO_MODEL / "training_stats.json").read_text())["evaluation"]
    assert f"{stats['perplexity']:.3f}" in (DEMO_MODEL / "MODEL_CARD.md").read_text()
    ids = heldout_ids(engine)
    assert len(ids) == stats["heldout_sample_tokens"]
    assert engine.max_context == stats["window"] == 2 * stats["stride"]
    vocab = 7   # which tokens does not matter to the count: the sample's, folded into a small vocabulary
    uniform = sliding_window_scores(lambda chunk: torch.zeros(1, chunk.shape[1], vocab), [t % vocab for t in ids],
                                    engine.max_context)
    assert uniform.tokens == stats["scored_tokens"] == len(ids) - 1
    assert abs(uniform.perplexity - vocab) <= 1e-6 * vocab


def test_perplexity_matches_the_model_card(engine, reference, tmp_path, capsys):
    """`moestream perplexity` on the held-out sample's first windows gives the perplexity transformers
    gives, computed here window by window as the card's figure was (window 1024, stride 512, each token
    scored once with the context of its window); the whole sample's figure is checked above."""
    window, stride = engine.max_context, engine.max_context // 2
    sample = tmp_path / "prefix.txt"
    sample.write_text((DEMO_MODEL / "heldout_sample.txt").read_text()[:8000])
    prefix = engine.tokenizer(sample.read_text(), add_special_tokens=False).input_ids
    assert 2 * window < len(prefix) < 3 * window   # three windows, the last one short
    nll, scored, prev_end = 0.0, 0, 0
    with torch.no_grad():
        for begin in range(0, len(prefix), stride):
            end = min(begin + window, len(prefix))
            logits = reference(torch.tensor([prefix[begin:end]])).logits[0]
            first = prev_end - begin   # the positions before it were scored by the previous window
            targets = torch.tensor(prefix[begin + max(first, 1):end])
            nll += float(torch.nn.functional.cross_entropy(logits[max(first, 1) - 1:-1], targets, reduction="sum"))
            scored, prev_end = scored + len(targets), end
            if end == len(prefix):
                break
    expected = math.exp(nll / scored)
    assert scored == len(prefix) - 1
    assert cli_main(["perplexity", "--file", str(sample), "--device", "cpu", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tokens"] == scored and result["window"] == window
    assert abs(result["perplexity"] - expected) / expected <= 1e-4


def heldout_ids(engine) -> list[int]:
    return engine.tokenizer((DEMO_MODEL / "heldout_sample.txt").read_text(), add_special_tokens=False).input_ids


def test_run_without_model_uses_the_demo(capsys):
    assert cli_main(["run", "-p", "def fibonacci(n):", "--max-tokens", "24", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert len(out.strip()) > 0


def test_perplexity_rejects_a_missing_file(tmp_path, capsys):
    assert cli_main(["perplexity", "--file", str(tmp_path / "nope.py"), "--device", "cpu"]) == 1
    assert capsys.readouterr().err.startswith("moestream: error:")
