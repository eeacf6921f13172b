"""The hybrid miss policy: exact misses served by the CPU and the PCIe link at once, with no host
work inside a decode step.

Every routed pair of a decode call is served by one of three:

* the bank: the expert sits in a slot (a hit);
* the GPU reading the expert in place from the pinned host tier, over PCIe, inside the same
  one-token MoE launches as the hits (the one-token map gives such an expert the source S + e);
* the CPU: a C worker thread (`kernels/cpu_moe.StreamWorker`) computes the expert from host RAM,
  from the routing and hidden rows the layer posted into its mailbox (`kernels/handoff.py`), and
  the layer's last launch adds its rows once they are there.

Nothing here reads the device back, so decode steps run as whole CUDA graphs. In a one-token call
the split is per call: of its m missing pairs the CPU computes the first take[m] in routing order,
and of dense experts also the intermediate rows [0, cut[m]) of the next one (gate and up rows,
those columns of down), so that take[m] + cut[m] / I = cpu_share × m holds at any m, one miss
included; the GPU reads the rest. The kernels, the counters and the worker apply the same rule to
the same routing (the device's table is the only one: each post hands the worker its call's take
and cut), so every row is served once, and the two sides' work stays balanced however many of a
token's experts miss. Quantized experts split in whole experts (take[m] = round(cpu_share × m)):
the GPU's dequantizing launches read their packed bytes in place, the worker decodes 8/4/2-bit,
NF4, FP8 and MXFP4 experts as the host tier stores them. A call of several tokens (a batch of
streams) splits by expert instead: each layer's batch map sends a share of the experts outside the
bank to the CPU (-1) and the rest to the GPU, which reads them in place (S + e) in the decode
launches, where one program reads an expert once for every token routed to it; so each missing
expert is read once a step, by one side. Each share (one-token calls, batches) moves while decoding
(`SplitBalance`) unless the user fixes it. Experts with biases and MXFP4 experts leave every miss
to the CPU (their kernels read slots only). Rows past the live ones of a captured batch (its
padding) get no experts computed. Calls larger than the mailboxes (prompts) go through the fetch
policy, whose staging leaves the bank as it is.

Every `refresh_every` tokens the bank takes in the most-missed experts where they beat the coldest
resident ones, as many as each layer's `PromotionGauge` allows from what its recent promotions
were worth. The device-side counters are copied into pinned memory behind the step
that fills the window and folded at the next, while the device runs it: no read-back and no
victim choice sits between two steps. Nobody waits for the promotions' copies either: the victims
leave the bank at once, the newcomers join it at the first step after their copies landed, and
until then both are misses like any other.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from moestream.errors import InputError
from moestream.experts.format import DenseFormat, Dispatch, ExpertFormat, ExpertShape, QuantizedFormat
from moestream.experts.mxfp4_format import Mxfp4Format
from moestream.experts.residency import ResidencyPolicy
from moestream.experts.skip import choose_promotions
from moestream.experts.slots import Landing, SlotTable
from moestream.experts.stats import BankStats
from moestream.experts.transfer import Transfers
from moestream.kernels import cpu_moe, handoff
from moestream.kernels.cpu_moe import Mailbox, StreamWorker
from moestream.kernels.handoff import LayerHandoff
from moestream.kernels.moe_reference import HostReads
from moestream.kernels.quant_moe_reference import QuantHostReads

HYBRID_MAX_TOKENS = 16       # decode batches up to this many streams; larger calls take the fetch policy
DEFAULT_CPU_SHARE = 0.6      # of a one-token call's missing pairs, the CPU's share (dense experts)
QUANTIZED_CPU_SHARE = 0.5    # the same for quantized experts (a 4-bit byte costs the CPU more to decode)
PROMOTE_MOST = 4             # experts copied into a layer per refresh, at most
REFRESH_EVERY = 4            # tokens between refreshes (see `PromotionGauge` for the replays behind it)
ALL_ROWS = 1 << 30           # live rows of a call when none are padding


def check_hybrid(formats: dict[int, ExpertFormat], shape: ExpertShape, host_stacks) -> None:
    """What the hybrid policy needs, refused with what to do instead."""
    if host_stacks is None:
        raise InputError("--miss-policy hybrid computes missed experts from host RAM, but the experts are read "
                         "from disk here; add --host-tier pinned (and the host memory it needs) or use "
                         "--miss-policy fetch.")
    for fmt in formats.values():
        if isinstance(fmt, DenseFormat):
            ok = cpu_moe.supports(fmt.dtype, shape.activation)
        elif isinstance(fmt, Mxfp4Format):   # gpt-oss: biases and the clamped SwiGLU, which the kernel applies
            ok = cpu_moe.supports(fmt.dtype, shape.activation) and cpu_moe.supports_quant(fmt.spec)
        else:
            ok = isinstance(fmt, QuantizedFormat) and cpu_moe.supports_quant(fmt.spec) and shape.plain
        if not ok:
            raise InputError(f"--miss-policy hybrid's CPU worker does not compute {fmt.name} experts with a "
                             f"{shape.activation.name} activation (it takes bf16/fp32, 8/4/2-bit, NF4 and FP8 "
                             "SwiGLU experts, and MXFP4 ones in bf16/fp32); use --miss-policy fetch.")
    if cpu_moe.load() is None:
        raise InputError(f"--miss-policy hybrid needs the CPU expert kernel, which cannot be built here "
                         f"({cpu_moe.unavailable_reason()}); use --miss-policy fetch.")


class PromotionGauge:
    """How much one layer's recent promotions were worth: the uses each promoted expert had over the
    `follow` tokens after it came in, averaged (moving average). Where promotions pay (routing that
    repeats itself) a refresh takes in up to `PROMOTE_MOST` missed experts hotter than the coldest
    resident ones; where they do not (routing without locality, where every copy is bytes taken from
    the misses' own reads) it takes one at a time, the next once the last one's watch is over: a
    probe that keeps the gauge current, so routing that turns repetitive turns it eager again. Each
    prompt starts it (`start`): eager where its routing clusters, probing where it is spread as
    chance spreads it. Replayed through the residency policy (`benchmarks/refresh_replay.py --every
    4 --act-lag 1 --land-lag 1`: refresh every 4 tokens, acting a token after the window, promotions
    serving a token after that, 25% bank, LCP's 32-token memory), the demo trace gets 79.3% hits
    over 64 decoded tokens, 89.1% over 128 and 54.7% over 1,024, and uniform routing 24.9% with
    0.062, 0.062 and 0.066 promotions per layer and token (0.281, 0.173 and 0.079 with every
    prompt starting eager); the earlier rule (a missed expert six times the victim's priority where
    promotions do not pay, as many as `PROMOTE_MOST`, eager at every start) gave the trace the same
    hits (54.6% over 1,024) and uniform routing 0.307, 0.216 and 0.126 promotions, each a copy
    taken from the misses' own link."""

    USEFUL = 2.0               # uses per promotion (over `follow` tokens) from which promotions pay

    def __init__(self, follow: int = 16):
        self.follow = follow
        self.value = self.USEFUL   # start eager: a bank's first refreshes fill it with what repeats
        self.watched: dict[int, list[int]] = {}   # expert -> [tokens left to watch, uses so far]

    @property
    def pays(self) -> bool:
        return self.value >= self.USEFUL

    def start(self, uses: np.ndarray) -> None:
        """Start eager or probing from a prompt's uses per expert (`uses`, one count per expert).

        Routing spread as chance spreads it starts probing, since nothing will repeat; clustered
        routing starts eager. The test is the uses' dispersion (variance over mean): uniform draws
        give under 1 (k distinct experts a token), and their dispersion times (E - 1) is chi-square
        with E - 1 degrees of freedom, so `clustered_from(E)`, its 99.9% point over E - 1 (1.43 at
        128 experts, 3.5 at 8), is passed by chance once in a thousand layers. The demo trace's
        prompts give 1.6-5 over 16 tokens and 7-28 over 256, uniform draws at 128 experts 0.7-1.3.
        Under one use per expert on average says too little: the gauge stays as it is."""
        mean = float(uses.mean())
        if mean < 1.0:
            return
        self.value = self.USEFUL if float(uses.var()) / mean >= clustered_from(len(uses)) else 0.0

    def observe(self, uses: np.ndarray, tokens: int) -> None:
        """A refresh period of `tokens` tokens with these per-expert use counts."""
        for expert, watch in list(self.watched.items()):
            watch[0] -= tokens
            watch[1] += int(uses[expert])
            if watch[0] <= 0:
                self.value = 0.8 * self.value + 0.2 * watch[1]
                del self.watched[expert]

    def most(self, eager_most: int) -> int:
        """Promotions a refresh may make: `eager_most` while they pay, else one probe at a time."""
        if self.pays:
            return eager_most
        return 0 if self.watched else 1

    def promoted(self, experts: list[int]) -> None:
        for e in experts:
            self.watched[e] = [self.follow, 0]


def clustered_from(num_experts: int) -> float:
    """The dispersion of uses per expert that uniform routing passes once in a thousand layers: the
    99.9% point of chi-square with E - 1 degrees of freedom over E - 1 (Wilson-Hilferty)."""
    dof = max(num_experts - 1, 1)
    c = 2.0 / (9.0 * dof)
    return (1.0 - c + 3.09 * c ** 0.5) ** 3


class SplitBalance:
    """The CPU's share of a kind of call's misses (one-token calls, batches: one balance each), moved
    until both sides finish together.

    Where a call split its misses (each side had some), the device's last launch notes how long it
    waited for the CPU's answer and how long the call took from its post to that answer. Every
    `least_calls` such calls the share moves by up to `STEP`, toward the device waiting
    `TARGET_WAIT` of the calls' time: up while it waits less, down while it waits more (at twice
    the target or beyond, the whole step down). The share stays where a call whose k experts all
    miss still gives each side one (else no call would be split, and nothing would be learned
    again). The target is not zero: the CPU's answer carries a fixed latency (the worker sees the
    post, then publishes its rows) that the device's side does not, so the fastest split is one
    where the device waits briefly. On one H100 host (BENCHMARKS.md) the fastest fixed
    shares had the device wait ~7-10% of a split call (bf16: 52 µs of ~730 under uniform routing,
    32 of ~350 under the trace) and the next share up 25-28%, 10-15% slower; how often it waited
    (the signal before) did not tell those apart. A share the user fixes (`--cpu-misses 0.6`)
    stays fixed. The best share depends on the machine (the CPU's memory bandwidth and cores
    against the PCIe link), on the expert format and the thread count."""

    STEP = 0.05
    TARGET_WAIT = 0.08

    def __init__(self, share: float, adaptive: bool, top_k: int, least_calls: int = 32):
        self.share, self.adaptive, self.least_calls = float(share), adaptive, least_calls
        self.low, self.high = 0.6 / top_k, 1 - 0.6 / top_k   # take[k] stays within [1, k - 1]
        self.calls = self.wait_us = self.span_us = 0
        self.wait_us_per_call: float | None = None
        self.wait_share: float | None = None
        self.span_us_per_call: float | None = None   # post to answer, the CPU's side of a split call

    def takes(self, top_k: int) -> list[int]:
        """take[m] for m = 0..top_k: the CPU's pairs of a call with m misses, whole experts only."""
        return [round(self.share * m) for m in range(top_k + 1)]

    def split(self, top_k: int, intermediate: int, quantum: int) -> tuple[list[int], list[int]]:
        """take[m] and cut[m] for m = 0..top_k: of a call's m misses the CPU computes take[m] whole
        and the intermediate rows [0, cut[m]) of the next (0: none), the device the rest, so the
        share holds at any m (one miss too, where whole experts leave one side idle). `quantum`:
        a cut's granularity in rows (0: whole experts, `takes`)."""
        if not quantum:
            return self.takes(top_k), [0] * (top_k + 1)
        takes, cuts = [], []
        for m in range(top_k + 1):
            x = self.share * m
            whole = int(x)
            cut = round((x - whole) * intermediate / quantum) * quantum
            if cut >= intermediate:
                whole, cut = whole + 1, 0
            if whole >= m:
                whole, cut = m, 0
            takes.append(whole)
            cuts.append(cut)
        return takes, cuts

    def observe(self, calls: int, waited: int, wait_us: int = 0, span_us: int = 0) -> bool:
        """Split calls since the last look, how many of them waited (the device counts it for the
        benchmarks; the share follows the µs), the µs they waited and the µs from their posts to
        their answers, in all; whether the share moved. The last full window's mean wait per call
        and its share of the calls' time are kept for `--stats`."""
        self.calls += calls
        self.wait_us += wait_us
        self.span_us += span_us
        if self.calls < self.least_calls:
            return False
        self.wait_us_per_call = self.wait_us / self.calls
        self.span_us_per_call = self.span_us / self.calls
        self.wait_share = self.wait_us / self.span_us if self.span_us > 0 else None
        self.calls = self.wait_us = self.span_us = 0
        if not self.adaptive or self.wait_share is None:
            return False
        pull = min(1.0, max(-1.0, 1.0 - self.wait_share / self.TARGET_WAIT))
        share = min(self.high, max(self.low, self.share + self.STEP * pull))
        moved = share != self.share
        self.share = share
        return moved


@dataclass
class _Snapshot:
    """The device counters of a refresh window, copied into pinned memory without a wait."""

    expert_counts: Tensor
    pair_counts: Tensor
    balance_counts: Tensor
    error: Tensor
    tokens: int = 0
    done: torch.cuda.Event | None = None

    @classmethod
    def like(cls, *counters: Tensor) -> _Snapshot:
        pin = counters[0].device.type == "cuda"
        return cls(*(torch.zeros(c.shape, dtype=c.dtype, pin_memory=pin) for c in counters))

    def landed(self) -> bool:
        return self.done is None or self.done.query()


class HybridMisses:
    def __init__(self, slots: SlotTable, transfers: Transfers, policy: ResidencyPolicy, stats: BankStats,
                 dispatch: dict[int, Dispatch], host_stacks: dict[int, dict[str, Tensor]], shape: ExpertShape,
                 top_k: int, cpu_share: float | str | None = "auto", threads: int | None = None,
                 refresh_every: int = REFRESH_EVERY, max_tokens: int = HYBRID_MAX_TOKENS):
        check_hybrid(slots.formats, shape, host_stacks)
        self.slots, self.transfers, self.policy, self.stats = slots, transfers, policy, stats
        self.dispatch, self.shape = dispatch, shape
        self.refresh_every, self.max_tokens, self.top_k = refresh_every, max_tokens, top_k
        device = self.device = slots.device
        E = slots.num_experts
        # The GPU reads experts in place in one-token calls (dense: the one-token launches; quantized:
        # the decode launches), for experts without biases and not MXFP4 (its kernels read slots only).
        # Elsewhere the CPU computes every miss.
        self.gpu_reads = not shape.bias and not any(isinstance(fmt, Mxfp4Format) for fmt in slots.formats.values()) and (
            device.type == "cpu" or all(fmt.uses_kernels(device, shape) for fmt in slots.formats.values()))
        self.expert_bytes = {layer: fmt.nbytes(shape) for layer, fmt in slots.formats.items()}
        dtype = next(iter(slots.formats.values())).dtype
        self.mailboxes = {layer: Mailbox(top_k, shape.hidden, max_tokens, dtype, pin=device.type == "cuda")
                          for layer in slots}
        # Device-side counters of every layer in three tensors, copied out once each per refresh: per
        # expert (use, miss); per layer pairs (bank, read in place, CPU, shared, the CPU's rows of the
        # shared ones); per layer split calls (see `LayerHandoff.balance`).
        self.layer_index = {layer: i for i, layer in enumerate(slots)}
        self.expert_counts = torch.zeros(len(self.layer_index), 2, E, dtype=torch.int32, device=device)
        self.pair_counts = torch.zeros(len(self.layer_index), 5, dtype=torch.int64, device=device)
        self.balance_counts = torch.zeros(len(self.layer_index), 9, dtype=torch.int32, device=device)
        self._window = np.zeros((len(self.layer_index), 2, E), dtype=np.int64)   # (use, miss) since the last refresh
        self.gauges = {layer: PromotionGauge() for layer in slots}
        self.handoffs = {layer: LayerHandoff.create(box, *self.expert_counts[self.layer_index[layer]],
                                                    self.pair_counts[self.layer_index[layer]],
                                                    self.balance_counts[self.layer_index[layer]])
                         for layer, box in self.mailboxes.items()}
        self.one_token_maps = {layer: torch.full((E + 1,), -1, dtype=torch.int32, device=device) for layer in slots}
        # A batch's map: the bank's slots, S + e for the experts outside it that the GPU reads in place, -1
        # for those the CPU computes (`batch_balance`'s share of them, spread evenly over the expert ids).
        self.batch_maps = {layer: torch.full((E + 1,), -1, dtype=torch.int32, device=device) for layer in slots}
        # The split of a one-token call's m missing pairs, as rows of tables indexed by m: dense experts
        # take[m] whole and the intermediate rows [0, cut[m]) of the next on the CPU (the first in
        # routing order), quantized ones whole experts only (round(share × m), no cut). The device's
        # copy is the only one read in a step (each post hands the worker its call's take and cut); the
        # host's is what it was last set to, pinned on CUDA: a move copies it behind the step in
        # flight, and the next move comes a refresh (several synchronised steps) later.
        auto = cpu_share in (None, "auto")
        quantized = any(isinstance(fmt, QuantizedFormat) for fmt in slots.formats.values())
        start = QUANTIZED_CPU_SHARE if quantized else DEFAULT_CPU_SHARE
        self.balance = SplitBalance(start if auto else float(cpu_share), auto and self.gpu_reads, top_k)
        self.batch_balance = SplitBalance(start if auto else float(cpu_share), auto and self.gpu_reads, top_k)
        self._batch_share = self.batch_balance.share   # the share the batch maps were built with
        self._batch_adapts = self.batch_balance.adaptive
        I = shape.intermediate
        self.quantum = next((q for q in (64, 16, 8) if I % q == 0 and I >= 2 * q), 0)   # a cut's granularity
        self.split_host = torch.tensor(self._split_tables(), dtype=torch.int32, pin_memory=device.type == "cuda")
        self.split = self.split_host.to(device)
        self.take, self.cut, self.take_whole, self.no_cut = self.split.unbind(0)
        self.host_reads = {layer: self._host_reads(slots.formats[layer], stack)
                           for layer, stack in host_stacks.items()} if self.gpu_reads else {}
        self.batch_host_reads = {layer: self._host_reads(slots.formats[layer], stack, split=False)
                                 for layer, stack in host_stacks.items()} if self.gpu_reads else {}
        # each layer's (take, cut): views of `split`, so a move of the share reaches them in place
        self.layer_tables = {layer: (self.take_whole, self.no_cut) if isinstance(fmt, QuantizedFormat)
                             else (self.take, self.cut) for layer, fmt in slots.formats.items()}
        self.error = torch.zeros(1, dtype=torch.int32, device=device)
        self.live = torch.full((1,), ALL_ROWS, dtype=torch.int32, device=device)
        self._live_value = ALL_ROWS
        self._version = -1
        self._layer_version: dict[int, int] = {}   # each layer's SlotTable version its maps were built at
        self.closed = False
        self._since_refresh = 0
        self._folded = {layer: (0.0, 0) for layer in slots}   # the worker's (busy s, experts) already folded
        self.landings: dict[int, Landing] = {}   # per layer, promotions whose copies are in flight
        # The counters' snapshot in pinned memory (one at a time: a new one is taken once the last is folded).
        self._snapshot_buffer = _Snapshot.like(self.expert_counts, self.pair_counts, self.balance_counts, self.error)
        self._snapshot: _Snapshot | None = None   # taken, not yet folded
        self._due_tokens = 0                      # tokens folded into the window, not yet refreshed on
        self._balance_window = [0, 0, 0, 0]       # split calls, those that waited, µs waited, µs post to answer
        self._batch_window = [0, 0, 0, 0]         # the same of split batches
        self._before_prompt: dict[int, np.ndarray] | None = None   # use counts when the last prompt began
        self.sync_maps()
        specs = {layer: fmt.spec for layer, fmt in slots.formats.items()
                 if isinstance(fmt, (QuantizedFormat, Mxfp4Format))}
        self.worker = StreamWorker(host_stacks, self.mailboxes, top_k, max_tokens, shape.activation, threads, specs)

    def _split_tables(self) -> list[list[int]]:
        """(take, cut) for dense experts, (take, zeros) for quantized ones; every miss on the CPU
        where the device reads none in place."""
        k = self.top_k
        if not self.gpu_reads:
            return [list(range(k + 1)), [0] * (k + 1), list(range(k + 1)), [0] * (k + 1)]
        takes, cuts = self.balance.split(k, self.shape.intermediate, self.quantum)
        return [takes, cuts, self.balance.takes(k), [0] * (k + 1)]

    @property
    def take_host(self) -> Tensor:
        """The dense experts' take table as last set (host copy)."""
        return self.split_host[0]

    def _host_reads(self, fmt: ExpertFormat, stack: dict[str, Tensor], split: bool = True) -> HostReads | QuantHostReads:
        """What a layer's dispatch reads in place: its pinned stacks, less the CPU's part of a one-token
        call (`split`; a batch's map names the CPU's experts itself)."""
        if isinstance(fmt, QuantizedFormat):
            return QuantHostReads(stack, self.take_whole if split else None)
        if not split:
            return HostReads(stack["gate_up"], stack["down"])
        return HostReads(stack["gate_up"], stack["down"], self.take, self.cut)

    def close(self) -> None:
        self.worker.close()
        self.closed = True

    # ---- a call --------------------------------------------------------------------------
    def takes(self, tokens: int) -> bool:
        return tokens <= self.max_tokens

    def forward(self, layer: int, hidden: Tensor, expert_ids: Tensor, weights: Tensor) -> Tensor:
        """Post the call to the CPU worker, run the bank's and the GPU-read experts, add the CPU's rows."""
        ls, h = self.slots[layer], self.handoffs[layer]
        take = cut = None
        extra = {}
        if not self.gpu_reads:
            source = ls.slot_map
        elif hidden.shape[0] == 1:   # split by the tables, in routing order
            source, (take, cut) = self.one_token_maps[layer], self.layer_tables[layer]
            extra = {"host": self.host_reads[layer]}
        else:                        # split by expert: the batch map
            source = self.batch_maps[layer]
            extra = {"host": self.batch_host_reads[layer]}
        handoff.post(h, hidden, expert_ids, weights, source, self.slots.capacity, self.live, take, cut)
        out = self.dispatch[layer](hidden, ls.tensors, expert_ids, weights, slot_map=source, **extra)
        return handoff.collect(h, out, self.error, self.live)

    def note_step(self, decoding: bool) -> None:
        """A prompt's routing sets how each layer's gauge starts (`PromotionGauge.start`): the policy's
        use counts are noted at a prompt's first step, and the uses since then read at the first decode
        step after it (host-side counts the prompt's staging recorded: no read-back)."""
        if not decoding:
            if self._before_prompt is None:
                self._before_prompt = {layer: self.policy.uses(layer) for layer in self.gauges}
            return
        if self._before_prompt is not None:
            for layer, before in self._before_prompt.items():
                self.gauges[layer].start(self.policy.uses(layer) - before)
            self._before_prompt = None

    def set_live_rows(self, rows: int | None) -> None:
        """How many rows of the next calls are real (None: all): a decode step replayed through a
        graph of a larger batch pads its rows, whose experts nobody needs computed."""
        value = ALL_ROWS if rows is None else rows
        if value != self._live_value:
            self.live.fill_(value)
            self._live_value = value

    # ---- between steps ------------------------------------------------------------------
    def sync_maps(self) -> None:
        """Rebuild the one-token map (experts outside the bank: S + e) and the batch map (the CPU's share
        of those -1) of every layer whose residency changed since the last call, and every layer's
        batch map when the batch share moved, from the host mirror (no read-back). The copies queue on the
        compute stream behind the step in flight, which still reads the old maps, so nobody waits:
        `after_step` calls this while the device runs a step, and the next step starts from the bank
        as it is then; `begin_step` calls it again for changes made between steps (a prompt through
        the fetch policy, a fill). The worker keeps no map of its own: each post names its pairs."""
        if self.closed:
            raise RuntimeError("this engine was closed: its CPU expert worker has stopped; load it again")
        share_moved = self._batch_share != self.batch_balance.share
        if self.slots.version == self._version and not share_moved:
            return
        S, E = self.slots.capacity, self.slots.num_experts
        pin = self.device.type == "cuda"
        self._batch_share = self.batch_balance.share
        for layer, version in self.slots.layer_version.items():
            if self._layer_version.get(layer) == version and not share_moved:
                continue                                         # only the layers that changed
            one_map = self.slots[layer].host_map(E, outside=S)
            maps = [(self.batch_maps[layer], batch_split(one_map, S, self._batch_share))] if self.gpu_reads else []
            if self._layer_version.get(layer) != version:   # not only the batch share moved
                maps.append((self.one_token_maps[layer], one_map))
            for dst, src in maps:
                dst.copy_(src.pin_memory() if pin else src, non_blocking=pin)
            self._layer_version[layer] = version
        self._version = self.slots.version

    def after_step(self, tokens: int) -> None:
        """Every `refresh_every` tokens, snapshot the device counters without waiting (a copy into
        pinned memory and an event, behind the step just launched); at a later step, once the
        snapshot has landed, fold it and refresh the bank. Both happen while the device runs a step,
        so neither the read-back nor the victim choice sits between two steps. The promotions that
        have landed join the bank, and the maps follow the bank, here too, behind the step in flight:
        the next step starts without host work on the bank."""
        self._since_refresh += tokens
        if self._snapshot is not None and self._snapshot.landed():
            self._fold_snapshot()
        if self._due_tokens:
            tokens_due, self._due_tokens = self._due_tokens, 0
            self._promote(tokens_due)
        if self._since_refresh >= self.refresh_every and self._snapshot is None:
            self._snapshot = self._take_snapshot(self._since_refresh)
            self._since_refresh = 0
        if self.landings:
            self.land()
        self.sync_maps()

    def refresh(self, tokens: int = REFRESH_EVERY) -> None:
        """Fold the counters now (waiting for the device) and refresh the bank."""
        self.sync_stats()
        self._due_tokens = 0
        self._promote(tokens)

    def _promote(self, tokens: int) -> None:
        """Take hotter missed experts in, as many as each layer's `PromotionGauge` allows, from the
        window of counts folded since the last time. Their copies run on the copy stream while
        decode goes on: until they land (`land`) the victims and the newcomers are served as misses,
        so no step waits for a promotion (a layer with copies still in flight promotes nothing more)."""
        self.land()
        self._rebalance()
        counts, self._window = self._window, np.zeros_like(self._window)
        for layer, i in self.layer_index.items():
            uses, misses = counts[i]
            gauge = self.gauges[layer]
            gauge.observe(uses, tokens)
            most = 0 if layer in self.landings else gauge.most(PROMOTE_MOST)   # the uses are recorded either way
            pairs = choose_promotions(self.slots, self.policy, layer, misses, uses, most=most)
            if not pairs:
                continue
            landing, copied = self.slots.begin_install(layer, [h for h, _ in pairs], [v for _, v in pairs],
                                                       self.transfers)
            self.landings[layer] = landing
            self.stats.record(layer, bytes_copied=copied, evictions=len(pairs))
            gauge.promoted(landing.experts)

    @property
    def cpu_share(self) -> float:
        """The CPU's share of a one-token call's misses now (1 where the device reads none)."""
        return self.balance.share if self.gpu_reads else 1.0

    @property
    def batch_cpu_share(self) -> float:
        """The CPU's share of the experts outside the bank in a batch's map now (1 where the device reads none)."""
        return self.batch_balance.share if self.gpu_reads else 1.0

    def fix_batch_share(self, share: float | None) -> None:
        """Fix the CPU's share of a batch's misses at `share`, or (None) let it move while decoding again
        from where it is, as it did after loading; the batch maps follow at the next `sync_maps`. For a
        benchmark that compares shares on one loaded engine (`served_steps.py --batch-cpu-shares`)."""
        if not self.gpu_reads:
            raise InputError("the CPU computes every miss here (the device reads none in place), so a batch's "
                             "split has no share to fix")
        if share is None:
            self.batch_balance.adaptive = self._batch_adapts
        else:
            if not 0.0 <= share <= 1.0:
                raise InputError(f"a batch's CPU share must lie in 0..1, got {share}")
            self.batch_balance.share, self.batch_balance.adaptive = float(share), False

    def describe(self) -> str:
        """--stats: how one-token calls and batches split their misses now."""
        if not self.gpu_reads:
            return "hybrid misses: the CPU computes every miss (the device reads none in place here)"
        how = "moved while decoding, by how long the device waits" if self.balance.adaptive else "fixed by --cpu-misses"
        takes, cuts = self.split_host[0].tolist(), self.split_host[1].tolist()
        return (f"hybrid misses: the CPU takes {self.cpu_share:.0%} of a one-token call's misses ({how}), the device "
                f"reads the rest in place; of m misses the CPU computes take[m] = {takes} whole and the "
                f"intermediate rows [0, cut[m]) of the next, cut[m] = {cuts} (of {self.shape.intermediate})"
                + _waited(self.balance, "split call")
                + f"; in a batch the CPU computes {self.batch_cpu_share:.0%} of the experts outside the bank, the "
                  f"device reads the others in place" + _waited(self.batch_balance, "split batch"))

    def _rebalance(self) -> None:
        """Move the split as the balance says. The device's table is the only one (each post tells
        the worker its call's take), so the new table, copied behind the step in flight, takes
        effect at the next step on both sides."""
        window, self._balance_window = self._balance_window, [0, 0, 0, 0]
        if self.balance.observe(*window):
            self.write_split()
        window, self._batch_window = self._batch_window, [0, 0, 0, 0]
        self.batch_balance.observe(*window)   # a moved share rebuilds the batch maps at the next `sync_maps`

    def write_split(self) -> None:
        """Rewrite the split tables from the balance's share (and `quantum`), copied behind the step
        in flight where they changed."""
        tables = self._split_tables()
        if tables != self.split_host.tolist():
            self.split_host.copy_(torch.tensor(tables, dtype=torch.int32))
            self.split.copy_(self.split_host, non_blocking=True)

    def land(self, wait: bool = False) -> None:
        """Make the promoted experts whose copies have landed resident (all of them with `wait`: the
        compute stream waits for the rest, for a caller about to use the slot table otherwise, such
        as the fetch policy of a prompt). The maps follow at the next `sync_maps`."""
        for layer, landing in list(self.landings.items()):
            if wait or landing.landed():
                self.transfers.wait(landing.done, "device")   # a no-op once landed; orders the rest
                self.slots.finish_install(landing)
                del self.landings[layer]

    def check(self, error: int) -> None:
        if error:
            raise RuntimeError("the CPU expert worker stopped answering; the engine cannot continue exactly "
                               "(restart it, or use --miss-policy fetch)")

    def _fold(self, layer: int, pair_counts: list[int]) -> None:
        """One layer's counters into the statistics. A shared pair counts as read by the device; its
        bytes are split by rows (the worker counts it among the experts it computed)."""
        bank, gpu_read, on_cpu, shared, cpu_rows = pair_counts
        busy, _, _, experts = self.mailboxes[layer].served()
        b0, e0 = self._folded[layer]
        self._folded[layer] = (busy, experts)
        nbytes = self.expert_bytes[layer]
        cpu_part = cpu_rows / self.shape.intermediate   # experts' worth of shared rows the CPU computed
        self.stats.record(layer, hits=bank, misses=gpu_read + on_cpu, cpu_served=on_cpu,
                          cpu_bytes=round((experts - e0 - shared + cpu_part) * nbytes), cpu_s=busy - b0,
                          host_read=gpu_read, host_read_bytes=round((gpu_read - cpu_part) * nbytes))

    def _take_snapshot(self, tokens: int) -> _Snapshot:
        """Copy the device counters into pinned memory behind the work queued so far and start them
        again, without waiting; the snapshot's event says when it has landed."""
        snap = self._snapshot_buffer
        pin = self.device.type == "cuda"
        for dst, src in ((snap.expert_counts, self.expert_counts), (snap.pair_counts, self.pair_counts),
                         (snap.balance_counts, self.balance_counts), (snap.error, self.error)):
            dst.copy_(src, non_blocking=pin)
        self.expert_counts.zero_()
        self.pair_counts.zero_()
        self.balance_counts[:, 1:].zero_()
        snap.tokens = tokens
        snap.done = None
        if pin:
            snap.done = torch.cuda.Event()
            snap.done.record()
        return snap

    def _fold_snapshot(self) -> None:
        """Fold the landed snapshot into the statistics, the refresh window and the balance; its
        window is due for promotions at the next `after_step`."""
        snap, self._snapshot = self._snapshot, None
        self.check(int(snap.error[0]))
        self._window += snap.expert_counts.numpy()
        totals = snap.balance_counts[:, 1:].sum(0).tolist()
        self._balance_window = [a + b for a, b in zip(self._balance_window, totals[:4])]
        self._batch_window = [a + b for a, b in zip(self._batch_window, totals[4:])]
        for layer, pairs in zip(self.layer_index, snap.pair_counts.tolist()):
            self._fold(layer, pairs)
        self._due_tokens += snap.tokens

    def sync_stats(self) -> None:
        """Fold everything the device has counted into the statistics and the refresh window (a
        snapshot on its way first, then the counters now: one read-back of each), and start them
        again."""
        if self._snapshot is not None:
            if self._snapshot.done is not None:
                self._snapshot.done.synchronize()
            self._fold_snapshot()
        self._snapshot = self._take_snapshot(0)
        if self._snapshot.done is not None:
            self._snapshot.done.synchronize()
        self._fold_snapshot()


def batch_split(one_map: Tensor, num_slots: int, cpu_share: float) -> Tensor:
    """A batch's map from the one-token map (slot, or S + e outside the bank): of the experts outside
    the bank, in id order, expert i of n is the CPU's (-1) where floor((i + 1) × share) passes
    floor(i × share), so the CPU's share of them is spread evenly over the ids, and the device reads
    the rest in place (S + e)."""
    out = one_map.clone()
    outside = (one_map[:-1] >= num_slots).nonzero().flatten()
    i = torch.arange(outside.numel(), dtype=torch.float64)
    cpu = torch.floor((i + 1) * cpu_share) > torch.floor(i * cpu_share)
    out[outside[cpu]] = -1
    return out


def _waited(balance: SplitBalance, what: str) -> str:
    """--stats: how long the device last waited for the CPU's rows per split call of a kind."""
    waited, share = balance.wait_us_per_call, balance.wait_share
    if waited is None:
        return ""
    return f"; the device waited {waited:.0f} µs per {what} for the CPU's rows" + (
        f" ({share:.0%} of the {balance.span_us_per_call:.0f} µs from its post to the CPU's answer)"
        if share is not None else "")
