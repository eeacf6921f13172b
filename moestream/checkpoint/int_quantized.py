"""Reading GPTQ, AWQ and compressed-tensors pack-quantized modules out of a checkpoint by name.

A module stored this way has its parts beside each other (`<path>.qweight`, `.qzeros`, `.scales`,
`.g_idx` for GPTQ and AWQ; `<path>.weight_packed`, `.weight_scale`, `.weight_zero_point`,
`.weight_shape`, `.weight_g_idx` for compressed-tensors); modules the quantizer skipped (routers,
embeddings, the LM head, whatever `modules_to_not_convert` / `ignore` names) keep a plain `.weight`.
`IntQuantReader` answers which modules are stored quantized, and gives each one as the affine parts
moestream computes with (exact: quant/gptq.py) or dequantized (act-order, groups ours cannot
split into). The dense loader and the expert store both read through it.
"""

from __future__ import annotations

from torch import Tensor

from moestream.checkpoint.safetensors_index import TensorIndex
from moestream.quant import QuantSpec
from moestream.quant.gptq import (IntQuant, IntWeight, affine_spec, dequantize_int, to_affine, unpack_awq,
                                  unpack_compressed, unpack_gptq)

MARKER = {"gptq": "qweight", "awq": "qweight", "compressed-tensors": "weight_packed"}


class IntQuantReader:
    def __init__(self, index: TensorIndex, quant: IntQuant):
        self.index, self.quant = index, quant
        self.spec = affine_spec(quant)   # None: no exact affine form, modules dequantize

    def holds(self, path: str) -> bool:
        """Whether the module at `path` is stored in this quantization."""
        return f"{path}.{MARKER[self.quant.method]}" in self.index

    def _optional(self, name: str) -> Tensor | None:
        return self.index.read(name) if name in self.index else None

    def weight(self, path: str, n: int, k: int) -> IntWeight:
        """The stored (n, k) weight of `path`, unpacked; missing or misshapen parts are named."""
        q, read = self.quant, self.index.read
        if q.method == "gptq":
            return unpack_gptq(q, n, k, read(f"{path}.qweight"), read(f"{path}.qzeros"),
                               read(f"{path}.scales", floating=True), self._optional(f"{path}.g_idx"), path)
        if q.method == "awq":
            return unpack_awq(q, n, k, read(f"{path}.qweight"), read(f"{path}.qzeros"),
                              read(f"{path}.scales", floating=True), path)
        return unpack_compressed(q, n, k, read(f"{path}.weight_packed"), read(f"{path}.weight_scale", floating=True),
                                 self._optional(f"{path}.weight_zero_point"), self._optional(f"{path}.weight_shape"),
                                 self._optional(f"{path}.weight_g_idx"), path)

    def stored_spec(self, path: str) -> QuantSpec | None:
        """The affine spec the module at `path` is held in, None when it is not stored quantized or
        has no exact affine form (it is then dequantized: `dense`)."""
        if self.spec is None or not self.holds(path):
            return None
        return self.spec

    def parts(self, path: str, n: int, k: int) -> dict[str, Tensor]:
        """qweight / scales / biases in `self.spec`, the same weights bit for bit."""
        return to_affine(self.weight(path, n, k), self.spec, path).parts()

    def dense(self, path: str, n: int, k: int) -> Tensor:
        """The (n, k) fp32 weight, (u - z)·s exactly."""
        return dequantize_int(self.weight(path, n, k))
