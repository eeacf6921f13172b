"""Router-only discovery: which experts a prompt will want, learned before the bank is filled.

A short warm-up prompt runs through attention, routers and shared experts only (routed experts
are skipped, so nothing needs to be resident yet). Every layer's routing stays on the device and
is read back once, at the end; its per-expert frequencies seed the residency policy, and the
bank is then filled with the experts that prompt used most.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from moestream.model.context import no_cache_context
from moestream.model.decoder import MoECausalLM
from moestream.model.rotary import rotary_table
from moestream.model.routers import ObservedRouter

DEFAULT_PROMPT = (
    "You are a helpful assistant. Explain what this Python function does, then improve it.\n\n"
    "def load_config(path):\n    with open(path) as f:\n        data = json.load(f)\n"
    "    return {k.lower(): v for k, v in data.items() if v is not None}\n"
)


@dataclass
class Discovery:
    frequencies: dict[int, np.ndarray]   # MoE layer → share of prompt tokens routed to each expert
    tokens: int
    seconds: float


def read_back(counts: torch.Tensor) -> np.ndarray:
    """The single device→host transfer of a discovery pass (tests count calls to it)."""
    return counts.cpu().numpy()


class NoRoutedExperts:
    """The routed experts of a router-only pass: none run, every routed output is zero."""

    def forward(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(hidden)

    dispatch = forward


@torch.inference_mode()
def discover_routing(model: MoECausalLM, prompt_ids: list[int], device: torch.device, dtype: torch.dtype) -> Discovery:
    t0 = time.perf_counter()
    blocks = model.moe_blocks()
    seen: list[torch.Tensor] = []
    routers = [block.swap_router(ObservedRouter(block.router, seen.append)) for block in blocks]
    experts = [block.experts for block in blocks]
    model.attach_experts(NoRoutedExperts())
    try:
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
        ctx = no_cache_context(rotary_table(model.config, len(prompt_ids), device), ids, None, dtype)
        model(ids, ctx, last_only=True)
    finally:
        for block, router, routed in zip(blocks, routers, experts):
            block.swap_router(router)
            block.experts = routed
    E = model.config.num_experts
    counts = torch.zeros(len(blocks), E, dtype=torch.float32, device=device)
    for row, routed in enumerate(seen):
        flat = routed.reshape(-1)
        counts[row].index_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))
    host = read_back(counts)
    freqs = {block.layer: host[row] / len(prompt_ids) for row, block in enumerate(blocks)}
    return Discovery(freqs, len(prompt_ids), time.perf_counter() - t0)
