"""Turn what the user typed (a folder or a Hugging Face hub id) into a local checkpoint folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moestream.errors import CheckpointError

_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]


def resolve_checkpoint(model: str | Path) -> Path:
    """Local folders are used as they are; anything else is looked up as a hub id (cache first)."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{path} has no config.json; point at a Hugging Face checkpoint folder.")
        return path
    text = str(model)
    looks_like_path = text.startswith(("/", ".", "~")) or path.exists() or text.count("/") != 1
    if looks_like_path:
        raise CheckpointError(f"model folder {text} does not exist; give a checkpoint folder or a hub id like Qwen/Qwen3-30B-A3B.")
    return _resolve_hub_id(text)


def _resolve_hub_id(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - huggingface_hub is a dependency
        raise CheckpointError("huggingface_hub is not installed; pip install huggingface_hub or pass a local folder.") from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS, local_files_only=True))
    except Exception:
        pass
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
    except Exception as exc:
        reason = type(exc).__name__
        raise CheckpointError(
            f"hub model {repo_id} is not in the local cache and could not be downloaded ({reason}); "
            "check the id and the network, or pass a local folder."
        ) from None


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} has no config.json; point at a Hugging Face checkpoint folder.")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); fix or re-download it.") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} does not hold a JSON object; fix or re-download it.")
    return config
