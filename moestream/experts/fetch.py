"""The exact miss policy: a layer's missing experts are brought in before its experts run.

A layer that can miss reads its routing back once (the one host sync it needs), copies the
missing experts over evicted slots (the residency policy picks the victims), then dispatches over
the updated slot map. With `cpu_share` > 0 and experts in host RAM, a share of a small call's
missing experts (the ones fewest tokens routed to: a copy costs the same whatever the tokens, the
CPU's work grows with them) is computed on the CPU from host RAM while the others are copied, and
the CPU's rows are added to the device's: both paths are exact and run at once. A call that routes to more experts than the bank can take at once (long
prompts) leaves the bank as it is and streams the missing experts through a double-buffered
staging area instead, so a prompt neither thrashes the decode bank nor needs every expert. With
`prompt_cpu_share` too, the CPU computes a share of such a call's missing experts from host RAM (the
ones fewest of its tokens routed to: a copy costs the same whatever the tokens) in a thread of its
own while the others stream through the staging buffers; at a bank the link is a prompt's bound, and
the cores add their memory bandwidth to it. Both policies' prompts take it (the hybrid policy's
mailboxes hold decode-sized calls only).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from moestream.experts.format import Dispatch, ExpertFormat, ExpertShape, HostDispatch
from moestream.experts.prefetch import Prefetcher
from moestream.experts.residency import ResidencyPolicy
from moestream.experts.slots import SlotTable
from moestream.experts.stats import BankStats
from moestream.experts.transfer import Transfers
from moestream.kernels.switch import Switch

CPU_MAX_TOKENS = 16   # hybrid misses serve decode-sized calls; a prompt's misses are copied or staged
# A staged layer that needed at least this share of the experts the bank lacks has the next layer's
# first groups copied before its routing is known (`Fetcher._copy_ahead`).
AHEAD_ROUTED_SHARE = 0.9

copy_ahead = Switch()        # staged prompts copy the next layer's first groups ahead (A/B: off)
staged_copy_runs = Switch()  # staging copies runs of consecutive experts as one copy per tensor (A/B: off)


@dataclass(frozen=True)
class MissCosts:
    """What a miss costs each way, measured on this machine at the first decode step: copying one
    expert to the device; computing one expert on the CPU for its first token and for each further
    one (the weights are read once, the tokens add arithmetic); the fixed cost of a CPU call
    (hidden rows to the host, the result back); and `contention`, how much longer both paths take
    when they run at once than the slower of them alone (both read host RAM: a host whose memory
    bandwidth cannot feed the PCIe link and the cores together makes a split no better than either
    path alone). Each is timed over experts not read before, so the figures are DRAM's, not a cache's."""

    copy_s: float
    cpu_expert_s: float
    cpu_token_s: float
    cpu_call_s: float
    contention: float = 1.0
    # Each token past an expert's first TILE_TOKENS (None: as `cpu_token_s`). The C kernel streams a
    # row once for up to four tokens; more take further passes over it, from cache, so a prompt's
    # expert of dozens of tokens costs arithmetic that one of two or four does not show.
    cpu_wide_token_s: float | None = None

    TILE_TOKENS = 4   # tokens the C kernel's one pass over a weight row serves

    def describe(self) -> str:
        """One line for --stats: what the split of hybrid misses is deciding with."""
        wide = "" if self.cpu_wide_token_s is None else \
            f" ({self.cpu_wide_token_s * 1e6:.1f} past {self.TILE_TOKENS})"
        return (f"hybrid misses split by: copy {self.copy_s * 1e6:.0f} us/expert, CPU {self.cpu_expert_s * 1e6:.0f} us/expert "
                f"+ {self.cpu_token_s * 1e6:.1f} us per further token{wide}, CPU call {self.cpu_call_s * 1e6:.0f} us, "
                f"contention {self.contention:.2f}x")

    def cpu_s(self, tokens: float) -> float:
        wide = self.cpu_token_s if self.cpu_wide_token_s is None else self.cpu_wide_token_s
        return (self.cpu_expert_s + min(max(0.0, tokens - 1), self.TILE_TOKENS - 1) * self.cpu_token_s
                + max(0.0, tokens - self.TILE_TOKENS) * wide)

    def split(self, order: list[int], tokens: dict[int, int]) -> list[int]:
        """The missing experts the CPU takes: the first m of `order` (the ones it should take first),
        for the m whose predicted time is least (the CPU's m alone, the copies alone, or both at
        once slowed by contention)."""
        n = len(order)
        best_m, best_s, cpu = 0, n * self.copy_s, self.cpu_call_s
        for m, e in enumerate(order, start=1):
            cpu += self.cpu_s(tokens[e])
            took = cpu if m == n else max(cpu, (n - m) * self.copy_s) * self.contention
            if took < best_s:
                best_m, best_s = m, took
        return order[:best_m]

    @classmethod
    def measure(cls, host_stack: Mapping[str, Tensor], host_dispatch: HostDispatch, device: torch.device,
                hidden_size: int, dtype: torch.dtype, repeats: int = 6, group: int = 4) -> MissCosts:
        E = next(iter(host_stack.values())).shape[0]
        group = min(group, E)
        fresh = itertools.count()
        experts = lambda: [next(fresh) % E for _ in range(group)]   # noqa: E731  experts not read before
        dest = {name: torch.empty_like(t[0], device=device) for name, t in host_stack.items()}
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

        def timed(fn) -> float:   # the fastest of a few calls: robust to a busy moment on the host
            fn()
            best = float("inf")
            for _ in range(repeats):
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                best = min(best, time.perf_counter() - t0)
            return best

        def copies() -> None:
            for e in experts():
                for name, d in dest.items():
                    d.copy_(host_stack[name][e], non_blocking=True)

        def on_cpu(tokens: int):
            x = torch.randn(tokens, hidden_size).to(dtype)
            w = torch.ones(tokens, group)
            return lambda: host_dispatch(x, host_stack, torch.tensor([experts()] * tokens, dtype=torch.int32), w)

        wide = 8 * cls.TILE_TOKENS   # a prompt's expert: several passes over each row
        one, four, many, copy = timed(on_cpu(1)), timed(on_cpu(cls.TILE_TOKENS)), timed(on_cpu(wide)), timed(copies)
        cpu_one = on_cpu(1)
        both = timed(lambda: (copies(), cpu_one()))
        x = torch.randn(1, hidden_size).to(dtype)
        return cls(copy_s=copy / group, cpu_expert_s=one / group,
                   cpu_token_s=max(0.0, four - one) / ((cls.TILE_TOKENS - 1) * group),
                   cpu_call_s=timed(lambda: x.to(device).cpu()), contention=max(1.0, both / max(one, copy)),
                   cpu_wide_token_s=max(0.0, many - four) / ((wide - cls.TILE_TOKENS) * group))


def staging_half(staging_slots: int, top_k: int) -> int:
    """Slots in each of the two staging buffers (the memory plan gives the total)."""
    return max(1, staging_slots // 2) if staging_slots else max(top_k, 8)


class Fetcher:
    def __init__(self, slots: SlotTable, transfers: Transfers, policy: ResidencyPolicy, stats: BankStats,
                 dispatch: dict[int, Dispatch], shape: ExpertShape, top_k: int, staging_slots: int,
                 prefetcher: Prefetcher | None = None, host_stacks: dict[int, Mapping[str, Tensor]] | None = None,
                 cpu_share: float | str = 0.0, prompt_cpu_share: float | str = 0.0):
        """`dispatch`: per MoE layer, the dispatch of that layer's expert format. `host_stacks`: every
        expert of every layer in host RAM (the pinned tier), which CPU-computed misses read.
        `cpu_share`: of a decode-sized call's misses; `prompt_cpu_share`: of a streamed (staged) call's;
        each a share, "auto" (by the measured `MissCosts`) or 0 (none)."""
        self.slots, self.transfers, self.policy, self.stats = slots, transfers, policy, stats
        self.dispatch, self.prefetcher, self.shape = dispatch, prefetcher, shape
        if host_stacks is None:
            cpu_share = prompt_cpu_share = 0.0
        self.host_stacks = host_stacks if cpu_share != 0 or prompt_cpu_share != 0 else None
        self.cpu_share, self.prompt_cpu_share = cpu_share, prompt_cpu_share
        self._prompt_cpu: ThreadPoolExecutor | None = None   # the thread a staged call's CPU share runs in
        self.pair_sum = {layer: fmt.pair_sum(slots.device, shape) for layer, fmt in slots.formats.items()}
        self.host_dispatch = ({layer: fmt.host_dispatch(shape) for layer, fmt in slots.formats.items()}
                              if self.host_stacks is not None else {})
        self.costs: MissCosts | None = None   # cpu_share "auto": split by measured costs (see `_cpu_share_of`)
        half = staging_half(staging_slots, top_k)
        formats: dict[str, ExpertFormat] = {fmt.name: fmt for fmt in slots.formats.values()}
        self.staging = {name: [fmt.empty(shape, half, device=slots.device) for _ in range(2)]
                        for name, fmt in formats.items()}
        self._turn = 0
        self._staging_done: list[torch.cuda.Event | None] = [None, None]
        layers = sorted(slots.formats)
        self._next_layer = dict(itertools.pairwise(layers))
        self._ahead: StagedAhead | None = None   # the next layer's groups copied ahead, until it runs

    def forward(self, layer: int, hidden: Tensor, expert_ids: Tensor, weights: Tensor) -> Tensor:
        ahead, self._ahead = self._ahead, None   # only the layer it was copied for can use it, and only now
        ls = self.slots[layer]
        routed = expert_ids.reshape(-1).cpu().numpy()        # the one host sync of a layer that may miss
        flat = routed[routed >= 0]                            # -1: held elsewhere (another rank's expert)
        experts, counts = np.unique(flat, return_counts=True)
        missing = [e for e in experts.tolist() if e not in ls.where]
        free = self.slots.capacity - len(self.policy.pinned.get(layer, ())) - (len(experts) - len(missing))
        if missing and (len(missing) > free or hidden.shape[0] > self.slots.capacity):
            return self._staged(layer, hidden, expert_ids, weights, routed, experts, counts, missing,
                                ahead if ahead is not None and ahead.layer == layer else None)
        if missing and self.cpu_share != 0 and hidden.shape[0] <= CPU_MAX_TOKENS:
            on_cpu = self._cpu_share_of(layer, dict(zip(experts.tolist(), counts.tolist())), missing)
            if on_cpu:
                return self._hybrid(layer, hidden, expert_ids, weights, on_cpu)
        self._make_resident(layer, experts, counts)
        return self.dispatch[layer](hidden, ls.tensors, expert_ids, weights, slot_map=ls.slot_map)

    def ensure_resident(self, layer: int, routed: np.ndarray, wait: str = "host") -> None:
        """Host side of a fetch: count hits and misses, copy missing experts into evicted slots.

        Experts prefetched for this layer count as hits (their copies were issued ahead); the
        compute stream (wait="device") or the host waits for those copies before the experts run.
        """
        experts, counts = np.unique(routed[routed >= 0], return_counts=True)
        self._make_resident(layer, experts, counts, wait)

    def _make_resident(self, layer: int, experts: np.ndarray, counts: np.ndarray, wait: str = "host") -> None:
        """`ensure_resident` for a call's distinct routed experts and their pair counts."""
        ls = self.slots[layer]
        self.policy.record(layer, experts, counts)
        ids = experts.tolist()
        resident = np.fromiter((e in ls.where for e in ids), dtype=bool, count=len(ids))
        missing = experts[~resident].tolist()
        record = dict(hits=int(counts[resident].sum()), misses=int(counts[~resident].sum()))
        settled = self.prefetcher.settle(layer, ids) if self.prefetcher is not None else None
        if settled is not None and settled.scored:   # copies this call needed: issued ahead or not
            record.update(predicted_hits=settled.predicted_hits, predicted_total=settled.predicted_total,
                          prefetch_used=settled.prefetch_used, demand_copies=len(missing))
        if missing:   # queued after any prefetch on the same copy stream: waiting on it covers both
            victims = self.policy.victims(layer, ls.resident(), len(missing), set(ids))
            done = self.slots.install(layer, missing, victims, self.transfers, wait=wait)
            record.update(bytes_copied=done.bytes_copied, evictions=done.evictions, copy_wait_s=done.wait_s)
        elif settled is not None and settled.pending is not None:
            t0 = time.perf_counter()
            self.transfers.wait(settled.pending, wait)
            record.update(copy_wait_s=time.perf_counter() - t0)
        self.stats.record(layer, **record)

    def _cpu_share_of(self, layer: int, tokens: dict[int, int], missing: list[int],
                      share: float | str | None = None) -> list[int]:
        """The missing experts the CPU computes: as the measured costs say ("auto"), or `share` of
        them (default: `cpu_share`, a decode-sized call's). The CPU takes first those with the fewest
        routed tokens (its work grows with them, a copy's does not), then those the residency policy
        values least: a copied expert stays in the bank for later tokens, a CPU-served one does not,
        so the hot ones are the ones to copy."""
        share = self.cpu_share if share is None else share
        if share == 1:
            return missing
        if share == "auto" and self.costs is None:
            self.costs = self.measure_costs()
        worth = dict(zip(missing, self.policy.priority(layer, np.asarray(missing)).tolist()))
        order = sorted(missing, key=lambda e: (tokens[e], worth[e], e))
        if share == "auto":
            return self.costs.split(order, tokens)
        return order[:int(round(len(missing) * share))]

    def measure_costs(self) -> MissCosts:
        """The split's costs, measured when the first decode step asks for them rather than when the
        bank is built: right after a build the host is still busy with it (a measurement then was
        seen 20x too slow on the CPU side), and by the first step the kernels are loaded."""
        layer = next(iter(self.host_stacks))
        return MissCosts.measure(self.host_stacks[layer], self.host_dispatch[layer], self.slots.device,
                                 self.shape.hidden, self.slots.formats[layer].dtype)

    def _observe_cpu(self, experts: int, pairs: int, seconds: float) -> None:
        """Keep the CPU's cost per expert current from the calls it serves (a moving average), so a
        host that turns busier or quieter moves the split with it."""
        if self.costs is None or experts == 0:
            return
        per_expert = max(0.0, seconds / experts - (self.costs.cpu_s(pairs / experts) - self.costs.cpu_expert_s))
        self.costs = dataclasses.replace(self.costs, cpu_expert_s=0.8 * self.costs.cpu_expert_s + 0.2 * per_expert)

    def _hybrid(self, layer: int, hidden: Tensor, expert_ids: Tensor, weights: Tensor, on_cpu: list[int]) -> Tensor:
        """Copy the other missing experts in (the compute stream waits for them, the host does not),
        compute `on_cpu`'s pairs on the CPU meanwhile, then add the two results."""
        ls = self.slots[layer]
        routed = expert_ids.reshape(hidden.shape[0], -1).cpu().numpy()
        cpu_out = self.serve_on_cpu(layer, routed, on_cpu, hidden.cpu(), weights.float().cpu(), wait="device")
        out = self.dispatch[layer](hidden, ls.tensors, ls.slot_map[expert_ids], weights)   # on_cpu: no slot
        return (out.float() + cpu_out.to(out.device, non_blocking=True)).to(out.dtype)

    def ensure_resident_hybrid(self, layer: int, routed: np.ndarray, hidden: Tensor, weights: Tensor,
                               wait: str = "host") -> Tensor | None:
        """`ensure_resident` for a decode segment, with hybrid misses, given the call's routing
        `routed` (T, k), hidden rows (T, H) and routing weights (T, k), read back to the host with
        it: returns the CPU-computed rows (T, H) fp32 on the CPU to add to the layer's output, or
        None when every miss was copied."""
        flat = routed.reshape(-1)
        flat = flat[flat >= 0]
        ls = self.slots[layer]
        on_cpu = []
        if self.cpu_share != 0 and hidden.shape[0] <= CPU_MAX_TOKENS:
            experts, counts = np.unique(flat, return_counts=True)
            tokens = dict(zip(experts.tolist(), counts.tolist()))
            missing = [e for e in tokens if e not in ls.where]
            on_cpu = self._cpu_share_of(layer, tokens, missing) if missing else []
        if not on_cpu:
            self.ensure_resident(layer, flat, wait)
            return None
        return self.serve_on_cpu(layer, routed, on_cpu, hidden, weights, wait)

    def serve_on_cpu(self, layer: int, routed: np.ndarray, on_cpu: list[int], hidden: Tensor, weights: Tensor,
                     wait: str) -> Tensor:
        """Install the routed experts not in `on_cpu` (copies queued first, so they overlap the CPU
        work), then compute `on_cpu`'s pairs from host RAM. `routed` (T, k), `hidden` and `weights`
        are on the host. Returns those pairs' rows (T, H), fp32, on the CPU."""
        served = np.zeros(self.slots.num_experts + 1, dtype=bool)   # [-1]: no expert, never on the CPU
        served[on_cpu] = True
        at_cpu = served[routed]
        kept = routed[~at_cpu]
        self.ensure_resident(layer, kept[kept >= 0], wait)
        experts, counts = np.unique(routed[at_cpu], return_counts=True)
        self.policy.record(layer, experts, counts)
        t0 = time.perf_counter()
        out = self.host_dispatch[layer](hidden, self.host_stacks[layer],
                                        torch.from_numpy(np.where(at_cpu, routed, -1).astype(np.int32)), weights)
        took = time.perf_counter() - t0
        self._observe_cpu(len(experts), int(counts.sum()), took)
        self.stats.record(layer, misses=int(counts.sum()), cpu_served=int(counts.sum()),
                          cpu_bytes=len(experts) * self.slots.formats[layer].nbytes(self.shape), cpu_s=took)
        return out

    def _staged(self, layer: int, hidden: Tensor, expert_ids: Tensor, weights: Tensor, routed: np.ndarray,
                experts: np.ndarray, counts: np.ndarray, missing: list[int], ahead: StagedAhead | None) -> Tensor:
        """Resident experts from the bank, missing ones streamed through two staging buffers.

        While one buffer's experts compute, the next group is copied into the other one; the stage
        maps of every group are uploaded in one copy so the host never waits in between. `ahead`:
        groups of this layer already copied while the layer before ran (`_copy_ahead`); they are
        the first groups, and the rest of the missing experts follow them. Each group's experts
        are in id order, so a run of consecutive ids is one copy per tensor. `routed`: the call's routing
        as `forward` read it back; `experts`, `counts`: its distinct experts and their pairs.
        """
        t0 = time.perf_counter()
        self.policy.record(layer, experts, counts)
        missed = np.isin(experts, missing)
        ls = self.slots[layer]
        dispatch, staging = self.dispatch[layer], self.staging[self.slots.formats[layer].name]
        group = next(iter(staging[0].values())).shape[0]
        early = ahead.groups if ahead is not None else []
        copied_early = {e for chunk in early for e in chunk}
        rest = [e for e in missing if e not in copied_early]
        on_cpu: list[int] = []
        if self.prompt_cpu_share != 0 and rest:   # the CPU's share, from what is not copied already
            on_cpu = self._cpu_share_of(layer, dict(zip(experts.tolist(), counts.tolist())), rest,
                                        self.prompt_cpu_share)
            cpu_set = set(on_cpu)
            rest = [e for e in rest if e not in cpu_set]
        cpu_rows = (self._start_on_cpu(layer, hidden, routed.reshape(hidden.shape[0], -1), weights, on_cpu)
                    if on_cpu else None)
        groups = early + [rest[i:i + group] for i in range(0, len(rest), group)]
        pin = self.slots.device.type == "cuda"
        stage_maps = torch.full((len(groups), self.slots.num_experts + 1), -1, dtype=torch.int32, pin_memory=pin)
        needed = set(missing) - set(on_cpu)   # an expert copied ahead but not routed (or since put in the bank) maps to no slot
        for g, chunk in enumerate(groups):   # [-1]: no slot
            rows = [i for i, e in enumerate(chunk) if e in needed]
            stage_maps[g, torch.tensor([chunk[i] for i in rows], dtype=torch.long)] = torch.tensor(rows, dtype=torch.int32)
        stage_maps = stage_maps.to(self.slots.device, non_blocking=True)
        copied_total = ahead.bytes_copied if ahead is not None else 0
        # Pair rows, not sums: each pair is computed by exactly one of these calls (zero in the others),
        # so their total summed as one call sums it gives the bits of full residency, in bf16 too.
        pairs: Tensor | None = None
        if not groups:   # the CPU took every missing expert: the bank's launch below writes the pair rows
            pairs = torch.zeros(hidden.shape[0], expert_ids.shape[-1], hidden.shape[1], dtype=torch.float32,
                                device=hidden.device)
        for g, chunk in enumerate(groups):
            if g < len(early):
                turn, ready = ahead.turns[g], ahead.ready[g]
            else:
                turn = self._turn
                self._turn ^= 1
                copied, ready = self._copy_group(layer, chunk, staging[turn], after=self._staging_done[turn])
                copied_total += copied
            self.transfers.wait(ready, "device")
            staged = dispatch(hidden, staging[turn], stage_maps[g][expert_ids], weights, reduce=False)
            pairs = staged if pairs is None else pairs.add_(staged)
            self._staging_done[turn] = self._record_done()
        nonresident = self.slots.num_experts - len(ls.where)
        if (copy_ahead and hidden.shape[0] > self.slots.capacity and layer in self._next_layer
                and len(missing) >= AHEAD_ROUTED_SHARE * nonresident):
            self._ahead = self._copy_ahead(self._next_layer[layer], 2)
        # The bank's experts last: their launches never stand between a staging buffer and its next copy.
        pairs.add_(dispatch(hidden, ls.tensors, ls.slot_map[expert_ids], weights, reduce=False))
        if cpu_rows is None:
            result = self.pair_sum[layer](pairs, hidden.dtype)
        else:   # the device's rows summed in fp32, the CPU's added, rounded once
            result = (self.pair_sum[layer](pairs, torch.float32)
                      + cpu_rows.result().to(hidden.device)).to(hidden.dtype)
        self.stats.record(layer, hits=int(counts[~missed].sum()), misses=int(counts[missed].sum()),
                          bytes_copied=copied_total,
                          copy_wait_s=time.perf_counter() - t0)   # host time issuing the streamed section
        return result

    def close(self) -> None:
        """Stop the thread that computes streamed calls' CPU share (it finishes the call in hand)."""
        if self._prompt_cpu is not None:
            self._prompt_cpu.shutdown(wait=True)
            self._prompt_cpu = None

    def _start_on_cpu(self, layer: int, hidden: Tensor, routed: np.ndarray, weights: Tensor,
                      on_cpu: list[int]) -> Future:
        """Compute the pairs of a streamed call routed to `on_cpu` from host RAM, in the CPU thread
        (the C kernel releases the GIL), while this thread issues the staged copies and launches:
        (T, H) fp32 rows on the host. `routed`: the call's (T, k) routing, already read back. Stats
        and the CPU's cost per expert are kept as `serve_on_cpu` keeps them."""
        served = np.zeros(self.slots.num_experts + 1, dtype=bool)   # [-1]: no expert, never on the CPU
        served[on_cpu] = True
        at_cpu = served[routed]
        ids = torch.from_numpy(np.where(at_cpu, routed, -1).astype(np.int32))
        pairs = int(at_cpu.sum())
        host_hidden, host_weights = hidden.cpu(), weights.reshape(hidden.shape[0], -1).float().cpu()
        stack, run = self.host_stacks[layer], self.host_dispatch[layer]
        nbytes = len(on_cpu) * self.slots.formats[layer].nbytes(self.shape)

        def compute() -> Tensor:
            t0 = time.perf_counter()
            out = run(host_hidden, stack, ids, host_weights).float()
            took = time.perf_counter() - t0
            self._observe_cpu(len(on_cpu), pairs, took)
            self.stats.record(layer, cpu_served=pairs, cpu_bytes=nbytes, cpu_s=took)
            return out

        if self._prompt_cpu is None:
            self._prompt_cpu = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moestream-prompt-cpu",
                                                  initializer=_pin_cpu_team)
        return self._prompt_cpu.submit(compute)

    def _copy_group(self, layer: int, chunk: list[int], buf: Mapping[str, Tensor],
                    after: torch.cuda.Event | None) -> tuple[int, torch.cuda.Event | None]:
        if staged_copy_runs:
            return self.transfers.copy_rows(layer, chunk, buf, after=after)
        return self.transfers.copy(layer, chunk, [{n: t[i] for n, t in buf.items()} for i in range(len(chunk))],
                                   after=after)

    def _record_done(self) -> torch.cuda.Event | None:
        """An event after the compute stream's work so far (None on the CPU, where all of it is done)."""
        if self.slots.device.type != "cuda":
            return None
        done = torch.cuda.Event()
        done.record()
        return done

    def _copy_ahead(self, layer: int, groups: int) -> StagedAhead | None:
        """Copy `groups` groups of `layer`'s non-resident experts into the staging buffers before its
        routing is known: the copy stream then keeps busy while the host runs the layers in between
        and reads that routing back, which left the PCIe link idle ~1.5-3.5 ms per layer. Called
        only when this layer's prompt routed to nearly every expert the bank lacks, so the next one
        will too; an expert copied but not routed costs its copy and computes nothing. The experts
        the residency policy values most go first (the likeliest routed), each group in id order."""
        ls = self.slots[layer]
        candidates = np.array([e for e in range(self.slots.num_experts) if e not in ls.where], dtype=np.int64)
        if not len(candidates):
            return None
        order = np.lexsort((candidates, -self.policy.priority(layer, candidates)))
        staging = self.staging[self.slots.formats[layer].name]
        group = next(iter(staging[0].values())).shape[0]
        chosen = candidates[order[:groups * group]].tolist()
        ahead = StagedAhead(layer)
        for i in range(0, len(chosen), group):
            chunk = sorted(chosen[i:i + group])
            turn = self._turn
            self._turn ^= 1
            copied, ready = self._copy_group(layer, chunk, staging[turn], after=self._staging_done[turn])
            ahead.groups.append(chunk)
            ahead.turns.append(turn)
            ahead.ready.append(ready)
            ahead.bytes_copied += copied
        return ahead


def _pin_cpu_team() -> None:
    """The prompts' CPU thread: its kernel team pinned as the first thread's is (`cpu_moe.pin_team`)."""
    from moestream.kernels import cpu_moe

    if cpu_moe.load() is not None:
        cpu_moe.pin_team()


@dataclass
class StagedAhead:
    """Staging groups of `layer` copied before its routing was known: group i in buffer turns[i]."""

    layer: int
    groups: list[list[int]] = dataclasses.field(default_factory=list)
    turns: list[int] = dataclasses.field(default_factory=list)
    ready: list[torch.cuda.Event | None] = dataclasses.field(default_factory=list)
    bytes_copied: int = 0
