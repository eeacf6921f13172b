"""Quantization specs and their names ("int4-g64", "nf4", "int8-g128", ...).

A spec says how one (N, K) weight is stored: `bits` per value packed along the input dimension K,
one scale (and, for affine, one bias) per `group` consecutive values of a row, scales and biases in
`scale_dtype`. Names are `<kind><bits>[-g<group>]`: kind `int` (affine: w ≈ q·scale + bias) or `nf`
(normal float: w ≈ code[q]·absmax); without `-g` the group is the kind's default (64; 32 for int2,
whose 4 levels need small groups). A row whose width is not a multiple of the group ends in one
shorter group (a 48-wide row in groups of 32: 32 + 16); widths must be multiples of 8 (whole packs).
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

    def groups(self, k: int) -> int:
        """Groups per row of K values (the last one shorter when the group does not divide K)."""
        return -(-k // self.group)

    def check_width(self, k: int, what: str = "the input dimension") -> None:
        if k < 8 or k % 8:
            raise InputError(f"{what} ({k}) is not a multiple of 8, so its values cannot be packed; keep this "
                             "tensor at full precision.")

    def nbytes(self, n: int, k: int) -> int:
        """Bytes of one (n, k) weight: packed values, scales and biases."""
        groups = n * self.groups(k)
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
