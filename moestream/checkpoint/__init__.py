"""Reading checkpoints from disk: folder or hub id, config.json, safetensors byte ranges.

The safetensors index (which imports torch) loads on first use, so resolving a folder and reading
config.json stay cheap: the command line checks a model path before anything heavy imports."""

import importlib

from moestream.checkpoint.resolve import local_checkpoint, read_config, resolve_checkpoint

_LAZY = {"TensorIndex", "TensorInfo", "read_safetensors_header"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module("moestream.checkpoint.safetensors_index"), name)
    raise AttributeError(f"module 'moestream.checkpoint' has no attribute {name!r}")


__all__ = ["TensorIndex", "TensorInfo", "local_checkpoint", "read_config", "read_safetensors_header",
           "resolve_checkpoint"]
