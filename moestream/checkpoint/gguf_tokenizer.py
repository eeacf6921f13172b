"""A GGUF checkpoint's tokenizer from its metadata (`tokenizer.ggml.*`), with the chat template of
`tokenizer.chat_template`. (Tokenizer files beside the GGUF, when there are any, are read instead:
`engine/build.py`.)

Byte-level BPE vocabularies (`tokenizer.ggml.model = "gpt2"`: Qwen, Llama 3, DeepSeek-V3, GLM,
gpt-oss) are built here with `tokenizers`, as the model's own tokenizer.json defines them: the
vocabulary and merges, the split pattern its pre-tokenizer name (`tokenizer.ggml.pre`) stands for,
and the added tokens. That takes a second or two for 150K tokens, and does not depend on the
installed transformers' GGUF conversion (some of whose releases cannot build a BPE vocabulary with
merges). Any other vocabulary (SentencePiece's `llama`, an unknown pre-tokenizer) goes through
transformers' GGUF support.
"""

from __future__ import annotations

from moestream.checkpoint.gguf_file import GGUFCheckpoint
from moestream.errors import CheckpointError

# The split patterns of the pre-tokenizers a `tokenizer.ggml.pre` names, as their models'
# tokenizer.json spell them (llama.cpp's names; several names share one pattern).
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_DEEPSEEK3 = (r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
              (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
               r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"))
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "qwen2": (_QWEN2,), "stablelm2": (_QWEN2,), "qwen35": (_QWEN35,),
    "llama-bpe": (_LLAMA3,), "llama3": (_LLAMA3,), "smaug-bpe": (_LLAMA3,), "glm4": (_LLAMA3,),
    "gpt-4o": (_GPT4O,), "deepseek-v3": _DEEPSEEK3,
    "gpt-2": (_GPT2,), "gpt2": (_GPT2,), "default": (_GPT2,), "olmo": (_GPT2,),
}
_CONTROL, _USER_DEFINED = 3, 4   # llama.cpp's token types of the added tokens (special / not special)


def load_gguf_tokenizer(ckpt: GGUFCheckpoint):
    """The tokenizer of `ckpt`, or None when neither files beside it nor its metadata hold one."""
    meta = ckpt.metadata
    if not meta.get("tokenizer.ggml.tokens"):
        return None
    pre = str(meta.get("tokenizer.ggml.pre") or "default")
    if meta.get("tokenizer.ggml.model") == "gpt2" and meta.get("tokenizer.ggml.merges") and pre in PRE_TOKENIZER_SPLITS:
        tokenizer = byte_level_bpe(meta, PRE_TOKENIZER_SPLITS[pre])
    else:
        tokenizer = _transformers_gguf_tokenizer(ckpt)
    template = meta.get("tokenizer.chat_template")
    if template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template
    return tokenizer


def byte_level_bpe(meta: dict, splits: tuple[str, ...]):
    """A byte-level BPE tokenizer from GGUF metadata: the vocabulary in id order, the merges in rank
    order, `splits` isolated one after the other before the byte-level mapping, control tokens as
    special added tokens and user-defined ones as plain added tokens."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )
    from transformers import PreTrainedTokenizerFast

    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    bpe = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               fuse_unk=False, byte_fallback=False))
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:   # Llama 3's: BOS before each text
        b = tokens[int(bos)]
        bpe.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{b} $A", pair=f"{b} $A {b} $B", special_tokens=[(b, int(bos))])])
    bpe.add_tokens([AddedToken(t, special=ty == _CONTROL, normalized=False)
                    for t, ty in zip(tokens, types) if ty in (_CONTROL, _USER_DEFINED)])

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=token("bos_token_id"),
                                        eos_token=token("eos_token_id"), pad_token=token("padding_token_id"),
                                        unk_token=token("unknown_token_id"))
    return tokenizer


def _transformers_gguf_tokenizer(ckpt: GGUFCheckpoint):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(ckpt.path.parent), gguf_file=ckpt.path.name)
    except Exception as exc:   # transformers' GGUF conversion raises its own exception types
        raise CheckpointError(f"the tokenizer in {ckpt.path.name}'s metadata cannot be built ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:120] if str(exc) else 'no detail'}); put the model's "
                              "tokenizer files beside the GGUF.") from None
