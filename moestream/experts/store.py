"""The expert store: where every routed expert lives off the device, read one expert at a time.

Experts are read by byte range straight from the checkpoint's safetensors files (never whole
files) into CPU buffers laid out as the bank wants them: gate_up (2I, H) with gate rows first,
and down (H, I). Pinned buffers make the host→device copy asynchronous on CUDA.
"""

from __future__ import annotations

import torch

from moestream.archs.spec import ArchSpec, ModelConfig
from moestream.checkpoint.safetensors_index import TensorIndex
from moestream.errors import CheckpointError


class ExpertStore:
    """Disk tier: every read is a pread of the three projection tensors of one expert."""

    def __init__(self, index: TensorIndex, config: ModelConfig, spec: ArchSpec):
        self.index, self.config, self.spec = index, config, spec
        I, H = config.moe_intermediate, config.hidden_size
        self.gate_up_shape, self.down_shape = (2 * I, H), (H, I)
        self.moe_layers = [i for i, is_moe in enumerate(config.moe_layers) if is_moe]
        self.dtype = self._check_and_dtype()

    def _check_and_dtype(self) -> torch.dtype:
        """Validate every expert tensor's presence and shape up front: fail before loading, not midway."""
        I, H = self.config.moe_intermediate, self.config.hidden_size
        dtypes = set()
        for layer in self.moe_layers:
            for e in range(self.config.num_experts):
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

    def new_buffers(self, pin: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Staging buffers for one expert, in the store's dtype."""
        gate_up = torch.empty(self.gate_up_shape, dtype=self.dtype, pin_memory=pin)
        down = torch.empty(self.down_shape, dtype=self.dtype, pin_memory=pin)
        return gate_up, down

    def read_into(self, layer: int, expert: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        gate, up, down_name = self.spec.expert_tensor_names(layer, expert)
        I = self.config.moe_intermediate
        self.index.read_into(self.index.info(gate), gate_up[:I])
        self.index.read_into(self.index.info(up), gate_up[I:])
        self.index.read_into(self.index.info(down_name), down)
