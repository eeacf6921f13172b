"""moestream: run Mixture-of-Experts models larger than the accelerator, exactly.

    engine = moestream.load("path/or/hub-id", device="cpu", dtype="float32")
    engine.logits(input_ids)                       # (batch, seq, vocab)
    engine.generate("prompt", max_tokens=32)       # str (or list[int] for token ids)
    for piece in engine.stream("prompt"): ...      # incremental text
"""

import importlib

from moestream.errors import MoestreamError
from moestream.version import __version__

_LAZY = {"Engine": "moestream.engine", "EngineConfig": "moestream.engine", "load": "moestream.engine"}


def __getattr__(name: str):
    """The engine (torch, transformers) loads on first use, so `moestream --help`, the CLI's error
    paths and Ctrl-C during start-up stay fast and clean."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    try:
        return importlib.import_module(f"moestream.{name}")
    except ModuleNotFoundError:
        raise AttributeError(f"module 'moestream' has no attribute {name!r}") from None


def generate(model: str, prompt, **kwargs):
    """One-shot convenience: load and generate."""
    from moestream.engine import load

    load_kw = {k: kwargs.pop(k) for k in ("device", "dtype", "max_context") if k in kwargs}
    return load(model, **load_kw).generate(prompt, **kwargs)


def stream_generate(model: str, prompt, **kwargs):
    from moestream.engine import load

    load_kw = {k: kwargs.pop(k) for k in ("device", "dtype", "max_context") if k in kwargs}
    yield from load(model, **load_kw).stream(prompt, **kwargs)


__all__ = ["Engine", "EngineConfig", "MoestreamError", "generate", "load", "stream_generate", "__version__"]
