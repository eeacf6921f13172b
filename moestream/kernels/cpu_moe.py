"""Routed experts on the CPU at memory bandwidth: the C kernel of `cpu_moe.c`, built at first use.

Hybrid misses compute some of a decode step's missing experts on the CPU, straight from the
pinned host tier. Each such expert is read once for a few tokens, so the CPU's work is bound by
how fast it streams the weights from DRAM; torch's bf16 CPU GEMM re-lays out the weight on every
call and reached ~14 GB/s on a 16-core host, slower than copying the expert over PCIe. The C
kernel reads every weight row once, widens bf16 in registers and accumulates in fp32 over all
cores (OpenMP), computing exactly `moe_reference`'s sum for the pairs it is given.

It is compiled with the system C compiler (`cc`, or `$CC`) into the user's cache the first time
it is needed, keyed by the source and the CPU it was built for (`-march=native`). Where no
compiler works, `load()` says why and callers keep the plain-torch reference.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from moestream.kernels.moe_reference import Activation
from moestream.quant import QuantSpec
from moestream.quant.fp8 import Fp8Spec
from moestream.quant.mxfp4 import FP4_VALUES, Mxfp4Spec
from moestream.quant.normal import codebook

StoredSpec = QuantSpec | Fp8Spec | Mxfp4Spec   # how quantized experts are stored (format.stored_format)

SOURCE = Path(__file__).with_name("cpu_moe.c")
DTYPES = {torch.bfloat16: 0, torch.float32: 1}
SCALE_DTYPES = {torch.bfloat16: 0, torch.float32: 1, torch.float16: 3}   # cpu_moe.c's S_* (2: e8m0)
ACTIVATION_CODES = {"swiglu": 0, "swiglu_clamped": 1, "geglu_tanh": 2}

# How far ahead of its reads the kernel asks for weight lines (`cpu_moe.c`: why). On an H100 host's
# 16-core Xeon, 2048 bytes read bf16 experts 19% faster than none, and 512-4096 all helped
# (`cpu_experts.py --prefetch`, BENCHMARKS.md).
PREFETCH_BYTES = 2048

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_reason: str | None = None
_threads: int | None = None
_checked: dict[int, Tensor] = {}   # id of a slots mapping -> its first tensor when it was checked


def _cpu_key() -> str:
    """What a `-march=native` build depends on: the machine and its instruction-set flags."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return f"{platform.machine()}|{flags}"


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "moestream" / "kernels"


