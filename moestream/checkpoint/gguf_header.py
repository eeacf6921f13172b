"""The header of a GGUF file (metadata and tensor table), read in one pass over a memory map.

It exists for start-up time. `gguf.GGUFReader` builds a numpy view for every element of every
metadata array, so a 151,936-token vocabulary (tokens, token types and merges) costs it 10-20 s
before the first weight is touched; here an array of numbers is one `numpy.frombuffer` and an
array of strings one tight loop, and the same header reads in a fraction of a second.

The layout (GGUF v2/v3, little-endian): "GGUF", version u32, tensor count u64, key/value count
u64; each key/value: key (u64 length + UTF-8), value type u32, value (a string is u64 length +
UTF-8; an array is element type u32 + u64 count + elements); then each tensor: name, dimension
count u32, dimensions u64 (innermost first), ggml type u32, offset u64 from the start of the data,
which begins at the next multiple of `general.alignment` (32 unless given) after the header.

Values are the Python types `gguf.ReaderField.contents()` gives: str, int, float, bool, and flat
lists (nested arrays flattened); a value that is not valid UTF-8 reads as None, as there.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moestream.errors import CheckpointError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

STRING, ARRAY, UINT32 = 8, 9, 4
# value type → (struct format, numpy dtype) of the fixed-size types
_FIXED = {0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"),
          5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "?"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"),
          12: ("<d", "<f8")}
_SCALAR = {t: struct.Struct(fmt) for t, (fmt, _) in _FIXED.items()}
_DTYPE = {t: np.dtype(dt) for t, (_, dt) in _FIXED.items()}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry: `dims` as the file stores them (innermost first, as ggml's `ne`),
    `data_offset` absolute in the file, `n_bytes` from the ggml type's block and type size."""
    name: str
    ggml_type: int
    dims: tuple[int, ...]
    data_offset: int
    n_bytes: int


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    alignment: int
    data_offset: int   # where the tensor data begins
    file_size: int


class _Bad(Exception):
    """The header is not valid GGUF; the message says why (a phrase, wrapped by `read_header`)."""


_TRUNCATED = "its header runs past the end of the file"


class _Parser:
    """A cursor over the file's bytes; every read is checked against the end."""

    def __init__(self, buf, end: int):
        self.buf, self.end, self.pos = buf, end, 0

    def take(self, n: int) -> int:
        start = self.pos
        if start + n > self.end:
            raise _Bad(_TRUNCATED)
        self.pos = start + n
        return start

    def u32(self) -> int:
        return _U32.unpack_from(self.buf, self.take(4))[0]

    def u64(self) -> int:
        return _U64.unpack_from(self.buf, self.take(8))[0]

    def raw_string(self) -> bytes:
        n = self.u64()
        start = self.take(n)
        return self.buf[start:start + n]

    def name(self, what: str) -> str:
        raw = self.raw_string()
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _Bad(f"{what} {raw[:40]!r} is not UTF-8") from None

    def value(self, vtype: int, key: str) -> Any:
        if vtype == STRING:
            raw = self.raw_string()
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError:
                return None
        if vtype == ARRAY:
            out, ok = self.array(key)
            return out if ok else None
        if vtype not in _SCALAR:
            raise _Bad(f"key {key!r} has unknown value type {vtype}")
        s = _SCALAR[vtype]
        return s.unpack_from(self.buf, self.take(s.size))[0]

    def array(self, key: str) -> tuple[list, bool]:
        """The elements (nested arrays flattened) and whether every string among them is UTF-8."""
        etype, count = self.u32(), self.u64()
        if etype in _DTYPE:
            dtype = _DTYPE[etype]
            start = self.take(count * dtype.itemsize)
            return np.frombuffer(self.buf[start:self.pos], dtype=dtype).tolist(), True
        if etype == STRING:
            return self.strings(count)
        if etype == ARRAY:
            out, ok = [], True
            for _ in range(count):
                inner, inner_ok = self.array(key)
                out += inner
                ok = ok and inner_ok
            return out, ok
        raise _Bad(f"key {key!r} is an array of unknown value type {etype}")

    def strings(self, count: int) -> tuple[list[str | None], bool]:
        buf, pos, end = self.buf, self.pos, self.end
        if pos + 8 * count > end:   # each string is at least its length
            raise _Bad(_TRUNCATED)
        unpack = _U64.unpack_from
        out: list[str | None] = []
        append = out.append
        ok = True
        for _ in range(count):
            if pos + 8 > end:
                raise _Bad(_TRUNCATED)
            n = unpack(buf, pos)[0]
            pos += 8
            if pos + n > end:
                raise _Bad(_TRUNCATED)
            try:
                append(buf[pos:pos + n].decode("utf-8"))
            except UnicodeDecodeError:
                append(None)
                ok = False
            pos += n
        self.pos = pos
        return out, ok


