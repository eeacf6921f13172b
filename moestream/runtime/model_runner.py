"""The model runner: runs the model on one device for the scheduler's sequences.

It owns the rotary table, the cache (rows = running sequences) and the CUDA graphs, one set per
decode batch size, kept while the batch changes size and recaptured only when the cache itself
is reallocated (a larger batch than ever before), and a fully resident bank's prompt chunk graphs. Every model call goes through `forward`, which
tells the bank what kind of step it is and how many tokens went through.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from moestream.errors import BudgetError
from moestream.experts.bank import ExpertBank
from moestream.model.cache import ModelCache
from moestream.model.context import decode_context, no_cache_context, prefill_context
from moestream.model.decoder import MoECausalLM
from moestream.model.rotary import rotary_table
from moestream.model.routers import ChosenRouter
from moestream.runtime.cuda_graphs import DecodeGraphs, PromptGraphs, SegmentedDecode


# Batch sizes whole-step decode graphs are captured for; a batch runs padded to the next one.
PADDED_BATCHES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


@dataclass(frozen=True)
class PagedLayout:
    """A paged cache: `num_blocks` blocks (block 0 the null block) of `block_size` positions."""

    num_blocks: int
    block_size: int


class ModelRunner:
    def __init__(self, model: MoECausalLM, bank: ExpertBank, device: torch.device, dtype: torch.dtype,
                 max_context: int, prefill_chunk: int = 512, cuda_graphs: bool = True,
                 paged: PagedLayout | None = None, reserved_rows: int = 1):
        """`paged`: keep keys and values in a block pool (rows are block-table rows) instead of one
        full-context row per sequence. `reserved_rows`: the sequences whose rows the memory plan
        reserved (its `kv_rows`); the cache takes them all when it is first made (`ensure_rows`).

        Decode with a fetch bank runs as segments split at each router (the bank sees the routing
        between segments; an expert-parallel rank's through `bank_ids`) where the model's MoE layers
        split there (`segmented`); elsewhere it decodes eagerly."""
        self.model, self.bank, self.device, self.dtype = model, bank, device, dtype
        self.paged = paged
        self.segmented = model.splits_at_routers
        self.max_context = max_context
        self.prefill_chunk = prefill_chunk
        self.reserved_rows = reserved_rows
        self.cuda_graphs = self._graphs_allowed(cuda_graphs)
        # Called after each whole-step graph replay with the rows it ran: the host sees nothing of
        # a replay, so expert parallel counts the all-reduces captured in it here.
        self.after_replay: Callable[[int], None] | None = None
        # Run on a decode step's token ids (B,) or the graphs' token buffer first thing in every decode
        # step, eager or captured: an expert-parallel group broadcasts rank 0's tokens to every rank
        # there, on the device, so rank 0 never reads a step's tokens back to hand them on.
        self.before_decode: Callable[[torch.Tensor], None] | None = None
        # An expert-parallel rank's segmented decode hands its bank the routed ids as the bank numbers
        # its share of the experts (-1: another rank's); None: the bank holds every expert's id.
        self.bank_ids: Callable[[int, np.ndarray], np.ndarray] | None = None
        self.cache: ModelCache | None = None
        self.scratch_row: int | None = None   # the cache's last row, where padded decode rows write
        self._rotary = None
        self.routing = None   # a benchmark's routing swapped in (use_routing), else the model's own
        self._graphs: dict[int, DecodeGraphs | SegmentedDecode] = {}
        # A fully resident bank's prompt chunks as graphs (one object, every captured length and bucket);
        # an expert-parallel group turns them off: its ranks run each prompt chunk eagerly, in step.
        self.prompt_graphs = True
        self._prompt_graphs: PromptGraphs | None = None
        # One memory pool for every batch size's whole-step graphs: only one replays at a time, and
        # each step's logits are consumed before the next replay.
        self._graph_pool = None

    def _graphs_allowed(self, wanted: bool) -> bool:
        return wanted and self.device.type == "cuda" and not os.environ.get("MOESTREAM_NO_CUDA_GRAPHS")

    def set_cuda_graphs(self, enabled: bool) -> None:
        """Switch decode graphs on or off (before the first model call: the cache's scratch row
        depends on it); an expert-parallel group makes every rank take the same decision."""
        self.cuda_graphs = self._graphs_allowed(enabled)
        self.drop_graphs()

    def rotary_table(self):
        if self._rotary is None:
            self._rotary = rotary_table(self.model.config, self.max_context, self.device)
        return self._rotary

    # ---- the cache ----------------------------------------------------------------------
    def ensure_rows(self, rows: int) -> ModelCache:
        """A cache with at least `rows` rows, and at least the plan's `reserved_rows`; growing it
        keeps what the first rows hold.

        The first cache takes every reserved row at once: the plan counted them, while growing one
        later holds the old cache and the new together (a 1-row cache grown to 17 rows at a
        262,144-token context is 6 GiB beyond the plan). A cache that does not fit leaves the one
        there was in place and says so (`BudgetError`)."""
        old = self.cache
        if old is not None and self.usable_rows >= rows:
            return old
        rows = max(rows, self.reserved_rows)
        self.cache = None
        self.drop_graphs()   # captured against the old cache's tensors
        # With graphs and more than one row, one more row: the scratch row padded batches write to.
        scratch = 1 if rows > 1 and self.cuda_graphs else 0
        try:
            if self.paged is not None:   # the pools stay (their blocks are the sequences'); the tables grow
                new = self.model.new_paged_cache(rows + scratch, self.max_context, self.paged.num_blocks,
                                                 self.paged.block_size, self.dtype, self.device, like=old)
            else:
                new = self.model.new_cache(rows + scratch, self.max_context, self.dtype, self.device)
        except torch.OutOfMemoryError:
            self.cache = old
            raise BudgetError(f"a KV cache of {rows} sequences at a {self.max_context}-token context does not fit "
                              f"the memory left on {self.device}; lower --max-context or the batch.") from None
        if old is not None and self.paged is None:
            for src, dst in zip(old.layers, new.layers):
                dst.copy_rows_from(src, old.rows)
        self.cache, self.scratch_row = new, (rows if scratch else None)
        return new

    def check_ranks(self) -> None:
        """After waiting for a step: raise if a rank of an expert-parallel group died during it (the
        step's output is then not the model's). One device: nothing to check."""

    @property
    def usable_rows(self) -> int:
        """Rows sequences can hold (the scratch row is not one of them)."""
        if self.cache is None:
            return 0
        return self.cache.rows - (1 if self.scratch_row is not None else 0)

    def drop_graphs(self) -> None:
        """Forget the captured decode graphs: the next decode step captures again (after swapping a
        router, or switching the fused ops, both of which a graph would otherwise keep). Their memory
        pool goes with them: a pool whose graphs are all gone cannot take new captures."""
        self._graphs.clear()
        self._prompt_graphs = None
        self._graph_pool = None

    def use_routing(self, routing) -> None:
        """Make every MoE block choose its experts by `routing` (a benchmark's: a callable
        (layer, logits) -> (weights, ids) with `reset()`, optionally `predict(layer, h)` and
        `prediction_accuracy`, and `to(device)` giving the routing on this runner's device). A routing
        swapped in earlier is replaced, not stacked. An expert-parallel rank makes the same call, so
        every rank routes alike."""
        if hasattr(routing, "to"):
            routing = routing.to(self.device)
        self.routing = routing
        for block in self.model.moe_blocks():
            router = block.router
            inner = router.inner if isinstance(router, ChosenRouter) else router
            predict = (functools.partial(routing.predict, block.layer)
                       if getattr(routing, "prediction_accuracy", None) is not None else None)
            block.swap_router(ChosenRouter(inner, functools.partial(routing, block.layer), predict))

    def reset_routing(self) -> None:
        """Start the swapped-in routing's draws or replay again (every rank of a group alike)."""
        if self.routing is not None:
            self.routing.reset()

    def release_graphs(self) -> None:
        """Free every captured decode graph, those `enter_eager` set aside too, and wait for the device.
        An expert-parallel rank does this before destroying its NCCL communicator: a graph that captured
        an all-reduce holds buffers registered with the other ranks, and the communicator's teardown
        waits on them."""
        self.drop_graphs()
        self._saved_graphs = (self.cuda_graphs, {})
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def move_row(self, src: int, dst: int, length: int) -> None:
        self.cache.move_row(src, dst, length)

    # ---- model calls --------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, ctx, last_only: bool = False, decoding: bool = False) -> torch.Tensor:
        """One model call, with the bank told what kind of step it is and how many tokens went through."""
        self.bank.begin_step(decoding)
        logits = self.model(input_ids, ctx, last_only=last_only)
        self.bank.after_step(input_ids.numel())
        return logits

    @torch.inference_mode()
    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(batch, seq, vocab) logits of a full forward without cache; padding marked by attention_mask."""
        ctx = no_cache_context(self.rotary_table(), input_ids, attention_mask, self.dtype)
        return self.forward(input_ids, ctx)

    @torch.inference_mode()
    def prefill(self, row: int, ids: list[int], start: int = 0) -> torch.Tensor:
        """Positions start..start+len(ids)-1 of a sequence (`ids` theirs) into cache row `row`, chunk by
        chunk (the row already holds the positions before `start`); the last position's logits (1, V).
        Only the new ids travel: a long context's earlier ones are never rebuilt on the host."""
        table = self.rotary_table()
        tensor = None
        for offset in range(0, len(ids), self.prefill_chunk):
            n = min(self.prefill_chunk, len(ids) - offset)
            graphs = self._prompt_runner(start + offset, n)
            if graphs is not None:
                self.bank.begin_step(False)
                logits = graphs(row, ids[offset:offset + n], start + offset)
                self.bank.after_step(n)
                continue
            if tensor is None:
                tensor = torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True)
            chunk = tensor[offset:offset + n][None]
            ctx = prefill_context(table, self.cache, row, start + offset, n, self.dtype)
            logits = self.forward(chunk, ctx, last_only=True)[:, -1]
        return logits

    def _prompt_runner(self, start: int, n: int) -> PromptGraphs | None:
        """The prompt graphs that run a chunk of n tokens at `start`, where they apply: graphs on, the
        bank fully resident (a chunk then reads nothing back), every cache layer full keys and values,
        and the chunk no longer than the longest captured length."""
        if not (self.cuda_graphs and self.prompt_graphs and self.bank.fully_resident and self.bank.graph_safe):
            return None
        graphs = self._prompt_graphs
        if graphs is None or graphs.cache is not self.cache:
            if not PromptGraphs.takes(self.cache):
                return None
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            graphs = self._prompt_graphs = PromptGraphs(self.model, self.rotary_table(), self.cache, self.dtype,
                                                        pool=self._graph_pool)
        return graphs if graphs.padded_length(start, n) is not None else None

    @property
    def packs_prompts(self) -> bool:
        """Whether `prefill_packed` runs several sequences' chunks in one forward (else one each)."""
        return self.model.packs_prompts

    @torch.inference_mode()
    def prefill_packed(self, parts: list[tuple[int, list[int], int]]) -> torch.Tensor:
        """Prompt chunks of several sequences in one forward: part (row, ids, start) puts positions
        start..start+len(ids)-1 (`ids` theirs) into cache row `row` (the row holds the ones before).
        Their tokens together are one forward's (at most `prefill_chunk`, the activations the plan
        sized). The logits of each part's last position (n, V)."""
        table = self.rotary_table()
        lengths = [len(ids) for _, ids, _ in parts]
        flat = [t for _, ids, _ in parts for t in ids]
        ids = torch.tensor(flat, dtype=torch.long).to(self.device, non_blocking=True)   # one copy for all
        inputs = [(part_ids[None], prefill_context(table, self.cache, row, start, n, self.dtype))
                  for part_ids, (row, _, start), n in zip(ids.split(lengths), parts, lengths)]
        self.bank.begin_step(False)
        logits = self.model.forward_packed(inputs)
        self.bank.after_step(len(flat))
        return logits

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        """Logits (B, V) of one decode step of cache rows 0..B-1: token b at position positions[b].
        `tokens` stay on the device (they may still be computing); `positions` may be on the host,
        whence they are copied without waiting for the device."""
        B = tokens.shape[0]
        if positions.device != self.device:
            positions = positions.to(self.device, non_blocking=True)
        runner = self._decoder(B)
        if runner is None:
            if self.before_decode is not None:
                tokens = tokens.contiguous()
                self.before_decode(tokens)
            ctx = decode_context(self.rotary_table(), self.cache, positions, kv_len, self.dtype)
            return self.forward(tokens[:, None], ctx, decoding=True)[:, -1]
        self.bank.begin_step(True, live_rows=B)   # a padded graph's extra rows need no experts
        logits = runner(tokens, positions, kv_len)
        self.bank.after_step(B)
        if self.after_replay is not None and isinstance(runner, DecodeGraphs):
            self.after_replay(runner.batch)
        elif self.after_replay is not None and runner.use_graphs:   # segments replayed every reduce once
            self.after_replay(B)
        return logits

    def padded_batch(self, batch: int) -> int:
        """The batch size whose whole-step graphs run a batch of `batch`: the next of PADDED_BATCHES
        that the cache's rows hold (one capture per padded size, not per size), else `batch`."""
        if self.scratch_row is None:
            return batch
        return next((size for size in PADDED_BATCHES if batch <= size <= self.usable_rows), batch)

    def _decoder(self, batch: int) -> DecodeGraphs | SegmentedDecode | None:
        """The captured decode of this batch size: whole-step graphs when the bank reads nothing back
        (shared by the batch sizes that pad to one size), graph segments split at each router for a
        fetch bank (eager segments on the CPU; exact sizes: padding rows would fetch experts), else None."""
        whole = self.cuda_graphs and self.bank.graph_safe
        key = self.padded_batch(batch) if whole else batch
        runner = self._graphs.get(key)
        if runner is not None and runner.cache is self.cache:
            return runner
        if whole:
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            runner = DecodeGraphs(self.model, self.rotary_table(), self.cache, key, self.dtype, self.scratch_row,
                                  pool=self._graph_pool, before_step=self.before_decode)
        elif self.segmented and self.bank.can_segment(batch):
            runner = SegmentedDecode(self.model, self.bank, self.rotary_table(), self.cache, batch, self.dtype,
                                     use_graphs=self.cuda_graphs, before_step=self.before_decode,
                                     bank_ids=self.bank_ids)
        else:
            return None
        self._graphs[key] = runner
        return runner

    @torch.inference_mode()
    def prepare(self, batch: int, length: int, prompt_length: int = 1) -> None:
        """Allocate the cache and capture the decode graphs a run of this size will need, ahead of time.

        Call between runs only: capturing writes the cache at the static buffers' positions.
        """
        self.ensure_rows(batch)
        runner = self._decoder(batch)
        if runner is not None and self.cuda_graphs:
            runner.capture_upto(min(length, self.max_context), prompt_length + 1)

    @torch.inference_mode()
    def capture_batches(self, max_batch: int, length: int) -> None:
        """Capture the whole-step graphs of every padded batch size up to `max_batch` for contexts up
        to `length` (a server's warm-up: batch sizes then change mid-stream without a capture).
        Call between runs only, like `prepare`."""
        if not (self.cuda_graphs and self.bank.graph_safe):
            return
        self.ensure_rows(max_batch)
        for size in sorted({self.padded_batch(b) for b in range(1, max_batch + 1)}, reverse=True):
            self._decoder(size).capture_upto(min(length, self.max_context))   # largest first: the pool is shared

    @contextmanager
    def eager(self) -> Iterator[None]:
        """Run every step eagerly inside (routers swapped for observers would not be seen by graphs
        captured before, and capturing with them would count the capture's warm-up steps)."""
        self.enter_eager()
        try:
            yield
        finally:
            self.leave_eager()

    def enter_eager(self) -> None:
        """`eager`'s first half (a separate call, so an expert-parallel group can make it on every rank)."""
        self._saved_graphs = (self.cuda_graphs, self._graphs)
        self.cuda_graphs, self._graphs = False, {}

    def leave_eager(self) -> None:
        self.cuda_graphs, self._graphs = self._saved_graphs   # graphs of a reallocated cache are recaptured on use

    @torch.inference_mode()
    def teacher_forced(self, context: list[int], targets: list[int]) -> torch.Tensor:
        """Log-probabilities (len(targets),) of `targets` after `context`, scored one decode step at a
        time in cache row 0 (the engine must be idle): the path generation takes, so decode-only
        approximations (the skip policy) count."""
        self.ensure_rows(1)
        logits = self.prefill(0, context)
        positions = torch.tensor([len(context)], dtype=torch.long, device=self.device)
        wanted = torch.tensor(targets, dtype=torch.long, device=self.device)
        scores = []
        for step, token in enumerate(wanted):
            scores.append(logits.float().log_softmax(-1)[0, token])
            if step + 1 < len(targets):
                logits = self.decode(token.view(1), positions, len(context) + step + 1)
                positions = positions + 1
        return torch.stack(scores)