def _build(out: Path) -> str | None:
    """Compile the kernel into `out` (atomically); the error when it cannot be built, else None."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return "no C compiler (cc or gcc) is on PATH"
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so")
    os.close(fd)
    error = ""
    try:
        for arch in (["-march=native"], []):
            cmd = [cc, "-O3", *arch, "-fopenmp", "-shared", "-fPIC", "-std=gnu11", str(SOURCE), "-o", tmp, "-lm"]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            except (OSError, subprocess.TimeoutExpired) as e:
                error = str(e)
                continue
            if done.returncode == 0:
                os.replace(tmp, out)
                return None
            error = (done.stderr.strip().splitlines() or ["failed"])[-1]
        return f"{Path(cc).name} could not build {SOURCE.name}: {error}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load() -> ctypes.CDLL | None:
    """The kernel library, built on first use; None when it cannot be built (`unavailable_reason()`)."""
    global _lib, _reason
    with _lock:
        if _lib is not None or _reason is not None:
            return _lib
        key = hashlib.sha256(SOURCE.read_bytes() + _cpu_key().encode()).hexdigest()[:16]
        path = _cache_dir() / f"cpu_moe-{key}.so"
        if not path.exists():
            _reason = _build(path)
            if _reason is not None:
                return None
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            _reason = f"the built kernel {path} could not be loaded: {e}"
            return None
        p, i32, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
        lib.moe_cpu_init.argtypes = [i32, p, i32]
        lib.moe_cpu_init.restype = i32
        lib.moe_cpu_set_prefetch.argtypes = [i32]
        lib.moe_cpu_set_prefetch.restype = None
        lib.moe_cpu_set_prefetch(PREFETCH_BYTES)
        lib.moe_cpu_experts.argtypes = [p, p, p, p, i32, i32, i32, i32, f32, f32, i32, p, p, p, p, p, p, p, p]
        lib.moe_cpu_experts.restype = None
        lib.moe_cpu_experts_quant.argtypes = [p, p, p, p, p, p, p, p, p, i32, i32, f32, f32, i32, i32, i32, i32,
                                              p, p, p, p, p, p, p, p, i32, p, p, p, p]
        lib.moe_cpu_experts_quant.restype = None
        lib.moe_cpu_qlinear.argtypes = [p, p, p, p, i32, i32, i32, p, p]
        lib.moe_cpu_qlinear.restype = None
        lib.moe_stream_start.argtypes = [p, p, i32, i32, i32, i32, i32, i32, i32, i32, f32, f32, i32, p, i32]
        lib.moe_stream_start.restype = p
        lib.moe_stream_stop.argtypes = [p, ctypes.c_double]
        lib.moe_stream_stop.restype = i32
        lib.moe_stream_wait.argtypes = [p, i32, ctypes.c_double]
        lib.moe_stream_wait.restype = i32
        lib.moe_stream_publish.argtypes = [p, i32]
        lib.moe_stream_publish.restype = None
        _lib = lib
        return _lib


def unavailable_reason() -> str | None:
    """Why the kernel cannot run here (None when it can, or before anything tried)."""
    return _reason


def supports(dtype: torch.dtype, activation: str | Activation) -> bool:
    return dtype in DTYPES and Activation.of(activation).name in ACTIVATION_CODES


_share: tuple[int, int] = (0, 1)   # (index, count): this process's share of the CPUs (`use_share`)


def process_cpus() -> list[int]:
    """The CPUs this process may run on."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def usable_cpus() -> list[int]:
    """The CPUs this process's kernel team may run on: those it may run on, or its share of them
    (`use_share`)."""
    return cpu_share(process_cpus(), *_share)


def cpu_share(cpus: list[int], index: int, count: int) -> list[int]:
    """Share `index` of `count` equal, disjoint runs of `cpus` (the last takes the remainder; every
    share at least one CPU, shared when there are fewer CPUs than shares)."""
    if count <= 1:
        return cpus
    if len(cpus) < count:
        return [cpus[index % len(cpus)]]
    per = len(cpus) // count
    return cpus[index * per:] if index == count - 1 else cpus[index * per:(index + 1) * per]


def use_share(index: int, count: int) -> None:
    """Make this process's kernel team run on share `index` of `count` of its CPUs, so the ranks of an
    expert-parallel group on one host each pin their team to cores of their own (before the team or a
    stream worker starts)."""
    global _share
    _share = (index, count)


MAX_DEFAULT_THREADS = 16


def all_but_one(cpus: int) -> int:
    """Every core but one (at least one): the rest of the machine, and the thread driving the GPU, keep a core."""
    return max(1, cpus - 1)


def default_threads(cpus: int) -> int:
    """Every core but one, at most `MAX_DEFAULT_THREADS`: the hybrid policy's decode steps run as CUDA
    graphs, so the thread driving the GPU needs one core, and the kernel, which reads DRAM and works
    on the CPU's share while the GPU reads its own in place, gains from the rest up to about the
    threads that fill the memory bus. Past that a larger team only waits longer for its slowest
    thread each layer: at a 25% bank under uniform routing (BENCHMARKS.md) 15 of 16 threads decoded
    8-11% faster than 12 on two H100 hosts, 16 of 32 cores 13% faster than 8 on an H200 host, while
    31 of 32 decoded 3x slower than 8 there and 63 of 64 cores gave 3.97 tok/s where one rank of
    two gave 39."""
    return min(all_but_one(cpus), MAX_DEFAULT_THREADS)


_wanted: int | None = None   # the team a first use takes (`want_threads`; None: `default_threads`)


def want_threads(threads: int | None) -> None:
    """The team size the kernel takes at its first use, unless `set_threads` decides first: an engine on
    the CPU device wants every core torch computes on (no thread of its drives a GPU)."""
    global _wanted
    _wanted = threads


