"""Byte sizes as users write them ('16GiB', '12000MB') and as the engine prints them."""

from __future__ import annotations

import re

from moestream.errors import InputError

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """'16GiB', '16GB', '16G', '512MiB', '1.5gib' or a plain byte count."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise InputError(f"memory size {text!r} does not parse; write it like 16GiB, 12000MB or 8G.")
    return int(float(m.group(1)) * _UNITS[unit])


def format_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def format_rate(nbytes: float, seconds: float) -> str:
    """Bytes per second in the unit that keeps three digits: a small model's rate is never "0.00 GB/s"."""
    rate = nbytes / seconds if seconds > 0 else 0.0
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3), ("B/s", 1)):
        if rate >= scale * 0.9995 or unit == "B/s":   # what rounds up to 1 takes the larger unit
            value = rate / scale
            return f"{value:.3g} {unit}" if value < 1000 else f"{value:.0f} {unit}"


def dtype_size(dtype) -> int:
    """Bytes per element of a torch dtype (torch imported here: parsing sizes stays torch-free, so the
    command line checks its size flags before anything heavy loads)."""
    import torch

    return torch.empty((), dtype=dtype).element_size()
