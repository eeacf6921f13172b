"""Quantization: group-wise formats for weights, with plain-torch quantize / dequantize references.

spec.py     `QuantSpec` (affine int8/4/3/2 or normal-float nf4/nf3, group size, scale dtype) and names
packing.py  the bit layout: each row a little-endian bit stream (MLX's layout, so its weights read as they are)
affine.py   w ≈ q·scale + bias per group, scale and bias fitted per group with a small clip search
normal.py   w ≈ code[q]·absmax per group, the normal-float codebooks
tensor.py   `quantize` / `dequantize` of a whole (N, K) weight in any spec: what formats and kernels call
"""

from moestream.quant.spec import QuantSpec, format_names, parse_quant
from moestream.quant.tensor import QuantizedTensor, dequantize, quantize

__all__ = ["QuantSpec", "QuantizedTensor", "dequantize", "format_names", "parse_quant", "quantize"]