def set_threads(threads: int | None = None) -> int:
    """Size the kernel's thread team and pin its workers, one per core, away from the first core of
    this process's CPU set, where the calling (Python) thread runs as the team's thread 0. Returns
    the team size. None: `default_threads` of the CPUs this process may use."""
    global _threads
    cpus = usable_cpus()
    n = max(1, threads or default_threads(len(cpus)))
    _pin(n, cpus)
    _threads = n
    return n


def pin_team() -> None:
    """Pin the team of the calling thread as `set_threads` pinned the first: OpenMP keeps a team per
    thread that starts parallel work, so another thread that calls the kernel (the one computing a
    prompt's CPU share) would otherwise run an unpinned team of its own."""
    if _threads is None:
        set_threads(_wanted)
    else:
        _pin(_threads, usable_cpus())


def _pin(threads: int, cpus: list[int]) -> None:
    lib = load()
    if lib is not None:
        workers = cpus[1:] or cpus
        lib.moe_cpu_init(threads, (ctypes.c_int32 * len(workers))(*workers), len(workers))


def set_prefetch(nbytes: int | None = None) -> None:
    """How far ahead of its reads the kernel asks for weight lines (bytes; 0: none; None:
    PREFETCH_BYTES), for every call from now on, the stream worker's too (benchmarks compare them)."""
    _ready().moe_cpu_set_prefetch(PREFETCH_BYTES if nbytes is None else int(nbytes))


def _ready() -> ctypes.CDLL:
    lib = load()
    if lib is None:
        raise RuntimeError(f"the CPU expert kernel is unavailable: {_reason}")
    if _threads is None:
        set_threads(_wanted)
    return lib


def _check_once(slots: Mapping[str, Tensor], dtype_of: Mapping[str, torch.dtype]) -> None:
    """A host tier's stacks are checked once: CPU, contiguous, each tensor of its expected dtype."""
    first = next(iter(slots.values()))
    if _checked.get(id(slots)) is first:
        return
    for name, t in slots.items():
        if t.device.type != "cpu" or not t.is_contiguous() or t.dtype != dtype_of.get(name, t.dtype):
            raise ValueError(f"the CPU expert kernel needs contiguous CPU slot tensors; {name} is not one")
    _checked[id(slots)] = first


