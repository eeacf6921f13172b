"""Run a script of kernel checks on the CPU under Triton's interpreter, in a subprocess.

`TRITON_INTERPRET=1` must be set before Triton is imported, hence the subprocess: a child of one
process per test worker that has imported torch and Triton under it (see `_FORK_SERVER`). The preamble works
around two interpreter bugs, leaving the kernels' meaning unchanged:
- Triton 3.6's interpreter turns a scalar into a Python int with `int(array of shape (1,))`, which
  numpy >= 2.4 refuses; the preamble reads the single element instead (the same value under any numpy).
- The interpreter keeps some int1 results (`a & b` of two masks, one a scalar) as int32 arrays, and
  from Triton 3.8 its masked loads and stores refuse a mask that is not a bool array; the preamble
  hands them the same mask as bools (the compiled kernels have a real int1 there).
- Triton 3.6's interpreter holds bfloat16 as its uint16 bits: `tl.dot` multiplies those bits as
  integers, and a cast from fp32 truncates where the compiled kernel rounds to nearest even. The
  preamble hands `tl.dot` the exact fp32 values of bf16 operands and rounds the casts to nearest
  even, so bf16 kernels compute under the interpreter what they compute compiled.
And one for time: the interpreter patches `triton.language` again at every call of a `@triton.jit`
helper (with `inspect.getmembers`, about half of a kernel check's time), although the launch around it
has already patched the same modules, with the same functions; a helper's call now patches only
modules its launch has not (and which those are is worked out once per module). The numpy dtype of a
Triton type, which the interpreter looks up at nearly every operation by building a table, is kept
once found. Every int32 add, sub and mul builds the interpreter's overflow check (a dozen interpreted
operations) whose only effect is a device assert, which without `debug` (the interpreter's default,
and these scripts') does nothing; the check is built only where `debug` is on.
"""

from __future__ import annotations

import importlib.util
import subprocess
import textwrap
from pathlib import Path

import torch

from fork_server import ForkServer

HAS_TRITON = importlib.util.find_spec("triton") is not None
# With a GPU the compiled kernels are tested directly; the interpreter is the CPU machine's check.
INTERPRETER_SKIP = dict(condition=not HAS_TRITON or torch.cuda.is_available(),
                        reason="needs Triton and no GPU (with a GPU the compiled kernels are tested)")

