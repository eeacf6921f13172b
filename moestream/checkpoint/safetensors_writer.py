"""A streaming safetensors writer: the header from shapes alone, then one tensor in memory at a time.

`safetensors.torch.save_file` needs every tensor in host memory at once; a bank snapshot can be
tens of GB on the device and a converted checkpoint's dense part several GB, so both are written
here instead: the header is built from (name, shape, dtype), then each tensor is produced, copied
to the host, written and dropped. The layout is the standard one (8-byte header length, JSON
header padded to 8 bytes, raw little-endian data in header order).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable
from typing import BinaryIO

import torch

from moestream.checkpoint.safetensors_index import SAFETENSORS_DTYPES

ST_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def write_safetensors(f: BinaryIO, layout: Iterable[tuple[str, tuple[int, ...], torch.dtype]],
                      produce: Callable[[str], torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write the tensors named in `layout` (in that order) to the open file `f`; `produce(name)` makes
    each one when it is its turn (any device; it must have the announced shape and dtype)."""
    layout = list(layout)
    header, offset = {}, 0
    for name, shape, dtype in layout:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": ST_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)   # data starts 8-aligned, as safetensors itself writes it
    f.write(struct.pack("<Q", len(blob)) + blob)
    for name, shape, dtype in layout:
        host = produce(name).detach().to("cpu").contiguous()
        if tuple(host.shape) != tuple(shape) or host.dtype != dtype:
            raise ValueError(f"tensor {name} is {host.dtype} {list(host.shape)}, the header says {dtype} {list(shape)}")
        f.write(memoryview(host.view(torch.uint8).numpy()).cast("B") if host.numel() else b"")
        del host
    f.flush()