def _parse(buf, size: int) -> GGUFHeader:
    from gguf.constants import GGML_QUANT_SIZES

    p = _Parser(buf, size)
    if buf[:4] != MAGIC:
        raise _Bad(_TRUNCATED if MAGIC.startswith(buf[:4]) else "it does not start with 'GGUF'")
    p.take(4)
    version = p.u32()
    if version not in VERSIONS:
        if version & 0xFFFF == 0 and int.from_bytes(version.to_bytes(4, "little"), "big") in VERSIONS:
            raise _Bad("it is a big-endian GGUF; moestream reads little-endian ones")
        raise _Bad(f"GGUF version {version}; moestream reads versions {' and '.join(map(str, VERSIONS))}")
    n_tensors, n_kv = p.u64(), p.u64()
    if p.pos + 12 * n_kv + 24 * n_tensors > size:   # the smallest key/value and tensor entries
        raise _Bad(_TRUNCATED)
    metadata: dict[str, Any] = {}
    types: dict[str, int] = {}
    for _ in range(n_kv):
        key = p.name("a key")
        if key in metadata:
            raise _Bad(f"key {key!r} appears twice")
        types[key] = vtype = p.u32()
        metadata[key] = p.value(vtype, key)
    entries = []
    for _ in range(n_tensors):
        name = p.name("a tensor name")
        n_dims = p.u32()
        dims = struct.unpack_from(f"<{n_dims}Q", buf, p.take(8 * n_dims))
        entries.append((name, dims, p.u32(), p.u64()))
    alignment = DEFAULT_ALIGNMENT
    if "general.alignment" in metadata:
        alignment = metadata["general.alignment"]
        if types["general.alignment"] != UINT32 or alignment == 0 or alignment & (alignment - 1):
            raise _Bad("general.alignment is not a u32 power of two")
    data_offset = -(-p.pos // alignment) * alignment
    tensors, seen = [], set()
    for name, dims, ggml_type, offset in entries:
        if name in seen:
            raise _Bad(f"tensor {name!r} appears twice")
        seen.add(name)
        try:
            block, type_size = GGML_QUANT_SIZES[ggml_type]
        except KeyError:
            raise _Bad(f"tensor {name!r} has unknown ggml type {ggml_type}") from None
        if block > 1 and dims and dims[0] % block:
            raise _Bad(f"tensor {name!r}'s rows of {dims[0]} are not whole blocks of {block}")
        tensors.append(TensorInfo(name, ggml_type, dims, data_offset + offset,
                                  math.prod(dims) * type_size // block))
    return GGUFHeader(version, metadata, tensors, alignment, data_offset, size)


def read_header(path: Path) -> GGUFHeader:
    """The header of the GGUF at `path` (no tensor data is read); a damaged, truncated or
    unreadable file is a CheckpointError that names it."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size == 0:
                raise _Bad("it is empty")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(buf, size)
    except PermissionError:
        raise CheckpointError(f"cannot read {path} (permission denied); make it readable.") from None
    except _Bad as exc:
        reason = str(exc)
    except (OSError, ValueError, OverflowError, struct.error) as exc:
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else 'unreadable'}"
    raise CheckpointError(f"{path} is not a readable GGUF file ({reason}); re-download it.")
