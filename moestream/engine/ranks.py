"""Expert parallel planning: each rank's budget, its share of the experts and its memory plan.

A budget is per device: `--gpu-memory` as given, or (without one, on CUDA) the rank's own device's
free memory less headroom, split evenly among the ranks placed on that device (gloo on one GPU).
With budgets that differ (heterogeneous cards), each rank owns experts in proportion to the bytes
its budget leaves for the bank once everything every rank holds (dense weights, KV cache,
workspace, staging) is counted, so every rank keeps the same fraction of its experts resident;
equal budgets, a `--capacity` or unbounded CPU ranks keep round-robin's equal shares.

In a running group each rank measures its own device and the ranks exchange their budgets before
placing experts (`engine/build.py`); `moestream check` plans every rank in one process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moestream.engine.config import EngineConfig
from moestream.engine.plan import LoadPlan, default_device_budget, device_budget, plan_load, read_model, resolve_device
from moestream.errors import InputError
from moestream.experts.sharded import Placement, expert_counts
from moestream.runtime.distributed import rank_config

FreeMemory = Callable[[torch.device], int | None]   # a device's usable free bytes (None: unbounded)


def rank_budget(cfg: EngineConfig, free_memory: FreeMemory = default_device_budget) -> int | None:
    """The budget of one rank (`cfg` is its `rank_config`), as its plan would take it."""
    return device_budget(cfg, resolve_device(cfg.runtime.device), free_memory)


def with_budget(cfg: EngineConfig, budget: int | None) -> EngineConfig:
    """`cfg` planning against `budget` as if it were given (the plan then measures nothing again)."""
    if budget is None or cfg.bank.gpu_memory is not None:
        return cfg
    return dataclasses.replace(cfg, bank=dataclasses.replace(cfg.bank, gpu_memory=budget))


def rank_counts(cfg: EngineConfig, budgets: list[int | None]) -> tuple[int, ...] | None:
    """Experts per rank from the ranks' budgets (None: round-robin's equal shares). `cfg` is any
    rank's configuration: what every rank holds besides its bank is the same on all of them."""
    if any(b is None for b in budgets) or len(set(budgets)) == 1:
        return None
    config = read_model(cfg)[3]
    E, world = config.num_experts, len(budgets)
    check_world(world, E)
    share = -(-E // world)   # the largest equal share, planned at its least capacity: the fixed bytes
    least = min(config.top_k, share)
    bank = dataclasses.replace(cfg.bank, gpu_memory=None, capacity=least)
    memory = plan_load(dataclasses.replace(cfg, bank=bank), experts_here=share).memory
    room = [max(b - memory.fixed_bytes - memory.staging_bytes, 0) for b in budgets]
    return expert_counts(E, room)


def check_world(world: int, num_experts: int) -> None:
    if world > num_experts:
        raise InputError(f"{world} ranks for {num_experts} experts per layer: every rank needs at least one expert; "
                         f"use at most {num_experts} devices.")


@dataclass(frozen=True)
class RankPlan:
    rank: int
    budget: int | None
    placement: Placement
    plan: LoadPlan


def plan_ranks(cfg: EngineConfig, budgets: list[int | None] | None = None,
               free_memory: FreeMemory = default_device_budget) -> list[RankPlan]:
    """Every rank's plan in this process (`moestream check`): budgets as given, else measured with
    `free_memory` per rank's device."""
    world = len(cfg.runtime.devices)
    configs = [rank_config(cfg, rank) for rank in range(world)]
    if budgets is None:
        budgets = [rank_budget(c, free_memory) for c in configs]
    E = read_model(cfg)[3].num_experts
    check_world(world, E)
    counts = rank_counts(configs[0], budgets)
    out = []
    for rank, (c, budget) in enumerate(zip(configs, budgets)):
        placement = Placement(rank, world, E, counts=counts)
        out.append(RankPlan(rank, budget, placement, plan_load(with_budget(c, budget), experts_here=placement.count)))
    return out


def explain_ranks(plans: list[RankPlan]) -> str:
    """One block per rank: its device, its share of the experts and its memory plan (with its budget)."""
    blocks = []
    for r in plans:
        E = r.placement.num_experts
        blocks.append(f"rank {r.rank}            {r.plan.device}: {r.placement.count} of the {E} experts of every layer"
                      f"\n{r.plan.memory.explain()}")
    return "\n\n".join(blocks)
