"""Quantization specs and their names ("int4-g64", "nf4", "int8-g128", ...).

A spec says how one (N, K) weight is stored: `bits` per value packed along the input dimension K,
one scale (and, for affine, one bias) per `group` consecutive values of a row, scales and biases in
`scale_dtype`. Names are `<kind><bits>[-g<group>]`: kind `int` (affine: w ≈ q·scale + bias) or `nf`
(normal float: w ≈ code[q]·absmax); without `-g` the group is the kind's default (64; 32 for int2,
whose 4 levels need small groups).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from moestream.errors import InputError

AFFINE_BITS = (8, 4, 3, 2)
NF_BITS = (4, 3)
GROUPS = (32, 64, 128)
SCALE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class QuantSpec:
    kind: str                                  # "int" (affine) | "nf" (normal float)
    bits: int
    group: int
    scale_dtype: torch.dtype = torch.bfloat16

    @property
    def name(self) -> str:
        return f"{self.kind}{self.bits}-g{self.group}"

    @property
    def levels(self) -> int:
        return 1 << self.bits

    @property
    def has_bias(self) -> bool:
        return self.kind == "int"

    def packed_width(self, k: int) -> int:
        """Bytes per row of K values."""
        return k * self.bits // 8

    def check_width(self, k: int, what: str = "the input dimension") -> None:
        if k % self.group:
            raise InputError(f"group size {self.group} does not divide {what} ({k}); use a group size among "
                             f"{', '.join(str(g) for g in GROUPS if k % g == 0) or 'none that fits'}.")

    def nbytes(self, n: int, k: int) -> int:
        """Bytes of one (n, k) weight: packed values, scales and biases."""
        groups = n * (k // self.group)
        scale = torch.empty((), dtype=self.scale_dtype).element_size()
        return n * self.packed_width(k) + groups * scale * (2 if self.has_bias else 1)


def format_names() -> list[str]:
    return [f"int{b}" for b in AFFINE_BITS] + [f"nf{b}" for b in NF_BITS]


def parse_quant(name: str, scale_dtype: torch.dtype = torch.bfloat16) -> QuantSpec:
    """`int4`, `int4-g128`, `nf4-g64`, ... → QuantSpec; anything else is refused with the valid names."""
    m = re.fullmatch(r"(int|nf)(\d)(?:-g(\d+))?", str(name).strip().lower())
    valid = (f"valid formats: {', '.join(format_names())}, each optionally with a group size "
             f"-g{'/-g'.join(map(str, GROUPS))} (e.g. int4-g64)")
    if not m:
        raise InputError(f"quantization format {name!r} is unknown; {valid}.")
    kind, bits = m.group(1), int(m.group(2))
    if bits not in (AFFINE_BITS if kind == "int" else NF_BITS):
        raise InputError(f"quantization format {name!r} is unknown; {valid}.")
    group = int(m.group(3)) if m.group(3) else (32 if (kind, bits) == ("int", 2) else 64)
    if group not in GROUPS:
        raise InputError(f"group size {group} is not supported; use one of {', '.join(map(str, GROUPS))}.")
    return QuantSpec(kind, bits, group, scale_dtype)
