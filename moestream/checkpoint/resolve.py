"""Turn what the user typed (a folder or a Hugging Face hub id) into a local checkpoint folder."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from moestream.errors import CheckpointError

_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]


def resolve_checkpoint(model: str | Path) -> Path:
    """Local folders are used as they are; anything else is looked up as a hub id (cache first)."""
    folder = local_checkpoint(model)
    return folder if folder is not None else _resolve_hub_id(str(model))


def local_checkpoint(model: str | Path) -> Path | None:
    """The local checkpoint folder `model` names, checked (it exists, it is a folder with a readable
    config.json); None when it reads as a hub id. Cheap and torch-free: the CLI calls it before
    anything heavy loads, so a wrong path costs no start-up."""
    path = Path(model).expanduser()
    try:
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise CheckpointError(f"{path} has no config.json; point at a Hugging Face checkpoint folder.")
            if not os.access(path / "config.json", os.R_OK) or not os.access(path, os.R_OK | os.X_OK):
                raise PermissionError(13, "permission denied", str(path))
            return path
        if path.is_file() and path.suffix.lower() == ".gguf":
            if not os.access(path, os.R_OK):
                raise PermissionError(13, "permission denied", str(path))
            return path   # a GGUF file is a checkpoint of its own (checkpoint/gguf_file.py)
        if path.is_file():
            raise CheckpointError(f"{path} is a file, not a checkpoint folder; give the folder that holds config.json "
                                  "and the safetensors files, or a .gguf file.")
    except PermissionError:
        raise CheckpointError(f"cannot read the checkpoint folder {path} (permission denied); make it readable "
                              f"(e.g. chmod -R u+rX {path}) or run as a user who may read it.") from None
    text = str(model)
    looks_like_path = text.startswith(("/", ".", "~")) or path.exists() or text.count("/") != 1
    if looks_like_path:
        raise CheckpointError(f"model folder {text} does not exist; give a checkpoint folder or a hub id like Qwen/Qwen3-30B-A3B.")
    return None


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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def has_tokenizer(folder: Path) -> bool:
    """Whether the checkpoint ships tokenizer files (without them prompts are token ids); a GGUF
    file has one when files sit beside it or its metadata holds one."""
    if folder.suffix.lower() == ".gguf" and folder.is_file():
        from moestream.checkpoint.gguf_file import gguf_metadata

        return has_tokenizer(folder.parent) or bool(gguf_metadata(folder, "tokenizer.ggml.tokens"))
    return any((folder / name).exists() for name in TOKENIZER_FILES)


def chat_template_of(folder: Path) -> str | None:
    """The checkpoint's chat template, read from its files without loading the tokenizer:
    chat_template.jinja, chat_template.json, or tokenizer_config.json's chat_template (of a GGUF: those
    beside it, else its metadata's tokenizer.chat_template); None if none."""
    if folder.suffix.lower() == ".gguf" and folder.is_file():
        from moestream.checkpoint.gguf_file import gguf_metadata

        return chat_template_of(folder.parent) or gguf_metadata(folder, "tokenizer.chat_template") or None
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8", errors="replace")
    for name in ("chat_template.json", "tokenizer_config.json"):
        try:
            template = json.loads((folder / name).read_text(encoding="utf-8")).get("chat_template")
        except (OSError, ValueError, AttributeError):
            continue
        if template:
            return template if isinstance(template, str) else json.dumps(template)
    return None


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} has no config.json; point at a Hugging Face checkpoint folder.")
    try:
        config = json.loads(path.read_text())
    except PermissionError:
        raise CheckpointError(f"cannot read {path} (permission denied); make the checkpoint folder readable.") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); fix or re-download it.") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} does not hold a JSON object; fix or re-download it.")
    return config
