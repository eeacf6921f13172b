"""A preallocated KV cache with a batch dimension: one tensor, allocated once, never resized.

Layout per layer: (batch, max_len, kv_heads, head_dim); cache slot j of row b holds position j
of sequence b, so sequences of different lengths share one batch and a row is written in place.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.batch, self.max_len = batch, max_len
        self.data = torch.zeros(num_layers, 2, batch, max_len, num_kv_heads, head_dim, dtype=dtype, device=device)

    @staticmethod
    def nbytes_for(num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * batch * max_len * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def write(self, layer: int, rows: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """rows, positions: (B, L) long; k, v: (B, L, kv_heads, head_dim)."""
        self.data[layer, 0][rows, positions] = k
        self.data[layer, 1][rows, positions] = v

    def read(self, layer: int, rows: slice, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (B, kv_heads, kv_len, head_dim) over the first kv_len positions of `rows`."""
        k = self.data[layer, 0, rows, :kv_len].transpose(1, 2)
        v = self.data[layer, 1, rows, :kv_len].transpose(1, 2)
        return k, v
