"""The byte-level BPE tokenizer: trained on the train split, wrapped for transformers, and a parallel encoder for the whole corpus."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any


import numpy as np
import torch

from demo_training.corpus import Document
from demo_training.settings import EOS_TOKEN

def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """Byte-level BPE (GPT-2 style pre-tokenization, no BOS, no prefix space), EOS = id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(texts), trainer=trainer)
    return tokenizer


def tokenizer_training_texts(train: Sequence[Document], max_bytes: int) -> list[str]:
    """A prefix (in seeded-hash order, i.e. a uniform sample) of the train split."""
    texts: list[str] = []
    total = 0
    for doc in train:
        if total >= max_bytes:
            break
        texts.append(doc.text)
        total += len(doc.text.encode())
    return texts


def wrap_hf_tokenizer(tokenizer, max_length: int):
    """transformers view of the tokenizer; saved as tokenizer.json + tokenizer_config.json."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )


_ENCODE_SHARED: dict[str, Any] = {}
"""Texts and tokenizer JSON handed to forked encoder processes (inherited, not pickled)."""
ENCODE_SHARD_DOCS = 256


def _encoder_process_init() -> None:
    # The parent's rayon pool has no threads after fork: encode serially in each process.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _encode_shard(bounds: tuple[int, int]) -> list[np.ndarray]:
    from tokenizers import Tokenizer

    if "tokenizer" not in _ENCODE_SHARED:
        _ENCODE_SHARED["tokenizer"] = Tokenizer.from_str(_ENCODE_SHARED["json"])
    texts = _ENCODE_SHARED["texts"][bounds[0] : bounds[1]]
    encodings = _ENCODE_SHARED["tokenizer"].encode_batch(texts, add_special_tokens=False)
    return [np.asarray(enc.ids, dtype=np.uint16) for enc in encodings]


def encode_texts(tokenizer, texts: list[str]) -> list[np.ndarray]:
    """Token ids of each text, using every CPU core.

    One process per core over shards of documents: measured here, the tokenizers batch
    encoder's own thread pool barely scaled on this corpus, while processes scale
    linearly.  Falls back to in-process batch encoding where fork is unavailable or
    CUDA is already initialized (forking then is unsafe).
    """
    import multiprocessing

    workers = min(os.cpu_count() or 1, max(1, len(texts) // ENCODE_SHARD_DOCS))
    can_fork = "fork" in multiprocessing.get_all_start_methods() and not torch.cuda.is_initialized()
    if workers < 2 or not can_fork:
        encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
        return [np.asarray(enc.ids, dtype=np.uint16) for enc in encode(texts, add_special_tokens=False)]
    shards = [(i, min(i + ENCODE_SHARD_DOCS, len(texts))) for i in range(0, len(texts), ENCODE_SHARD_DOCS)]
    _ENCODE_SHARED.update(json=tokenizer.to_str(), texts=texts)
    try:
        with multiprocessing.get_context("fork").Pool(workers, initializer=_encoder_process_init) as pool:
            parts = pool.map(_encode_shard, shards, chunksize=1)
    finally:
        _ENCODE_SHARED.clear()
    return [ids for part in parts for ids in part]


def encode_documents(tokenizer, docs: Sequence[Document], eos_id: int) -> np.ndarray:
    """One uint16 token stream: doc, EOS, doc, EOS, ... (document order preserved)."""
    eos = np.array([eos_id], dtype=np.uint16)
    pieces: list[np.ndarray] = []
    for ids in encode_texts(tokenizer, [d.text for d in docs]):
        pieces += [ids, eos]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint16)


# ---------------------------------------------------------------------------------------------
# Training module: Qwen3-MoE math and parameter names, with switchable expert kernels
# ---------------------------------------------------------------------------------------------
