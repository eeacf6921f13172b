"""Streaming detokenisation with a real byte-level BPE, and stop strings that never leak."""

from __future__ import annotations

import random

import pytest

from moestream.runtime.detokenize import IncrementalDetokenizer, StopStringFilter

TEXTS = [
    "héllo wörld 日本語 🙂",
    "hello world, hello again",
    "naïve café, déjà vu — voilà",
    "日本語のテキストです 🙂🙃👍🏽",
    "emoji 🙂 and ünïcödé ∑ x² ≠ y",
]


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE with few merges, so many multi-byte characters span several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=280, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<eos>"], show_progress=False)
    tok.train_from_iterator(TEXTS * 5, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def _stream(tokenizer, ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer)
    return [detok.add(t) for t in ids]


def test_the_tokenizer_splits_characters_across_tokens(tokenizer):
    """Guard: otherwise the tests below would not exercise partial characters."""
    ids = tokenizer("日本語 🙂", add_special_tokens=False).input_ids
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_of_real_text(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text
    pieces = _stream(tokenizer, ids)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    # and every prefix of the stream is a prefix of the text: nothing is ever taken back
    for n in range(len(ids)):
        assert text.startswith("".join(pieces[:n]))


def test_streamed_pieces_of_random_token_sequences(tokenizer):
    rng = random.Random(0)
    vocab = len(tokenizer)
    eos = tokenizer.eos_token_id
    complete = 0
    for _ in range(1500):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 16))]
        pieces = _stream(tokenizer, ids)
        streamed = "".join(pieces)
        full = tokenizer.decode(ids, skip_special_tokens=True)
        if full.endswith("\ufffd"):
            # the sequence stops inside a character: the pieces since the last complete one are held back
            assert full.startswith(streamed)
        else:
            complete += 1
            assert streamed == full
        if "\ufffd" not in full:
            assert not any("\ufffd" in p for p in pieces), (ids, pieces)
        assert eos is None or "<eos>" not in streamed
    assert complete > 500


def test_special_tokens_are_skipped(tokenizer):
    ids = tokenizer("hello world", add_special_tokens=False).input_ids
    eos = tokenizer.eos_token_id
    assert "".join(_stream(tokenizer, ids[:2] + [eos] + ids[2:])) == "hello world"


def test_prompt_context_keeps_text_after_the_prompt_exact(tokenizer):
    rng = random.Random(1)
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        for _ in range(5):
            cut = rng.randrange(1, len(ids))
            prompt, generated = ids[:cut], ids[cut:]
            head = tokenizer.decode(prompt)
            detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt)
            pieces = [detok.add(t) for t in generated]
            if head.endswith("\ufffd"):   # a prompt cut inside a character: no context is used
                assert pieces == _stream(tokenizer, generated)
                continue
            assert "".join(pieces) == text[len(head):]
            assert not any("\ufffd" in p for p in pieces)


def test_prompt_context_keeps_the_first_words_space_with_a_metaspace_tokenizer():
    """SentencePiece-style tokenizers (Mixtral's) drop the leading space of the first token decoded."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    tok.decoder = decoders.Metaspace(prepend_scheme="always")
    tok.train_from_iterator(["the cat sat on the mat"] * 5,
                            trainers.BpeTrainer(vocab_size=100, special_tokens=["<unk>", "<eos>"], show_progress=False))
    sp = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    prompt = sp("the", add_special_tokens=False).input_ids
    generated = sp(" cat sat on the mat", add_special_tokens=False).input_ids
    assert sp.decode(prompt + generated) == "the cat sat on the mat"
    detok = IncrementalDetokenizer(sp, prompt_ids=prompt)
    assert "".join(detok.add(t) for t in generated) == " cat sat on the mat"


# ---- stop strings -------------------------------------------------------------------------

def _feed(stops: list[str], deltas: list[str]) -> tuple[list[str], StopStringFilter]:
    f = StopStringFilter(stops)
    return [f.push(d) for d in deltas], f


def test_no_stop_strings_passes_everything_through():
    out, f = _feed([], ["a", "bc", "", "d"])
    assert out == ["a", "bc", "", "d"] and not f.stopped and f.flush() == ""


def test_output_stops_before_the_stop_string():
    out, f = _feed(["world"], ["Hello wor", "ld and more"])
    assert out == ["Hello ", ""]
    assert f.stopped
    assert f.push("more text") == "" and f.flush() == ""


def test_stop_string_inside_one_delta():
    out, f = _feed(["</s>"], ["answer</s>trailing"])
    assert out == ["answer"] and f.stopped


def test_partial_prefix_is_held_back_then_released():
    out, f = _feed(["world"], ["Hello wo", "n", "derful"])
    assert out == ["Hello ", "won", "derful"]
    assert not f.stopped and f.flush() == ""


def test_held_back_prefix_is_released_by_flush():
    out, f = _feed(["<|end|>"], ["done <|en"])
    assert out == ["done "]
    assert f.flush() == "<|en" and not f.stopped


def test_multiple_stop_strings_the_earliest_match_wins():
    out, f = _feed(["STOP", "</s>"], ["x </s> y STOP z"])
    assert out == ["x "] and f.stopped
    out, f = _feed(["STOP", "</s>"], ["one ST", "OP two </s>"])
    assert "".join(out) == "one " and f.stopped
    # one stop string is a prefix of another: the shorter one matches first
    out, f = _feed(["abc", "ab"], ["xa", "bc"])
    assert "".join(out) == "x" and f.stopped


def test_overlapping_candidates_are_all_held_back():
    # "aab" after "aa": the text could still become the stop string, one character later
    out, f = _feed(["aab"], ["a", "a", "a", "b"])
    assert "".join(out) == "a" and f.stopped


def test_stop_string_split_across_many_deltas():
    text = "the answer is 42<|im_end|>ignored"
    out, f = _feed(["<|im_end|>"], list(text))
    assert "".join(out) == "the answer is 42"
    assert f.stopped
    assert not any("<" in piece for piece in out)


@pytest.mark.parametrize("seed", range(5))
def test_random_splits(seed):
    rng = random.Random(seed)
    stops = ["<stop>", "END", "\n\n"]
    body = "".join(rng.choice(["a", "b", "<", "<st", "EN", "E", "\n", " ", "ü", "日"]) for _ in range(60))
    for text in (body, body + "<stop>tail", body + "EN" + "END more"):
        cuts = sorted(rng.sample(range(1, len(text)), 12))
        deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        out, f = _feed(stops, deltas)
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        expected = text[:min(hits)] if hits else text
        streamed = "".join(out)
        if not f.stopped:
            streamed += f.flush()
        assert streamed == expected
        assert f.stopped == bool(hits)
        for s in stops:
            assert s not in streamed
