"""Integer checkpoints with zero points: GPTQ, AWQ and compressed-tensors `pack-quantized`.

All three store a linear's weight W (N out, K in) as unsigned codes u in [0, 2^bits), one scale s
and one integer zero point z per group of input columns, and define W[n, k] = (u - z)·s. They
differ only in where the bits sit:

GPTQ        `qweight` (K·bits/32, N) int32: each column a little-endian bit stream along K.
            `qzeros` (G, N·bits/32) int32: each row a bit stream along N. `scales` (G, N).
            `g_idx` (K,): the group of each input column (act-order, `desc_act`, permutes it).
            The original format (`checkpoint_format` "gptq", v1) stores z - 1; "gptq_v2" stores z.
AWQ         (GEMM) `qweight` (K, N/8) int32, `qzeros` (G, N/8), `scales` (G, N): 4 bits, packed
            along N, nibble i of a word holding column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i]. No offset.
compressed  `weight_packed` (N, ⌈K·bits/32⌉) int32, a dense little-endian bit stream along K per
-tensors    row, of the signed values plus 2^(bits-1); `weight_scale` (N, G); `weight_zero_point`
            (asymmetric only) packed the same way along N, (⌈N·bits/32⌉, G); `weight_shape` (N, K);
            `weight_g_idx` (K,) for group act-order. Symmetric: z = 2^(bits-1) in unsigned terms.

Every form unpacks to one `IntWeight` (the codes, zeros (N, G), scales (N, G), group, g_idx),
whose reference dequantization is (u - z)·s computed in fp32: exact, since |u - z| < 2^9 and a
fp16/bf16 scale has at most 11 significant bits. GPTQ's words transposed, and compressed-tensors'
rows cut to K values, already are moestream's packed rows (little-endian bit streams along K), so
those codes are kept packed and never unpacked on the way to the affine format; AWQ's, packed
along N in its own nibble order, are regathered word by word (`_awq_rows`). (The formats' own dequantizers round that
product to the scale dtype; ours keeps it exact, and rounding it gives theirs.)

Mapping onto moestream's affine format (w = q·scale + bias per group, MLX's bit layout) is exact
when every one of our groups lies inside one stored group in column order (no act-order
permutation, our group dividing theirs): q = u, scale = s, bias = -z·s, and q·s + bias = (u - z)·s
exactly in fp32. The bias is exact in fp32 always; in bf16 when z is a power of two and s is bf16
(symmetric checkpoints with bf16 scales), which is when `affine_spec` picks bf16.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from moestream.errors import CheckpointError
from moestream.quant.packing import pack, pack_geometry, unpack
from moestream.quant.spec import AFFINE_BITS, GROUPS, QuantSpec
from moestream.quant.tensor import QuantizedTensor

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)   # nibble i of an AWQ word holds column 8c + AWQ_ORDER[i]
METHODS = ("gptq", "awq", "compressed-tensors")
INT_FORMATS = ("pack-quantized", "int-quantized")   # compressed-tensors' integer formats (the second refused)


@dataclass(frozen=True)
class IntQuant:
    """A checkpoint's integer quantization, from config.json's `quantization_config`."""
    method: str          # "gptq" | "awq" | "compressed-tensors"
    bits: int
    group: int           # input columns per group; -1: one group per row (per channel)
    sym: bool
    act_order: bool      # g_idx permutes the groups (GPTQ desc_act without static groups, CT actorder "group")
    zero_offset: int = 0  # added to stored zero points (GPTQ v1: 1)
    scale_dtype: torch.dtype = torch.float16   # the stored scales': fp16 for GPTQ / AWQ, the model's for compressed-tensors
    skipped: tuple[str, ...] = ()   # modules left at full precision: `modules_to_not_convert` / compressed-tensors `ignore`

    def skips(self, path: str) -> bool:
        """Whether config.json says the module at `path` is left unquantized (planning only: the load
        follows the tensors). `re:` entries are regular expressions (compressed-tensors); others match
        a whole name or a dotted part of one (transformers' `modules_to_not_convert`)."""
        for entry in self.skipped:
            if entry.startswith("re:"):
                if re.match(entry[3:], path):
                    return True
            elif path == entry or f".{entry}." in f".{path}.":
                return True
        return False

    @property
    def name(self) -> str:
        group = "channel" if self.group == -1 else f"g{self.group}"
        return f"{self.method} int{self.bits}-{group}{'' if self.sym else ' asym'}{' act-order' if self.act_order else ''}"


def _refuse(what: str) -> CheckpointError:
    return CheckpointError(f"config.json's quantization_config {what}; use a checkpoint in a form moestream reads: "
                           "GPTQ at 2/3/4/8 bits, AWQ 4-bit GEMM, or compressed-tensors pack-quantized weight-only.")


def int_quantization(raw: dict[str, Any]) -> IntQuant | None:
    """The integer quantization config.json declares, None when it declares none of these methods
    (compressed-tensors' float formats belong to another reader); anything of these methods that
    moestream cannot read exactly is refused here, by name."""
    q = raw.get("quantization_config")
    if not isinstance(q, dict) or q.get("quant_method") not in METHODS:
        return None
    method = q["quant_method"]
    if method == "compressed-tensors" and _compressed_format(q) not in INT_FORMATS:
        return None
    parsed = _gptq_config(q) if method == "gptq" else _awq_config(q) if method == "awq" else _compressed_config(q)
    skipped = q.get("ignore" if method == "compressed-tensors" else "modules_to_not_convert") or ()
    parsed = dataclasses.replace(parsed, skipped=tuple(str(e) for e in skipped if isinstance(e, str)))
    if method != "compressed-tensors":   # GPTQ and AWQ write fp16 scales whatever the model's dtype
        return parsed
    dtype = getattr(torch, str(raw.get("torch_dtype") or raw.get("dtype") or "float16"), None)
    return dataclasses.replace(parsed, scale_dtype=dtype if isinstance(dtype, torch.dtype) else torch.float16)


def _bits_group(bits: Any, group: Any, allowed: tuple[int, ...]) -> tuple[int, int]:
    if not isinstance(bits, int) or bits not in allowed:
        raise _refuse(f"stores {bits}-bit weights, a width moestream does not read in this format "
                      f"(it reads {'/'.join(map(str, allowed))})")
    if not isinstance(group, int) or not (group == -1 or group > 0):
        raise _refuse(f"names group size {group!r}, which is neither -1 (per channel) nor a positive count")
    return bits, group


def _gptq_config(q: dict) -> IntQuant:
    bits, group = _bits_group(q.get("bits"), q.get("group_size", 128), AFFINE_BITS)
    if q.get("dynamic"):
        raise _refuse("quantizes some modules differently (`dynamic` overrides), which moestream does not read")
    fmt = q.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse(f"stores GPTQ in checkpoint_format {fmt!r} (moestream reads 'gptq' and 'gptq_v2')")
    act_order = bool(q.get("desc_act", False)) and not bool(q.get("static_groups", False))
    return IntQuant("gptq", bits, group, bool(q.get("sym", True)), act_order, 1 if fmt == "gptq" else 0)


def _awq_config(q: dict) -> IntQuant:
    bits, group = _bits_group(q.get("bits", q.get("w_bit")), q.get("group_size", q.get("q_group_size", 128)), (4,))
    version = str(q.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse(f"stores AWQ in the {version!r} packing (moestream reads the 'gemm' one)")
    if not q.get("zero_point", True):
        raise _refuse("stores AWQ without zero points, which moestream does not read")
    return IntQuant("awq", bits, group, False, False)


def _compressed_format(q: dict) -> str | None:
    """compressed-tensors' format: the top-level one, or the one every config group names (newer writers)."""
    fmt = q.get("format")
    if fmt in (None, "mixed-precision"):
        formats = {g.get("format") for g in (q.get("config_groups") or {}).values() if isinstance(g, dict)}
        fmt = formats.pop() if len(formats) == 1 else fmt
    return fmt


def _compressed_config(q: dict) -> IntQuant:
    groups = q.get("config_groups") or {}
    weights = [g.get("weights") for g in groups.values() if isinstance(g, dict)]
    fmt = _compressed_format(q)
    if fmt != "pack-quantized":
        raise _refuse(f"stores compressed-tensors in format {fmt!r} (moestream reads 'pack-quantized' integers)")
    if not weights or any(w is None for w in weights) or any(w != weights[0] for w in weights):
        raise _refuse("has no single weight scheme across its config_groups")
    if any(isinstance(g, dict) and g.get("input_activations") for g in groups.values()):
        raise _refuse("quantizes activations too (moestream reads weight-only w4a16/w8a16)")
    w = weights[0]
    if w.get("type", "int") != "int":
        raise _refuse(f"stores {w.get('type')!r} weights in pack-quantized form")
    strategy = w.get("strategy")
    if strategy not in ("group", "channel"):
        raise _refuse(f"quantizes with strategy {strategy!r} (moestream reads 'group' and 'channel')")
    group = -1 if strategy == "channel" else w.get("group_size")
    bits, group = _bits_group(w.get("num_bits"), group, (8, 4, 2))
    return IntQuant("compressed-tensors", bits, group, bool(w.get("symmetric", True)), w.get("actorder") == "group")


@dataclass
class IntWeight:
    """One linear's stored weight, unpacked: W[n, k] = (codes[n, k] - zeros[n, g]) · scales[n, g],
    g = g_idx[k] when given, else k // group. The codes are kept either as values (`codes`, (N, K)
    uint8) or as the packed rows of moestream's layout (`packed`, (N, K·bits/8) uint8: what GPTQ's
    and compressed-tensors' words already are once transposed or cut), unpacked only when asked."""
    codes: Tensor | None        # (N, K) uint8, or None when only `packed` is held
    zeros: Tensor               # (N, G) int32
    scales: Tensor              # (N, G) as stored (fp16 / bf16 / fp32)
    group: int                  # columns per group (K for one group per row)
    g_idx: Tensor | None = None   # (K,) int64
    packed: Tensor | None = None  # (N, K·bits/8) uint8 in packing.py's layout
    bits: int = 0

    @property
    def k(self) -> int:
        return self.codes.shape[1] if self.codes is not None else self.packed.shape[1] * 8 // self.bits

    def values(self) -> Tensor:
        """(N, K) uint8 codes."""
        return self.codes if self.codes is not None else unpack(self.packed, self.bits)

    def packed_as(self, bits: int) -> Tensor:
        """The codes packed in moestream's layout at `bits` (the stored bytes when they already are)."""
        if self.packed is not None and self.bits == bits:
            return self.packed
        return pack(self.values(), bits)

    def column_groups(self) -> Tensor:
        return self.g_idx if self.g_idx is not None else torch.arange(self.k) // self.group

    @property
    def ordered(self) -> bool:
        """Whether groups are contiguous runs of columns (no act-order permutation)."""
        return self.g_idx is None or bool(torch.equal(self.g_idx, torch.arange(self.k) // self.group))


def dequantize_int(w: IntWeight) -> Tensor:
    """The reference: (N, K) fp32, (u - z)·s exactly."""
    cols = w.column_groups()
    return (w.values().to(torch.int32) - w.zeros[:, cols]).float() * w.scales.float()[:, cols]


def _bytes(words: Tensor) -> Tensor:
    """int32 words (R, W) → their little-endian bytes (R, 4W), contiguous."""
    words = words.contiguous()
    return words.reshape(-1).view(torch.uint8).reshape(words.shape[0], -1)


def bitstream(words: Tensor, bits: int, count: int) -> Tensor:
    """int32 words (..., W), a little-endian bit stream along the last dim → its first `count` values (uint8)."""
    raw = _bytes(words)
    _, unit = pack_geometry(bits)
    pad = -raw.shape[-1] % unit
    if pad:
        raw = torch.nn.functional.pad(raw, (0, pad))
    values = unpack(raw, bits)
    if values.shape[-1] < count:
        raise ValueError(f"{values.shape[-1]} packed values, {count} wanted")
    return values[..., :count]


def _need(t: Tensor, shape: tuple[int, ...], name: str, dtype: torch.dtype | None = torch.int32) -> None:
    if tuple(t.shape) != tuple(shape) or (dtype is not None and t.dtype != dtype):
        want = f"{str(dtype).removeprefix('torch.')} " if dtype is not None else ""
        raise CheckpointError(f"tensor {name!r} is {str(t.dtype).removeprefix('torch.')} {list(t.shape)} but the "
                              f"quantization config and the model's sizes imply {want}{list(shape)}; the checkpoint "
                              "does not match its config.")


def _groups(k: int, group: int) -> tuple[int, int]:
    """(columns per group, groups per row) of a K-wide row."""
    g = k if group == -1 else group
    return g, -(-k // g)


def unpack_gptq(q: IntQuant, n: int, k: int, qweight: Tensor, qzeros: Tensor, scales: Tensor,
                g_idx: Tensor | None, name: str = "") -> IntWeight:
    g, groups = _groups(k, q.group)
    _need(qweight, (k * q.bits // 32, n), f"{name}.qweight")
    _need(qzeros, (groups, -(-n * q.bits // 32)), f"{name}.qzeros")
    _need(scales, (groups, n), f"{name}.scales", None)
    if g_idx is not None:
        _need(g_idx, (k,), f"{name}.g_idx", None)
        if g_idx.min() < 0 or g_idx.max() >= groups:
            raise CheckpointError(f"tensor '{name}.g_idx' names groups outside 0..{groups - 1}; the checkpoint is damaged.")
    packed = _bytes(qweight.t())                   # each column's bit stream along K is a row of ours
    zeros = bitstream(qzeros, q.bits, n).t().to(torch.int32) + q.zero_offset  # (N, G)
    return IntWeight(None, zeros.contiguous(), scales.t().contiguous(), g,
                     g_idx.long() if g_idx is not None else None, packed, q.bits)


def _awq_columns(words: Tensor, n: int) -> Tensor:
    """(R, N/8) AWQ words → (R, N) 4-bit values in column order: column 8c + j sits in nibble
    AWQ_ORDER.index(j) of word c."""
    parts = [(words >> (4 * AWQ_ORDER.index(j))) & 0xF for j in range(8)]
    return torch.stack(parts, dim=-1).to(torch.uint8).reshape(words.shape[0], -1)[:, :n]


def unpack_awq(q: IntQuant, n: int, k: int, qweight: Tensor, qzeros: Tensor, scales: Tensor,
               name: str = "") -> IntWeight:
    g, groups = _groups(k, q.group)
    _need(qweight, (k, n // 8), f"{name}.qweight")
    _need(qzeros, (groups, n // 8), f"{name}.qzeros")
    _need(scales, (groups, n), f"{name}.scales", None)
    zeros = _awq_columns(qzeros, n).t().to(torch.int32).contiguous()
    if k % 8:   # rows of ours cannot be whole words: through the values
        return IntWeight(_awq_columns(qweight, n).t().contiguous(), zeros, scales.t().contiguous(), g)
    return IntWeight(None, zeros, scales.t().contiguous(), g, None, _awq_rows(qweight, n, k), 4)


def _awq_rows(words: Tensor, n: int, k: int) -> Tensor:
    """(K, N/8) AWQ words → moestream's packed rows (N, K/2): for each column 8c + j, the nibble
    AWQ_ORDER.index(j) of eight consecutive rows' words gathered into one little-endian word."""
    w = words.view(k // 8, 8, n // 8)                          # [row block, row in block, column block]
    out = torch.empty(n // 8, 8, k // 8, dtype=torch.int32)    # [column block, column in block, row block]
    for j in range(8):
        nib = (w >> (4 * AWQ_ORDER.index(j))) & 0xF
        word = nib[:, 0]
        for i in range(1, 8):
            word = word | (nib[:, i] << (4 * i))
        out[:, j] = word.t()
    return _bytes(out.view(n, k // 8))


def unpack_compressed(q: IntQuant, n: int, k: int, packed: Tensor, scale: Tensor, zero_point: Tensor | None,
                      shape: Tensor | None, g_idx: Tensor | None, name: str = "") -> IntWeight:
    g, groups = _groups(k, q.group)
    if shape is not None and [int(v) for v in shape.reshape(-1).tolist()] != [n, k]:
        raise CheckpointError(f"tensor '{name}.weight_shape' says {shape.tolist()} but the model's sizes imply "
                              f"{[n, k]}; the checkpoint does not match its config.")
    _need(packed, (n, -(-k * q.bits // 32)), f"{name}.weight_packed")
    _need(scale, (n, groups), f"{name}.weight_scale", None)
    codes = _bytes(packed)[:, :k * q.bits // 8].contiguous()   # the dense stream's first K values: ours
    if q.sym:
        zeros = torch.full((n, groups), 1 << (q.bits - 1), dtype=torch.int32)
    elif zero_point is None:
        raise CheckpointError(f"tensor '{name}.weight_zero_point' is missing, but the checkpoint is asymmetric; "
                              "the download is incomplete.")
    elif zero_point.dtype == torch.int32:          # packed along N, offset like the values
        _need(zero_point, (-(-n * q.bits // 32), groups), f"{name}.weight_zero_point")
        zeros = bitstream(zero_point.t(), q.bits, n).t().to(torch.int32)
    else:                                          # older writers: signed int8 (N, G), unpacked
        _need(zero_point, (n, groups), f"{name}.weight_zero_point", torch.int8)
        zeros = zero_point.to(torch.int32) + (1 << (q.bits - 1))
    if g_idx is not None:
        _need(g_idx, (k,), f"{name}.weight_g_idx", None)
        if g_idx.min() < 0 or g_idx.max() >= groups:
            raise CheckpointError(f"tensor '{name}.weight_g_idx' names groups outside 0..{groups - 1}; the "
                                  "checkpoint is damaged.")
    return IntWeight(None, zeros.contiguous(), scale.contiguous(), g, g_idx.long() if g_idx is not None else None,
                     codes, q.bits)


def affine_group(q: IntQuant, k: int | None = None) -> int | None:
    """Our group size for a stored group: the largest of GROUPS dividing it (any for one group per
    row), None when none does (a finer or odd group: no exact mapping)."""
    for g in sorted(GROUPS, reverse=True):
        if q.group == -1 or q.group % g == 0:
            return g
    return None


def affine_spec(q: IntQuant, scale_dtype: torch.dtype | None = None) -> QuantSpec | None:
    """The affine spec that holds this checkpoint's weights exactly, or None when none does (act-order,
    or a group no GROUPS size divides): scales and biases in the stored bf16 or fp16 for symmetric
    weights (the bias -2^(bits-1)·s is then exact there: GPTQ's usual fp16 scales cost 5 bits a 4-bit
    weight at g32, not fp32's 6), else in fp32 (every -z·s is)."""
    group, scale_dtype = affine_group(q), scale_dtype or q.scale_dtype
    if q.act_order or group is None:
        return None
    exact_half = q.sym and scale_dtype in (torch.bfloat16, torch.float16) and q.method != "awq"
    return QuantSpec("int", q.bits, group, scale_dtype if exact_half else torch.float32)


def fallback_spec(q: IntQuant) -> QuantSpec | None:
    """Experts with no exact affine form (act-order, a group none of ours divides) are dequantized
    and requantized to int8 in groups of 64 when stored at 2-4 bits: half the bytes of bf16, and
    about 0.6% relative weight error (measured on Gaussian weights, int4-g128 act-order), some 17x
    below the 4-bit quantization's own. 8-bit ones (None) are dequantized to the compute dtype:
    requantizing them to int8 would double their error, and bf16 costs only twice their bytes."""
    return QuantSpec("int", 8, 64, torch.bfloat16) if q.bits < 8 else None


def to_affine(w: IntWeight, spec: QuantSpec, name: str = "") -> QuantizedTensor:
    """The same weights in `spec` (q = u, scale = s, bias = -z·s), checked exact; a weight that is
    not (act-order, a misfit group, a bias the scale dtype cannot hold) is refused."""
    n, k = w.zeros.shape[0], w.k
    if not w.ordered or (w.group % spec.group and w.group != k):
        raise CheckpointError(f"{name} does not map exactly onto {spec.name} (its groups are permuted or do not "
                              "split into ours); the checkpoint's config does not describe its tensors.")
    ours = torch.arange(spec.groups(k)) * spec.group // w.group          # stored group of each of ours
    scales = w.scales.float()[:, ours]
    biases = -w.zeros[:, ours].float() * scales
    s, b = scales.to(spec.scale_dtype), biases.to(spec.scale_dtype)
    if not bool(torch.isfinite(scales).all()):
        raise CheckpointError(f"the scales of {name} hold inf or NaN; the checkpoint is damaged.")
    if not (torch.equal(s.float(), scales) and torch.equal(b.float(), biases)):
        raise CheckpointError(f"the scales of {name} are not exact in {str(spec.scale_dtype).removeprefix('torch.')} "
                              "(config.json's dtype does not match the stored scales); fix torch_dtype in config.json.")
    return QuantizedTensor(w.packed_as(spec.bits), s, b, spec)


def quantize_int(w: Tensor, bits: int, group: int, sym: bool, scale_dtype: torch.dtype = torch.float16) -> IntWeight:
    """Round-to-nearest (N, K) → IntWeight, min-max per group (symmetric: z = 2^(bits-1), s from
    the absolute max): what random GPTQ-form checkpoints are written from. Not GPTQ's solver."""
    n, k = w.shape
    g, groups = _groups(k, group)
    wg = torch.nn.functional.pad(w.float(), (0, groups * g - k)).reshape(n, groups, g)   # a short last group
    top = (1 << bits) - 1
    if sym:
        scales = (wg.abs().amax(-1) / ((1 << (bits - 1)) - 0.5)).clamp_min(1e-8).to(scale_dtype)
        zeros = torch.full((n, groups), 1 << (bits - 1), dtype=torch.int32)
    else:
        lo, hi = wg.amin(-1).clamp_max(0), wg.amax(-1).clamp_min(0)
        scales = ((hi - lo) / top).clamp_min(1e-8).to(scale_dtype)
        zeros = (-lo / scales.float()).round().clamp(0, top).to(torch.int32)
    codes = (wg / scales.float()[..., None] + zeros[..., None]).round().clamp(0, top)
    return IntWeight(codes.reshape(n, -1)[:, :k].to(torch.uint8).contiguous(), zeros, scales, g)


def _words(values: Tensor, bits: int) -> Tensor:
    """uint8 values (R, C) → int32 words (R, C·bits/32), a little-endian bit stream per row."""
    packed = pack(values, bits)
    return packed.reshape(-1).view(torch.int32).reshape(packed.shape[0], -1)


def pack_gptq(w: IntWeight, bits: int, v1: bool = True) -> dict[str, Tensor]:
    """IntWeight → GPTQ's `qweight`, `qzeros`, `scales`, `g_idx` (v1 stores z - 1)."""
    stored = w.zeros - (1 if v1 else 0)
    if stored.min() < 0 or stored.max() >= 1 << bits:
        raise ValueError("zero points outside the stored range")
    return {"qweight": _words(w.values(), bits).t().contiguous(),
            "qzeros": _words(stored.t().to(torch.uint8).contiguous(), bits),
            "scales": w.scales.t().contiguous(), "g_idx": w.column_groups().to(torch.int32)}


def pack_awq(w: IntWeight) -> dict[str, Tensor]:
    """IntWeight (4-bit) → AWQ GEMM's `qweight`, `qzeros`, `scales`."""
    def words(cols: Tensor) -> Tensor:   # (R, N) column order → (R, N/8) words in AWQ's nibble order
        r = cols.shape[0]
        return _words(cols.reshape(r, -1, 8)[:, :, list(AWQ_ORDER)].reshape(r, -1).contiguous(), 4)
    return {"qweight": words(w.values().t()), "qzeros": words(w.zeros.t().to(torch.uint8)),
            "scales": w.scales.t().contiguous()}


def pack_compressed(w: IntWeight, bits: int, sym: bool) -> dict[str, Tensor]:
    """IntWeight → compressed-tensors pack-quantized `weight_packed`, `weight_scale`, `weight_shape`
    [, `weight_zero_point` packed along N]."""
    n, k = w.zeros.shape[0], w.k
    out = {"weight_packed": _words(w.values(), bits), "weight_scale": w.scales.contiguous(),
           "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    if not sym:
        out["weight_zero_point"] = _words(w.zeros.t().to(torch.uint8).contiguous(), bits).t().contiguous()
    return out
