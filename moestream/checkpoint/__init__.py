"""Reading checkpoints from disk: folder or hub id, config.json, safetensors byte ranges."""

from moestream.checkpoint.resolve import read_config, resolve_checkpoint
from moestream.checkpoint.safetensors_index import TensorIndex, TensorInfo, read_safetensors_header

__all__ = ["TensorIndex", "TensorInfo", "read_config", "read_safetensors_header", "resolve_checkpoint"]