_PREAMBLE = textwrap.dedent("""
    import triton.runtime.interpreter as _interpreter

    _patch_tensor = _interpreter._patch_lang_tensor
    def _patch_tensor_index(tensor, scope):
        _patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    _interpreter._patch_lang_tensor = _patch_tensor_index

    import inspect as _inspect
    def _bool_masks(name):
        original = getattr(_interpreter.InterpreterBuilder, name, None)
        if original is None:
            return
        where = list(_inspect.signature(original).parameters).index("mask")
        def call(self, *args, **kwargs):
            args = list(args)
            mask = args[where - 1] if len(args) >= where else kwargs.get("mask")
            if mask is not None and mask.data.dtype != bool:
                mask = _interpreter.TensorHandle(mask.data.astype(bool), mask.dtype)
                if len(args) >= where:
                    args[where - 1] = mask
                else:
                    kwargs["mask"] = mask
            return original(self, *args, **kwargs)
        setattr(_interpreter.InterpreterBuilder, name, call)
    for _name in ("create_masked_load", "create_masked_store", "create_atomic_rmw", "create_atomic_load",
                  "create_atomic_store"):
        _bool_masks(_name)

    import numpy as _np
    import triton.language as _tl

    def _bf16_as_fp32(x):
        if x.dtype.scalar != _tl.bfloat16:
            return x
        return _interpreter.TensorHandle((x.data.astype(_np.uint32) << 16).view(_np.float32), _tl.float32)
    _create_dot = _interpreter.InterpreterBuilder.create_dot
    _interpreter.InterpreterBuilder.create_dot = lambda self, a, b, *rest: _create_dot(
        self, _bf16_as_fp32(a), _bf16_as_fp32(b), *rest)
    _cast_impl = _interpreter.InterpreterBuilder.cast_impl
    def _cast_rounding_bf16(self, src, dst_type):
        if src.dtype.scalar != _tl.float32 or dst_type.scalar != _tl.bfloat16:
            return _cast_impl(self, src, dst_type)
        bits = _np.asarray(src.data, dtype=_np.float32).view(_np.uint32).astype(_np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(_np.uint16)
        nan = (bits & 0x7FFFFFFF) > 0x7F800000
        return _interpreter.TensorHandle(_np.where(nan, _np.uint16(0x7FC0), rounded), _tl.bfloat16)
    _interpreter.InterpreterBuilder.cast_impl = _cast_rounding_bf16   # create_fp_trunc calls it too
    _lang_ids_of = {}
    def _lang_ids(fn):
        key = id(fn.__globals__)   # a module's dict: the language modules it imported stay the same ones
        if key not in _lang_ids_of:
            _lang_ids_of[key] = frozenset(id(v) for v in fn.__globals__.values()
                                          if _inspect.ismodule(v) and v in (_tl, _tl.core))
        return _lang_ids_of[key]
    _launch_langs = [frozenset()]
    _patch_lang = _interpreter._patch_lang
    def _patch_lang_for_launch(fn):
        scope = _patch_lang(fn)
        _launch_langs.append(_launch_langs[-1] | _lang_ids(fn))
        restore = scope.restore
        def _restore():
            _launch_langs.pop()
            restore()
        scope.restore = _restore
        return scope
    _interpreter._patch_lang = _patch_lang_for_launch
    def _device_call(self, *args, **kwargs):
        langs = _lang_ids(self.fn)
        if not langs <= _launch_langs[-1]:
            _patch_lang(self.fn)             # (upstream never restores a helper's patch either)
            _launch_langs[-1] = _launch_langs[-1] | langs
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise _interpreter.InterpreterError(repr(e)) from e
    _interpreter.InterpretedFunction.__call__ = _device_call

    _np_dtypes = {}
    _get_np_dtype = _interpreter._get_np_dtype
    def _cached_np_dtype(tt_dtype):
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, _tl.block_type) else tt_dtype   # blocks: their element's
        if isinstance(scalar, _tl.pointer_type):
            return _np.dtype(_np.uint64)
        if scalar not in _np_dtypes:
            _np_dtypes[scalar] = _get_np_dtype(scalar)
        return _np_dtypes[scalar]
    _interpreter._get_np_dtype = _cached_np_dtype

    _semantic = _interpreter.interpreter_semantic
    _sanitize_overflow = _semantic.binary_op_sanitize_overflow_impl
    def _sanitize_overflow_where_asserted(lhs, rhs, binary_op):
        if _semantic.builder.options.debug:   # device_assert returns at once otherwise
            _sanitize_overflow(lhs, rhs, binary_op)
    _semantic.binary_op_sanitize_overflow_impl = _sanitize_overflow_where_asserted
""")


# A process per test worker that has run the preamble and imported torch and Triton (about 3 s a
# process) under TRITON_INTERPRET=1, and forks a child for each script: the child starts where a
# fresh `python -c PREAMBLE + script` would be after those imports, with the preamble's names, and
# exits with the code that process would have (`fork_server.py`).
_INTERPRETER = ForkServer(warm="import numpy, torch, triton, triton.language", preload=_PREAMBLE,
                          env={"TRITON_INTERPRET": "1"})


def run_under_interpreter(script: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `script` (dedented) with TRITON_INTERPRET=1 and the repository importable, as
    `python -c PREAMBLE + script` would (a child of the worker's fork server)."""
    script = textwrap.dedent(script)
    return _INTERPRETER.run(script, ["python", "-c", script], timeout)


def run_checks_under_interpreter(checks: Path, body: str, timeout: float = 300) -> None:
    """Run `body` under the interpreter with the public names of the checks module at `checks` (a file
    beside the tests that also run it compiled on a GPU) and torch imported; fail with its error output."""
    script = (f"import sys, torch\nsys.path.insert(0, {str(checks.parent)!r})\nfrom {checks.stem} import *\n"
              + textwrap.dedent(body) + '\nprint("checks ok")\n')
    result = run_under_interpreter(script, timeout=timeout)
    assert result.returncode == 0 and "checks ok" in result.stdout, result.stderr[-4000:]


def check_all_under_interpreter(checks: Path, timeout: float = 300, dtypes: str = "torch.float32, torch.float16") -> None:
    """Run the `check_all("cpu", (dtypes))` of the checks module at `checks` under the interpreter."""
    run_checks_under_interpreter(checks, f'check_all("cpu", ({dtypes},))', timeout=timeout)