def _pairs(slot_ids: Tensor, weights: Tensor, S: int) -> tuple[np.ndarray, ...] | None:
    """The call's (token, expert) pairs grouped by expert: used experts, each one's offset into the
    pairs, the pairs' tokens and routing weights (None when no pair is valid)."""
    k = slot_ids.shape[1]
    ids = slot_ids.reshape(-1).numpy()
    pairs = np.flatnonzero((ids >= 0) & (ids < S))
    if not pairs.size:
        return None
    pairs = pairs[np.argsort(ids[pairs], kind="stable")]
    sorted_ids = ids[pairs]
    starts = np.flatnonzero(np.concatenate(([True], sorted_ids[1:] != sorted_ids[:-1])))
    return (sorted_ids[starts].astype(np.int32), np.append(starts, len(pairs)).astype(np.int32),
            (pairs // k).astype(np.int32), weights.reshape(-1).float().numpy()[pairs].astype(np.float32))


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def cpu_moe(hidden: Tensor, slots: Mapping[str, Tensor], slot_ids: Tensor, weights: Tensor,
            activation: str | Activation = "swiglu", out_dtype: torch.dtype | None = None) -> Tensor:
    """`moe_reference(hidden, slots..., slot_ids, weights)` on the CPU through the C kernel: (T, H) in
    `out_dtype` (default hidden's; float32 keeps the fp32 sum for a caller that adds it to other rows).

    `slots` holds stacked CPU tensors (`gate_up` (S, 2I, H), `down` (S, H, I), optional biases) in
    bf16 or fp32; `slot_ids` (T, k) indexes them, -1 for pairs computed elsewhere."""
    lib = _ready()
    gate_up, down = slots["gate_up"], slots["down"]
    _check_once(slots, {name: gate_up.dtype for name in slots})
    S, two_i, H = gate_up.shape
    I = two_i // 2
    act = Activation.of(activation)
    out = torch.zeros(slot_ids.shape[0], H, dtype=torch.float32)
    grouped = _pairs(slot_ids, weights, S)
    if grouped is not None:
        experts, pair_off, pair_tok, pair_w = grouped
        x = hidden.to(gate_up.dtype).contiguous()
        scratch = torch.empty(len(pair_tok), two_i, dtype=torch.float32)
        act_buf = torch.empty(len(pair_tok), I, dtype=gate_up.dtype)
        lib.moe_cpu_experts(_ptr(gate_up), _ptr(down), _ptr(slots.get("gate_up_bias")), _ptr(slots.get("down_bias")),
                            DTYPES[gate_up.dtype], H, I, ACTIVATION_CODES[act.name], act.alpha, act.limit,
                            len(experts), experts.ctypes.data, pair_off.ctypes.data, pair_tok.ctypes.data,
                            pair_w.ctypes.data, x.data_ptr(), scratch.data_ptr(), act_buf.data_ptr(), out.data_ptr())
    return out.to(out_dtype or hidden.dtype)


def supports_quant(spec: StoredSpec) -> bool:
    """The quantized formats the kernel reads as stored: affine 8/4/2 bits and NF4 with scales in bf16,
    fp16 (GGUF's Q4_0 and Q8_0) or fp32; FP8 e4m3 with block, per-channel or per-tensor scales (bf16
    or fp32); MXFP4 (e2m1 codes, e8m0 scales per 32 values). 3-bit packs straddle bytes: those keep
    the plain-torch reference."""
    if isinstance(spec, Mxfp4Spec):
        return True
    if isinstance(spec, Fp8Spec):
        return spec.scale_dtype in (torch.bfloat16, torch.float32)
    return spec.bits in (8, 4, 2) and (spec.kind == "int" or spec.bits == 4) and spec.scale_dtype in SCALE_DTYPES


def reads(spec: StoredSpec) -> bool:
    """Whether the kernel builds on this machine and reads `spec` as stored (`supports_quant`)."""
    return supports_quant(spec) and load() is not None


class QuantLayout(ctypes.Structure):
    """How a layer's quantized experts are laid out, as the kernel reads them (`QuantLayout` in
    cpu_moe.c): code width and meaning, scale dtype, and per projection (gate_up, down) the columns a
    scale covers, the rows of one expert, the rows a scale row covers, where gate_up's second grid
    starts (FP8: the up rows) and the scale rows of one expert."""

    _fields_ = [("bits", ctypes.c_int32), ("codes", ctypes.c_int32), ("sdtype", ctypes.c_int32),
                *((name, ctypes.c_int32 * 2) for name in ("group", "rows", "sdiv", "split", "srows")),
                ("table", ctypes.c_float * 16)]


def _codes(spec: StoredSpec) -> tuple[int, int, int, ctypes.Array]:
    """A spec's code width, code meaning (0: the table, 1: FP8 e4m3 bytes), scale dtype and code table."""
    if isinstance(spec, Fp8Spec):
        return 8, 1, SCALE_DTYPES[spec.scale_dtype], (ctypes.c_float * 16)()
    table = (ctypes.c_float * 16)(*code_table(spec).tolist())
    if isinstance(spec, Mxfp4Spec):   # e2m1 codes (the table), one e8m0 scale per 32 values
        return 4, 0, 2, table
    return spec.bits, 0, SCALE_DTYPES[spec.scale_dtype], table


def quant_layout(spec: StoredSpec, hidden: int, intermediate: int) -> QuantLayout:
    """The kernel's view of experts of `spec` with these widths (the specs `supports_quant` names)."""
    H, I = hidden, intermediate
    rows = (2 * I, H)
    bits, codes, sdtype, table = _codes(spec)
    if isinstance(spec, Fp8Spec):   # e4m3 bytes, float block grids; gate_up: the gate's grid, then the up's
        (gn, gk), (dn, dk) = spec.block(I, H), spec.block(H, I)
        return QuantLayout(bits, codes, sdtype, (gk, dk), rows, (gn, dn), (I, 0),
                           (2 * spec.scale_shape(I, H)[0], spec.scale_shape(H, I)[0]), table)
    return QuantLayout(bits, codes, sdtype, (spec.group, spec.group), rows, (1, 1), (0, 0), rows, table)


@functools.cache
def linear_layout(spec: StoredSpec, rows: int, cols: int) -> QuantLayout:
    """The kernel's view of one (rows, cols) quantized weight (a linear layer's), as its first projection;
    built once per weight shape (a decode step asks it for every quantized linear), read-only after."""
    bits, codes, sdtype, table = _codes(spec)
    if isinstance(spec, Fp8Spec):
        bn, bk = spec.block(rows, cols)
        return QuantLayout(bits, codes, sdtype, (bk, bk), (rows, rows), (bn, bn), (0, 0),
                           (spec.scale_shape(rows, cols)[0],) * 2, table)
    return QuantLayout(bits, codes, sdtype, (spec.group, spec.group), (rows, rows), (1, 1), (0, 0), (rows, rows), table)


# Inputs up to which a CPU quantized linear reads its rows in place (one pass over the weight, every
# input meeting each row): a decode step's few tokens. Longer inputs dequantize the weight once for
# one GEMM, which beats a pass of row dot products per token there.
QLINEAR_MAX_TOKENS = 8


def cpu_quant_linear(x: Tensor, qweight: Tensor, scales: Tensor, biases: Tensor | None,
                     spec: QuantSpec | Fp8Spec) -> Tensor:
    """x (T, K) times the quantized weight's rows ((N, K) as stored), fp32 (T, N), through the C kernel:
    `quant_linear_reference`'s product without dequantizing the weight into memory (each value decoded
    in registers and multiplied in fp32, the weight not rounded to x's dtype first). For the specs
    `supports_quant` names and contiguous tensors."""
    lib = _ready()
    N, K, T = qweight.shape[0], x.shape[1], x.shape[0]
    layout = linear_layout(spec, N, K)
    xs = _phase_ordered(x, layout.bits)
    out = torch.empty(T, N, dtype=torch.float32)
    lib.moe_cpu_qlinear(_ptr(qweight), _ptr(scales), _ptr(biases), ctypes.byref(layout), N, K, T, xs.data_ptr(),
                        out.data_ptr())
    return out


def _quant_stack(stack: Mapping[str, Tensor], spec: StoredSpec) -> dict[str, Tensor | None]:
    """A quantized stack's tensors by role: `<proj>` (packed values: `.qweight`, or MXFP4's `.blocks`),
    `<proj>.scales`, `<proj>.qbias` (the affine quantization's offsets) and `<proj>_bias` (the experts'
    own biases)."""
    out: dict[str, Tensor | None] = {}
    for proj in ("gate_up", "down"):
        out[proj] = stack[f"{proj}.blocks" if isinstance(spec, Mxfp4Spec) else f"{proj}.qweight"]
        out[f"{proj}.scales"] = stack[f"{proj}.scales"]
        out[f"{proj}.qbias"] = stack.get(f"{proj}.biases")
        out[f"{proj}_bias"] = stack.get(f"{proj}_bias")
    return out


def _quant_dtypes(stack: Mapping[str, Tensor], spec: StoredSpec, bias_dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The dtype each tensor of a quantized stack must have."""
    scale = torch.uint8 if isinstance(spec, Mxfp4Spec) else spec.scale_dtype
    return {n: torch.uint8 if n.endswith((".qweight", ".blocks")) else bias_dtype if n.endswith("_bias") else scale
            for n in stack}


def _phase_ordered(x: Tensor, bits: int) -> Tensor:
    """(n, K) → fp32 with value j*v + p of each row at p*(K/v) + j (v = 8/bits values per byte)."""
    v = 8 // bits
    n, K = x.shape
    return x.float().reshape(n, K // v, v).transpose(1, 2).contiguous()


def cpu_moe_quant(hidden: Tensor, slots: Mapping[str, Tensor], slot_ids: Tensor, weights: Tensor, spec: StoredSpec,
                  out_dtype: torch.dtype | None = None, activation: str | Activation = "swiglu") -> Tensor:
    """The reference of the format (`quant_moe_reference`, `mxfp4_moe_reference` with the experts' biases
    and `activation`) on the CPU through the C kernel, for the specs `supports_quant` names: the stored
    values are decoded in registers and multiplied in fp32 (the weights are not rounded to the hidden
    dtype first, the activation is, as the reference's down product takes it). Experts' biases
    (`gate_up_bias`, `down_bias`) must be in the hidden rows' dtype, bf16 or fp32."""
    lib = _ready()
    act = Activation.of(activation)
    _check_once(slots, _quant_dtypes(slots, spec, hidden.dtype))
    parts = _quant_stack(slots, spec)
    q = parts["gate_up"]
    S, two_i = q.shape[:2]
    I, H = two_i // 2, parts["down"].shape[1]
    out = torch.zeros(slot_ids.shape[0], H, dtype=torch.float32)
    grouped = _pairs(slot_ids, weights, S)
    if grouped is not None:
        experts, pair_off, pair_tok, pair_w = grouped
        layout = quant_layout(spec, H, I)
        x = _phase_ordered(hidden, layout.bits)
        scratch = torch.empty(len(pair_tok), two_i, dtype=torch.float32)
        act_buf = torch.empty(len(pair_tok), I, dtype=torch.float32)
        fast = _q4_bf16(spec, hidden, H, I)
        if fast:   # bf16 inputs (exact: they hold bf16 values), their group sums; the activations' likewise
            x_bf16, x_sum = x.to(torch.bfloat16), hidden.float().view(-1, H // spec.group, spec.group).sum(-1)
            act_bf16 = torch.empty(len(pair_tok), I, dtype=torch.bfloat16)
            act_sum = torch.empty(len(pair_tok), I // spec.group, dtype=torch.float32)
        else:
            x_bf16 = x_sum = act_bf16 = act_sum = None
        biased = parts["gate_up_bias"] is not None or parts["down_bias"] is not None
        if biased and hidden.dtype not in DTYPES:
            raise ValueError(f"the CPU expert kernel reads experts' biases in bf16 or fp32, got {hidden.dtype}")
        lib.moe_cpu_experts_quant(
            _ptr(q), _ptr(parts["gate_up.scales"]), _ptr(parts["gate_up.qbias"]), _ptr(parts["down"]),
            _ptr(parts["down.scales"]), _ptr(parts["down.qbias"]), ctypes.byref(layout), _ptr(parts["gate_up_bias"]),
            _ptr(parts["down_bias"]), DTYPES.get(hidden.dtype, 1), ACTIVATION_CODES[act.name], act.alpha, act.limit,
            int(hidden.dtype == torch.bfloat16), H, I, len(experts), experts.ctypes.data, pair_off.ctypes.data,
            pair_tok.ctypes.data, pair_w.ctypes.data, x.data_ptr(), scratch.data_ptr(), act_buf.data_ptr(),
            out.data_ptr(), int(fast), _ptr(x_bf16), _ptr(x_sum), _ptr(act_bf16), _ptr(act_sum))
    return out.to(out_dtype or hidden.dtype)


def cpu_moe_quant_pairs(hidden: Tensor, slots: Mapping[str, Tensor], slot_ids: Tensor, weights: Tensor,
                        spec: StoredSpec) -> Tensor:
    """`cpu_moe_quant`'s (T, k, H) fp32 pair rows, each weighted and written once (zero where
    unrouted), not summed: the kernel sees T·k single-pair tokens (each pair's input row its token's),
    so a caller sums them in one fixed order however many calls computed them (a bounded bank's
    resident and staged slots, or all of them at once) and gets the same bits."""
    T, k = slot_ids.shape
    rows = cpu_moe_quant(hidden.repeat_interleave(k, dim=0), slots, slot_ids.reshape(T * k, 1),
                         weights.reshape(T * k, 1), spec, out_dtype=torch.float32)
    return rows.view(T, k, hidden.shape[1])


def _q4_bf16(spec: QuantSpec, hidden: Tensor, H: int, I: int) -> bool:
    """Whether the kernel's affine 4-bit path with bf16 dot products takes this call: bf16 hidden
    rows (their values, and the rounded activations, are exact in bf16) and whole groups of 64n, or groups
    of 32 read in pairs (GGUF's Q4_0 and GPTQ's g32: H and I multiples of 64); cpu_moe.c's `q4_groups_fit`."""
    if not (isinstance(spec, QuantSpec) and spec.kind == "int" and spec.bits == 4 and hidden.dtype == torch.bfloat16):
        return False
    g = spec.group
    return all((g % 64 == 0 and n % g == 0) or (g == 32 and n % 64 == 0) for n in (H, I))


# ---- the stream worker ---------------------------------------------------------------------------

class _StreamLayer(ctypes.Structure):
    """One layer as the worker sees it (`StreamLayer` in cpu_moe.c)."""

    _fields_ = [*((name, ctypes.c_void_p) for name in (
        "gate_up", "down", "gate_up_bias", "down_bias", "post", "ids", "weights", "hidden", "result", "out",
        "busy_s", "counts", "gate_up_scales", "gate_up_qbias", "down_scales", "down_qbias")),
        ("quantized", ctypes.c_int32), ("q", QuantLayout)]


def code_table(spec: StoredSpec) -> Tensor:
    """The value of each code of a quantized spec, as the kernel reads it (16 floats; FP8 codes are
    decoded from their bits, not a table: zeros)."""
    table = torch.zeros(16)
    if isinstance(spec, Mxfp4Spec):
        table[:] = torch.tensor(FP4_VALUES)
    elif isinstance(spec, Fp8Spec):
        pass
    elif spec.kind == "nf":
        table[:1 << spec.bits] = codebook(spec.bits)
    else:
        table[:min(16, 1 << spec.bits)] = torch.arange(min(16, 1 << spec.bits), dtype=torch.float32)
    return table


class Mailbox:
    """One MoE layer's exchange with the worker, in pinned host memory: what the device posts (header
    [seq, tokens, take, cut], the routing, the routing weights, the hidden rows) and what the worker
    answers (header [seq, pairs computed], fp32 rows). The posted ids name the pairs outside the bank
    (-1 for a pair the bank serves): the CPU computes those, where the post's take is not -1 only the
    first take of them in routing order, and the intermediate rows [0, cut) of the next where cut > 0
    (the device computes the rest)."""

    def __init__(self, top_k: int, hidden: int, max_tokens: int, dtype: torch.dtype, pin: bool):
        def empty(n: int, dt: torch.dtype) -> Tensor:
            return torch.zeros(n, dtype=dt, pin_memory=pin)
        self.post, self.result = empty(16, torch.int32), empty(16, torch.int32)   # a 64-byte line each
        self.ids, self.weights = empty(max_tokens * top_k, torch.int32), empty(max_tokens * top_k, torch.float32)
        self.hidden, self.rows = empty(max_tokens * hidden, dtype), empty(max_tokens * hidden, torch.float32)
        self.busy_s, self.counts = torch.zeros(1, dtype=torch.float64), torch.zeros(3, dtype=torch.int64)

    def served(self) -> tuple[float, int, int, int]:
        """What the worker did so far: compute seconds, calls, pairs and experts."""
        calls, pairs, experts = self.counts.tolist()
        return float(self.busy_s[0]), calls, pairs, experts


class StreamWorker:
    """A C thread that serves the CPU's share of every layer's misses as the device posts them (see
    cpu_moe.c): no Python between a layer's post and its answer, so a whole decode step can run as
    one CUDA graph while the CPU computes. One OpenMP team of its own, pinned off the first CPU,
    spinning while posts come. Which pairs outside the bank are the CPU's, each post says itself
    (`Mailbox.post[2]`)."""

    def __init__(self, stacks: Mapping[int, Mapping[str, Tensor]], mailboxes: Mapping[int, Mailbox], top_k: int,
                 max_tokens: int, activation: str | Activation = "swiglu", threads: int | None = None,
                 specs: Mapping[int, StoredSpec | None] | None = None):
        """`stacks`: every expert of each layer in host RAM, dense (`gate_up`, `down`, optional
        biases) or, where `specs` gives the layer a stored spec, as that format keeps them
        (`<proj>.qweight` / MXFP4's `.blocks`, `.scales`, affine `.biases`, and the experts' own
        `gate_up_bias` / `down_bias` in the hidden rows' dtype: the specs `supports_quant` names)."""
        lib = _ready()
        act = Activation.of(activation)
        specs = specs or {}
        self.layers = list(mailboxes)
        hidden_dtype = next(iter(mailboxes.values())).hidden.dtype
        if hidden_dtype not in DTYPES:
            raise ValueError(f"the CPU expert kernel takes bf16 or fp32 hidden rows, got {hidden_dtype}")
        layouts = {}
        structs = (_StreamLayer * len(self.layers))()
        for i, layer in enumerate(self.layers):
            stack, box, spec = stacks[layer], mailboxes[layer], specs.get(layer)
            if spec is None:
                gate_up, down = stack["gate_up"], stack["down"]
                if not supports(gate_up.dtype, act) or gate_up.dtype != hidden_dtype:
                    raise ValueError(f"the CPU expert kernel takes bf16 or fp32 experts in the hidden rows' dtype with "
                                     f"{', '.join(ACTIVATION_CODES)}; got {gate_up.dtype} and {act.name}")
                _check_once(stack, {name: gate_up.dtype for name in stack})
                E, two_i, H = gate_up.shape
                quant = dict(quantized=0)
                parts = {"gate_up_bias": stack.get("gate_up_bias"), "down_bias": stack.get("down_bias")}
            else:
                if not supports_quant(spec) or act.name not in ACTIVATION_CODES:
                    raise ValueError(f"the CPU expert kernel does not read {spec.name} experts with {act.name}")
                _check_once(stack, _quant_dtypes(stack, spec, hidden_dtype))
                parts = _quant_stack(stack, spec)
                gate_up, down = parts["gate_up"], parts["down"]
                E, two_i, H = gate_up.shape[0], gate_up.shape[1], down.shape[1]
                layouts[layer] = quant_layout(spec, H, two_i // 2)
                quant = dict(quantized=1, q=layouts[layer],
                             gate_up_scales=_ptr(parts["gate_up.scales"]), gate_up_qbias=_ptr(parts["gate_up.qbias"]),
                             down_scales=_ptr(parts["down.scales"]), down_qbias=_ptr(parts["down.qbias"]))
            structs[i] = _StreamLayer(
                gate_up=_ptr(gate_up), down=_ptr(down), gate_up_bias=_ptr(parts["gate_up_bias"]),
                down_bias=_ptr(parts["down_bias"]), post=_ptr(box.post),
                ids=_ptr(box.ids), weights=_ptr(box.weights), hidden=_ptr(box.hidden), result=_ptr(box.result),
                out=_ptr(box.rows), busy_s=_ptr(box.busy_s), counts=_ptr(box.counts), **quant)
        self._keep = (stacks, mailboxes, layouts)
        last = (ctypes.c_int32 * len(self.layers))(*[int(mailboxes[layer].post[0]) for layer in self.layers])
        cpus = usable_cpus()
        workers = cpus[1:] or cpus
        self.threads = max(1, threads or default_threads(len(cpus)))
        arr = (ctypes.c_int32 * len(workers))(*workers)
        self._handle = lib.moe_stream_start(structs, last, len(self.layers), DTYPES[hidden_dtype], H,
                                            two_i // 2, top_k, E, max_tokens, ACTIVATION_CODES[act.name], act.alpha,
                                            act.limit, self.threads, arr, len(workers))
        if not self._handle:
            raise RuntimeError("the CPU expert worker thread could not start")
        self._lib = lib

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread (it finishes the layer it is serving); raises when it does not stop in
        `timeout_s` (a stuck team is left running rather than waited on forever)."""
        if self._handle:
            handle, self._handle = self._handle, None
            if self._lib.moe_stream_stop(handle, timeout_s) != 0:
                raise RuntimeError(f"the CPU expert worker did not stop within {timeout_s:g} s; it is left running")

    def __del__(self) -> None:
        self.close()


def publish(header: Tensor, seq: int) -> None:
    """Make `seq` visible in a post's header after the writes before it (host-side posts)."""
    _ready().moe_stream_publish(header.data_ptr(), seq)


def answered(header: Tensor, seq: int) -> bool:
    """Whether the worker's answer carries `seq` already (no wait; an aligned int32 read)."""
    return int(header[0]) == seq


def wait_answer(header: Tensor, seq: int, timeout_s: float = 30.0) -> bool:
    """Wait (GIL released) until the worker's answer carries `seq`; False on timeout."""
    return _ready().moe_stream_wait(header.data_ptr(), seq, timeout_s) == 0
