"""One exception family for everything a user can get wrong.

Every message is one sentence that says what is wrong and what to do about it; the CLI prints
it without a traceback and exits with status 1.
"""

from __future__ import annotations


class MoestreamError(Exception):
    """Base class: a problem the user can fix (bad input, missing file, budget too small)."""


class CheckpointError(MoestreamError):
    """The checkpoint on disk is missing, incomplete, corrupt or disagrees with its config."""


class UnsupportedArchError(MoestreamError):
    """config.json names a model family that has no ArchSpec."""


class InputError(MoestreamError):
    """A prompt, option or argument that cannot be used as given."""


class DeviceError(MoestreamError):
    """The requested device is not available."""


class BudgetError(MoestreamError):
    """A memory budget or bank capacity that cannot hold what the model needs."""


class NumericsError(MoestreamError):
    """The model produced values that cannot be sampled from (NaN or infinite logits)."""


class DistributedError(MoestreamError):
    """A rank of an expert-parallel group failed, stopped answering or could not start."""
