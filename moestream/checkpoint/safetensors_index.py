"""Know every tensor of a checkpoint by (file, byte range, dtype, shape) without reading its data.

The safetensors format is an 8-byte little-endian header length, a JSON header, then raw bytes.
Parsing only the header lets the expert store read one expert alone by byte range, and lets us
detect truncated files before any weight is touched.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from moestream.errors import CheckpointError

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}

_MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes live: absolute offset into `path`, so a single pread fetches it."""

    name: str
    path: Path
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parse one file's header and check every byte range lies inside the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise CheckpointError(f"{path} is too short to be a safetensors file; re-download or re-convert it.")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > _MAX_HEADER_BYTES or 8 + header_len > size:
                raise CheckpointError(f"{path} has a corrupt or truncated safetensors header; re-download or re-convert it.")
            header = json.loads(f.read(header_len))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"{path} could not be read as safetensors ({exc}); re-download or re-convert it.") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} has a corrupt safetensors header (not a JSON object); re-download or re-convert it.")
    data_start = 8 + header_len
    infos: dict[str, TensorInfo] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = SAFETENSORS_DTYPES[meta["dtype"]]
            begin, end = meta["data_offsets"]
            if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
                raise ValueError("bad data_offsets")
            shape = tuple(int(d) for d in meta["shape"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path} has a malformed header entry for {name!r}; re-download or re-convert it.") from None
        numel = 1
        for d in shape:
            numel *= d
        expected = numel * torch.empty((), dtype=dtype).element_size()
        if end - begin != expected or data_start + end > size:
            raise CheckpointError(
                f"{path} is truncated or corrupt (tensor {name!r} lies outside the file or has the wrong size); "
                "re-download or re-convert it."
            )
        infos[name] = TensorInfo(name, path, data_start + begin, end - begin, dtype, shape)
    return infos


def check_floating(info: TensorInfo) -> None:
    """A weight read as full precision must be stored as one (an int8 tensor is not bf16 bytes)."""
    if not info.dtype.is_floating_point or info.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        name = str(info.dtype).removeprefix("torch.")
        raise CheckpointError(f"tensor {info.name!r} is stored as {name} where a bf16, fp16 or fp32 weight is "
                              "expected; this checkpoint's format is not supported (convert it to bf16).")


def read_exactly(fd: int, out: torch.Tensor, offset: int, path: Path, what: str) -> None:
    """pread `out.nbytes` bytes at `offset` into the contiguous uint8 CPU tensor `out` (retrying short reads)."""
    mv = memoryview(out.numpy())
    done, size = 0, out.numel()
    try:
        while done < size:
            n = os.preadv(fd, [mv[done:]], offset + done)
            if n <= 0:
                break
            done += n
    except OSError as exc:
        raise CheckpointError(f"reading {what} from {path} failed ({exc}); check the disk and the file.") from None
    if done != size:
        raise CheckpointError(f"{path} ended early while reading {what}; the file was truncated, re-download it.")


class OpenFiles:
    """Read-only descriptors opened once and shared by every reading thread (pread needs no seek state)."""

    def __init__(self):
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()

    def fd(self, path: Path, redo: str) -> int:
        """The descriptor of `path`; a file that cannot be opened is a CheckpointError ending in `redo`."""
        fd = self._fds.get(path)
        if fd is None:
            with self._lock:
                fd = self._fds.get(path)
                if fd is None:
                    try:
                        fd = self._fds[path] = os.open(path, os.O_RDONLY)
                    except OSError as exc:
                        raise CheckpointError(f"cannot open {path} ({exc.strerror}); {redo}.") from None
        return fd

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __del__(self) -> None:  # best effort; fds are also closed at exit
        try:
            self.close()
        except Exception:
            pass


class TensorIndex:
    """All tensors of a checkpoint folder, from one or many shards, with or without an index file.

    Reads go through `os.pread` on a cached file descriptor: thread-safe, no seek state, and the
    destination can be any writable CPU tensor (pinned staging buffers included).
    """

    def __init__(self, folder: Path):
        self.folder = folder
        files = self._shard_files(folder)
        self.tensors: dict[str, TensorInfo] = {}
        for path in files:
            for name, info in read_safetensors_header(path).items():
                if name in self.tensors:
                    raise CheckpointError(f"tensor {name!r} is in both {self.tensors[name].path.name} and "
                                          f"{path.name}; remove the stale shard or add the checkpoint's index file.")
                self.tensors[name] = info
        self.files = OpenFiles()

    @staticmethod
    def _shard_files(folder: Path) -> list[Path]:
        index = folder / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = sorted({folder / f for f in weight_map.values()})
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise CheckpointError(f"{index} is not a valid safetensors index ({exc}); re-download it.") from None
            spelled: dict[str, tuple[Path, str]] = {}   # one file → the first path and spelling naming it
            for name in sorted(set(weight_map.values())):
                real = os.path.realpath(folder / name)
                if real in spelled and spelled[real][0] != folder / name:
                    raise CheckpointError(f"{index.name} names the shard {spelled[real][1]!r} also as {name!r}; write "
                                          "one spelling for each shard file in its weight_map.")
                spelled.setdefault(real, (folder / name, name))
            missing = [f.name for f in files if not f.exists()]
            if missing:
                raise CheckpointError(f"shard {missing[0]} listed in {index.name} is missing from {folder}; re-download the checkpoint.")
            return files
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no .safetensors files in {folder}; point at a Hugging Face checkpoint folder with safetensors weights.")
        return files

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {self.folder}; the download is incomplete or the checkpoint is not of this architecture.") from None

    def read_into(self, info: TensorInfo, out: torch.Tensor, start: int | None = None) -> torch.Tensor:
        """Read the raw bytes of `info` (from byte `start` of its data, as many as `out` holds) into
        the contiguous CPU tensor `out`; without `start`, `out` must hold the whole tensor."""
        view = out.view(-1).view(torch.uint8)
        if (start is None and view.numel() != info.nbytes) or (start or 0) + view.numel() > info.nbytes:
            raise ValueError(f"destination holds {view.numel()} bytes, {info.name} needs {info.nbytes}")
        fd = self.files.fd(info.path, "check that it exists and is readable")
        read_exactly(fd, view, info.offset + (start or 0), info.path, repr(info.name))
        return out

    def read(self, name: str, expected_shape: tuple[int, ...] | None = None, floating: bool = False) -> torch.Tensor:
        """Read one tensor into fresh CPU memory, checking its shape against the config when given
        (and, with `floating`, that it holds floating-point values rather than reinterpreting bytes)."""
        info = self.info(name)
        if floating:
            check_floating(info)
        if expected_shape is not None and tuple(expected_shape) != info.shape:
            raise CheckpointError(
                f"tensor {name!r} has shape {list(info.shape)} but config.json implies {list(expected_shape)}; "
                "the config does not match the weights."
            )
        out = torch.empty(info.shape, dtype=info.dtype)
        return self.read_into(info, out)
