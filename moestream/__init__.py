"""moestream: run Mixture-of-Experts models larger than the accelerator, exactly.

    engine = moestream.load("path/or/hub-id", device="cpu", dtype="float32")
    engine.logits(input_ids)                       # (batch, seq, vocab)
    engine.generate("prompt", max_tokens=32)       # str (or list[int] for token ids)
    for piece in engine.stream("prompt"): ...      # incremental text
"""

from moestream.engine import Engine, EngineConfig, load
from moestream.errors import MoestreamError
from moestream.version import __version__


def generate(model: str, prompt, **kwargs):
    """One-shot convenience: load and generate."""
    load_kw = {k: kwargs.pop(k) for k in ("device", "dtype", "max_context") if k in kwargs}
    return load(model, **load_kw).generate(prompt, **kwargs)


def stream_generate(model: str, prompt, **kwargs):
    load_kw = {k: kwargs.pop(k) for k in ("device", "dtype", "max_context") if k in kwargs}
    yield from load(model, **load_kw).stream(prompt, **kwargs)


__all__ = ["Engine", "EngineConfig", "MoestreamError", "generate", "load", "stream_generate", "__version__"]
