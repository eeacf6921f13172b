"""Programmatic dependent launch (Hopper and later): a kernel starts while its predecessor drains.

A decode step is a chain of ~200 small kernels, each waiting for the one before it. Between two
of them the GPU drains the first (its last blocks finish while most SMs idle), then launches and
ramps up the second: about a microsecond per boundary, a tenth of a step. Launched with
`launch_pdl`, a kernel's blocks may be scheduled as soon as every block of its predecessor has
signalled `gdc_launch_dependents` (or exited); they then wait in `gdc_wait` until the predecessor
has completed and its writes are visible. The launch and the ramp-up overlap the drain.

The rule that keeps this correct: a kernel launched so calls `wait_for_producer` before it reads
anything an earlier kernel wrote and before it writes anything (its first statement here), on
every path, early returns included, so that its completion still implies its predecessors'.
Captured CUDA graphs keep the programmatic edges.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .switch import Switch

_enabled = Switch()
# Triton reads TRITON_INTERPRET when it is imported, so the answer cannot change afterwards.
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def wait_for_producer(USE_PDL: tl.constexpr):
    """Block until the previous kernel in the stream has completed (no-op without PDL)."""
    if USE_PDL:
        gdc_wait()


@triton.jit
def release_consumer(USE_PDL: tl.constexpr):
    """Let the next kernel's blocks be scheduled (this block's main work is done)."""
    if USE_PDL:
        gdc_launch_dependents()


@functools.cache
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def pdl_args(t: torch.Tensor) -> dict:
    """Launch keywords for a kernel taking `USE_PDL`: on for CUDA tensors of a Hopper-or-later
    device (never under Triton's interpreter), else off."""
    on = (_enabled.on and t.is_cuda and not _INTERPRETING
          and _supported(t.device.index if t.device.index is not None else torch.cuda.current_device()))
    return {"USE_PDL": True, "launch_pdl": True} if on else {"USE_PDL": False}


def programmatic_launch(enabled: bool):
    """Switch programmatic dependent launch on or off inside the block (A/B runs; graphs captured
    inside keep the choice)."""
    return _enabled.set(enabled)
