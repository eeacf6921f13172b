"""The one way moestream writes a file: into a temporary beside it, fsync'd, then renamed.

A crash, a full disk or Ctrl-C at any moment leaves either the old file or the new one under the
final name, never half of one, and no temporary behind (the temporary is removed on any failure).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from moestream.errors import InputError

TMP_PREFIX = ".moestream-tmp-"


def fsync_dir(directory: Path) -> None:
    """Make a rename durable (POSIX); silently skipped where a directory cannot be opened."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_atomic(path: str | Path | Callable[[Any], Path], fill: Callable[[BinaryIO], Any],
                 directory: str | Path | None = None, mode: int = 0o644, prefix: str = TMP_PREFIX) -> tuple[Path, Any]:
    """Write through `fill(f)` into a temporary file and rename it to `path`; return (path, fill's result).

    `path` may be a callable of fill's result (a file named after its own checksum); then
    `directory` says where the temporary goes; its name starts with `prefix` (so a folder's owner can
    sweep what a killed writer left). Raises OSError as the system reported it.
    """
    folder = Path(directory) if directory is not None else Path(path).parent   # type: ignore[arg-type]
    fd, tmp = tempfile.mkstemp(prefix=prefix, dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            result = fill(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)   # mkstemp makes 0600; what we write is as readable as its folder
        final = Path(path(result)) if callable(path) else Path(path)
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(folder)
    return final, result


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    return write_atomic(path, lambda f: f.write(data))[0]


def write_json_atomic(path: str | Path, data: Any, indent: int | None = None) -> Path:
    """JSON written atomically; a path that cannot be written is the user's to fix (InputError)."""
    text = json.dumps(data, indent=indent, separators=None if indent else (",", ":"))
    try:
        return write_bytes_atomic(path, text.encode())
    except OSError as exc:
        raise InputError(f"cannot write {path} ({exc.strerror or exc}); check that the folder exists and is writable.") from None
