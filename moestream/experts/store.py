"""The expert store: where every routed expert lives off the device, read one expert at a time.

Experts are read by byte range straight from the checkpoint's safetensors files (never whole
files). The store knows where an expert's gate, up and down weights are on disk; the expert
format it is asked for says how they become that format's tensors: read in place when the bytes
already are the format (`ExpertFormat.raw_views`), converted through `ExpertFormat.encode` else.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor

from moestream.archs.spec import ArchSpec, ModelConfig
from moestream.checkpoint.safetensors_index import TensorIndex
from moestream.errors import CheckpointError
from moestream.experts.format import ExpertFormat, ExpertShape


def read_workers() -> int:
    """Threads for parallel preads and digests (os.preadv and hashlib release the GIL)."""
    return max(2, min(16, (os.cpu_count() or 2)))


class ExpertStore:
    """Disk tier: every read is a pread of the three projection tensors of one expert."""

    def __init__(self, index: TensorIndex, config: ModelConfig, spec: ArchSpec):
        self.index, self.config, self.spec = index, config, spec
        self.shape = ExpertShape(config.hidden_size, config.moe_intermediate)
        self.num_experts = config.num_experts
        self.moe_layers = [i for i, is_moe in enumerate(config.moe_layers) if is_moe]
        self.dtype = self._check_and_dtype()   # the checkpoint's own dtype of the expert weights

    def _check_and_dtype(self) -> torch.dtype:
        """Validate every expert tensor's presence and shape up front: fail before loading, not midway."""
        I, H = self.shape.intermediate, self.shape.hidden
        dtypes = set()
        for layer in self.moe_layers:
            for e in range(self.num_experts):
                for name, shape in zip(self.spec.expert_tensor_names(layer, e), ((I, H), (I, H), (H, I))):
                    info = self.index.info(name)
                    if info.shape != shape:
                        raise CheckpointError(
                            f"tensor {name!r} has shape {list(info.shape)} but config.json implies {list(shape)}; "
                            "the config does not match the weights."
                        )
                    dtypes.add(info.dtype)
        if len(dtypes) > 1:
            raise CheckpointError(f"expert tensors mix dtypes {sorted(map(str, dtypes))}; re-convert the checkpoint to one dtype.")
        return dtypes.pop() if dtypes else torch.float32

    def read_into(self, layer: int, expert: int, fmt: ExpertFormat, out: Mapping[str, Tensor]) -> None:
        """Read one expert into `out` (CPU tensors of `fmt`, one expert's worth)."""
        names = self.spec.expert_tensor_names(layer, expert)
        infos = [self.index.info(n) for n in names]
        views = fmt.raw_views(out, self.dtype)
        if views is None:
            I, H = self.shape.intermediate, self.shape.hidden
            views = (torch.empty((I, H), dtype=self.dtype), torch.empty((I, H), dtype=self.dtype),
                     torch.empty((H, I), dtype=self.dtype))
            for info, view in zip(infos, views):
                self.index.read_into(info, view)
            fmt.encode(*views, out)
            return
        for info, view in zip(infos, views):
            self.index.read_into(info, view)

    def read_many(self, layer: int, experts: list[int], fmt: ExpertFormat, out: Mapping[str, Tensor]) -> None:
        """Read experts[i] into row i of the stacked CPU tensors `out`, with parallel preads."""
        def one(i: int) -> None:
            self.read_into(layer, experts[i], fmt, {name: t[i] for name, t in out.items()})

        with ThreadPoolExecutor(read_workers()) as pool:
            list(pool.map(one, range(len(experts))))
