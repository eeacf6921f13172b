"""A GGUF checkpoint's tokenizer from its metadata (`tokenizer.ggml.*`, built by transformers' GGUF
support), with the chat template of `tokenizer.chat_template`. (Tokenizer files beside the GGUF,
when there are any, are read instead: `engine/build.py`.)"""

from __future__ import annotations

from moestream.checkpoint.gguf_file import GGUFCheckpoint
from moestream.errors import CheckpointError


def load_gguf_tokenizer(ckpt: GGUFCheckpoint):
    """The tokenizer of `ckpt`, or None when neither files beside it nor its metadata hold one."""
    folder = ckpt.path.parent
    if not ckpt.metadata.get("tokenizer.ggml.tokens"):
        return None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=ckpt.path.name)
    except Exception as exc:   # transformers' GGUF conversion raises its own exception types
        raise CheckpointError(f"the tokenizer in {ckpt.path.name}'s metadata cannot be built ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:120] if str(exc) else 'no detail'}); put the model's "
                              "tokenizer files beside the GGUF.") from None
    template = ckpt.metadata.get("tokenizer.chat_template")
    if template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template
    return tokenizer
