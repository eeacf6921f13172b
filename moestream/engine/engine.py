"""The Engine: a loaded model, its tokenizer and runtime, with logits / generate / stream as the public API.

Generation is a loop over `step()`: requests become `Sequence`s that the scheduler admits into
cache rows. The scheduler plans each step (`Scheduler.schedule`: admissions, prompt chunks of at
most `prefill_chunk` tokens in all, the decode batch, a paged cache's blocks and preemptions) and
the engine executes the plan (`_execute`): it writes the blocks into the model's block tables,
prefills the chunks (a sequence whose prompt is in samples its first token) and decodes every
sequence that was already running, one token each, in one batch. `generate` and `stream` add
their sequences and step until those finish; several readers may share one engine (each reads
its own sequences' outboxes, whoever stepped), so two interleaved streams stay independent.

Overlap: while the same sequences decode step after step, a step's sampled tokens stay on the
device and feed the next step, which is launched before the host reads them; the host's part of
a step (the scheduler, the cache's blocks, the inputs, the graph launch, stop checks and text)
then runs while the device computes, instead of between two steps. A sequence that ends on an
EOS or a stop string has had one more step launched: that step is read at once and its token
for the ended sequence dropped. Anything that changes the batch reads the step in flight first.
An expert-parallel group overlaps alike: its followers get each step's tokens from rank 0 on the
device, inside the step (`runtime/distributed.py`).
"""

from __future__ import annotations

import resource
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass

import torch

from moestream import kernels
from moestream.engine.config import EngineConfig
from moestream.engine.plan import LoadPlan
from moestream.errors import BudgetError, InputError, NumericsError
from moestream.experts.bank import ExpertBank
from moestream.experts.collective import CollectiveStats
from moestream.model.decoder import MoECausalLM
from moestream.runtime.blocks import BlockManager
from moestream.runtime.model_runner import ModelRunner
from moestream.runtime.prefix_cache import PrefixCache
from moestream.runtime.sampling import SamplingParams, make_generator, sample_rows
from moestream.runtime.scheduler import PrefillChunk, Scheduler, StepPlan, TableWrite
from moestream.runtime.sequence import Sequence
from moestream.warmstart.discovery import DEFAULT_PROMPT as DEFAULT_DISCOVERY_PROMPT

# Context length up to which a server captures its decode graphs at start-up (longer ones on first use).
WARM_CONTEXT = 512

Prompt = str | list[int]


@dataclass
class _Sampled:
    """One decode step's tokens, sampled on the device, and their copy on its way to the host."""

    seqs: list[Sequence]
    tokens: torch.Tensor               # (B,) on the device: the next step's input
    host: torch.Tensor                 # (B, 2) token and finiteness per row (pinned on a GPU)
    done: torch.cuda.Event | None      # when `host` has landed (None: it already has)


def _chunk_part(c: PrefillChunk) -> tuple[int, list[int], int]:
    """A prompt chunk as the runner's prefill takes it: (row, the chunk's ids, its start)."""
    return c.seq.row, c.seq.id_range(c.start, c.end), c.start


@dataclass
class StepCounters:
    """What the steps did since the engine started (or since `reset_stats`): prompt chunks, their
    tokens and the forwards that ran them, decode steps, preemptions. Read between steps, like `stats()`."""

    prefill_chunks: int = 0
    prefill_tokens: int = 0
    prefill_forwards: int = 0   # the chunks of one step run as one forward where the model packs prompts
    decode_steps: int = 0
    decodes_packed: int = 0     # of those, steps whose decodes rode in the step's packed prompt forward
    preemptions: int = 0

    def reset(self) -> None:
        self.prefill_chunks = self.prefill_tokens = self.prefill_forwards = self.decode_steps = 0
        self.decodes_packed = self.preemptions = 0

    def as_dict(self) -> dict[str, int]:
        return {"prefill_chunks": self.prefill_chunks, "prefill_tokens": self.prefill_tokens,
                "prefill_forwards": self.prefill_forwards, "decode_steps": self.decode_steps,
                "decodes_packed": self.decodes_packed, "preemptions": self.preemptions}


@dataclass
class RunMetrics:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    prefill_s: float = 0.0
    peak_memory_bytes: int = 0

    @property
    def decode_tok_s(self) -> float:
        steps = self.generated_tokens - 1
        return steps / self.decode_s if self.decode_s > 0 and steps > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated_tokens,
                "ttft_s": self.ttft_s, "prefill_s": self.prefill_s, "decode_s": self.decode_s,
                "decode_tok_s": self.decode_tok_s, "peak_memory_bytes": self.peak_memory_bytes}


class Engine:
    def __init__(self, plan: LoadPlan, model: MoECausalLM, bank: ExpertBank, runner: ModelRunner, tokenizer,
                 max_batch: int = 64, discovery=None, prepack=None, prefix_cache: PrefixCache | None = None,
                 collectives: CollectiveStats | None = None, blocks: BlockManager | None = None,
                 overlap: str = "auto", pack_prompts: bool = True):
        self.plan, self.model, self.bank, self.runner, self.tokenizer = plan, model, bank, runner, tokenizer
        self.collectives = collectives     # this rank's all-reduces, when it is one of an expert-parallel group
        self.prefix_cache = prefix_cache   # rows layout: finished sequences' KV, reused by prompts that extend them
        self.blocks = blocks               # paged layout: every sequence's KV blocks, and the prefix blocks kept
        self.group = None                  # the other ranks, when this engine is rank 0 of an expert-parallel group
        self.config, self.spec, self.folder = plan.config, plan.spec, plan.folder
        self.device, self.dtype, self.max_context = plan.device, plan.dtype, plan.context
        # The step's policy (admission, prompt chunks, blocks, preemption); the engine executes its plans.
        self.scheduler = Scheduler(max_batch, runner.prefill_chunk, blocks=blocks, prefix_cache=prefix_cache)
        self.counters = StepCounters()
        self.overlap = overlap             # auto | on | off (RuntimeConfig.overlap)
        self.pack_prompts = pack_prompts and runner.packs_prompts   # a step's chunks in one forward
        # Where prompts are packed: the next prompt cut to fill a step's budget, and at a bank the step's
        # decodes riding in its forward (both on unless a benchmark compares them with their absence).
        self.fill_steps, self.ride_decodes = True, True
        self._inflight: _Sampled | None = None   # a decode step launched whose tokens are not read yet
        # One engine, several threads: each call that touches the scheduler or the device holds this
        # lock, so threads interleave at step granularity and each reads only its own sequences.
        self._lock = threading.RLock()
        self.discovery, self.prepack = discovery, prepack   # how the bank started (reported by the CLI)
        self.prepack_error: str | None = None
        self.last_metrics = RunMetrics()
        self.eos_ids = set(self.config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_ids.add(int(tokenizer.eos_token_id))

    @property
    def memory_plan(self):
        return self.plan.memory

    @property
    def overlapping(self) -> bool:
        """Whether decode steps run one ahead of the host (`overlap`): auto turns it on on a GPU where a
        step reads nothing back (whole-step graphs); in an expert-parallel group, where the group
        replays whole steps as graphs (NCCL, every rank's bank graph-safe), the step's tokens then
        reaching the followers inside it."""
        if self.overlap == "auto":
            return (self.device.type == "cuda" and self.bank.graph_safe
                    and (self.group is None or self.runner.cuda_graphs))
        return self.overlap == "on"

    def close(self) -> None:
        """Stop the other ranks of an expert-parallel group and the bank's CPU worker (hybrid misses)."""
        with self._lock:
            self._drain()
            if self.group is not None:
                self.runner.release_graphs()   # before the communicator goes (see leave_group)
                self.group.close()
                self.group = None
            self.bank.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- bank statistics ----------------------------------------------------------------
    def stats(self) -> dict:
        """Hits, misses, evictions, bytes copied and copy wait time, per layer and in total (read
        between steps, so another thread stepping the engine is safe). With several devices the
        totals add up every rank's bank, `ranks` holds each rank's own figures (its device and its
        all-reduces under `collective`: calls, bytes, seconds, and the calls replayed inside CUDA
        graphs, counted but not timed) and `layers` rank 0's."""
        with self._lock:
            self.bank.sync_stats()
            mine = self.bank.stats.as_dict()
            if self.collectives is not None:
                mine = {**mine, "device": str(self.device), "collective": self.collectives.as_dict()}
            if self.group is None:
                return mine
            ranks = [mine] + self.runner.rank_stats()
        total = {key: sum(r[key] for r in ranks) for key in ("hits", "misses", "evictions", "bytes_copied", "copy_wait_s")}
        looked_up = total["hits"] + total["misses"]
        top = {k: v for k, v in mine.items() if k not in ("device", "collective")}
        return {**top, **total, "hit_rate": total["hits"] / looked_up if looked_up else 0.0,
                "bytes_copied_per_token": total["bytes_copied"] / mine["tokens"] if mine["tokens"] else 0.0,
                "ranks": ranks}

    def prefix_cache_stats(self) -> dict | None:
        """Lookups, hits, reused tokens, entries and bytes of the prefix cache (with a paged cache,
        its blocks too); None when it is off."""
        with self._lock:
            if self.blocks is not None:
                return self.blocks.as_dict()
            return self.prefix_cache.as_dict() if self.prefix_cache is not None else None

    def clear_prefix_cache(self) -> None:
        """Forget every cached prefix (sequences running keep their KV)."""
        with self._lock:
            self._drain()
            if self.blocks is not None:
                self.blocks.clear()
            if self.prefix_cache is not None:
                self.prefix_cache.clear()

    def reset_stats(self) -> None:
        """Start every counter again, on every rank of a group."""
        with self._lock:
            self.bank.sync_stats()
            self.bank.stats.reset()
            self.counters.reset()
            if self.collectives is not None:
                self.collectives.reset()
            if self.group is not None:
                self.runner.reset_rank_stats()

    def warm_up(self, tokens: int = 8, bank_is_warm: bool = False) -> None:
        """Hybrid warm-up: a few generated tokens of a short prompt compile kernels, capture decode
        graphs and swap in that domain's missing experts before the first real request.

        A bank restored from a snapshot is already warm: then a 4-token prompt only compiles and
        captures, instead of streaming a prompt's worth of missing experts through the bank."""
        prompt = (self.encode(DEFAULT_DISCOVERY_PROMPT) if self.tokenizer is not None
                  else list(range(1, min(32, self.config.vocab_size))))
        if bank_is_warm:
            prompt = prompt[:4]
        self.generate(prompt, max_tokens=tokens, ignore_eos=True)
        self._compile_sampler(prompt[:4])
        rows = self.plan.memory.kv_rows
        if rows > 1:   # a server: every padded batch size's decode graphs, for the first context lengths
            self.runner.capture_batches(rows, WARM_CONTEXT)
        if not bank_is_warm:
            self._compile_prompt_tiles()
        self.reset_stats()

    def _compile_sampler(self, prompt: list[int]) -> None:
        """A sampled token at one top-k of each variant of the two-launch top-k draw: a client's first
        request with top-k (Qwen's recommended 20, a UI's 40 or 50) would otherwise compile its variant
        while the client waits (the warm-up decodes greedily)."""
        if self.device.type != "cuda" or not kernels.fused_moe_available():
            return
        for k in kernels.sampling_top_k_variants(self.config.vocab_size):
            self.generate(prompt, max_tokens=1, temperature=1.0, top_k=k, seed=0, ignore_eos=True)

    def _compile_prompt_tiles(self) -> None:
        """A prompt of each grouped-path tile row a step can take (up to `prefill_chunk` tokens; past one
        context, several prompts packed into one step, as a server's step packs its rows'), so the
        kernels of every step size are compiled before the first request (rules of the hot path, 9): on
        an empty Triton cache a served step that first met a tile row stalled for seconds. Then one step
        of the longest chunk: a 16,384-token first turn with int4 experts at a bank compiled the
        dequantized long path's kernels in its first chunk (~5 s of a 6 s first token). A bank
        restored from a snapshot skips it (the prompts would stream experts through the warm bank)."""
        if self.device.type != "cuda" or not kernels.fused_moe_available():
            return
        vocab = self.config.vocab_size
        per_prompt = self.max_context - 1   # a prompt leaves room for its token
        rows = self.plan.memory.kv_rows if self.pack_prompts else 1   # a step packs up to this many prompts
        longest = min(self.runner.prefill_chunk, rows * per_prompt)
        counts = kernels.prompt_tile_rows(self.config.top_k, self.config.num_experts, longest)
        if longest not in counts:   # the longest step too: quantized experts' long calls take the dequantized
            counts.append(longest)  # path (long_prompts.py), its kernels unmet by the tile rows' shorter steps
        for n in counts:
            # n tokens in one forward: one prompt, or (past one context) several packed into one step
            prompts = [[(start + i) % (vocab - 1) + 1 for i in range(length)]
                       for start, length in zip(range(0, n, per_prompt), prompt_lengths(n, per_prompt))]
            self.generate(prompts if len(prompts) > 1 else prompts[0], max_tokens=1, ignore_eos=True)

    # ---- inputs -------------------------------------------------------------------------
    def encode(self, prompt: Prompt, chat: bool = False) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InputError("this checkpoint has no tokenizer files, so text prompts cannot be encoded; pass token ids instead.")
            if chat:
                if not getattr(self.tokenizer, "chat_template", None):
                    raise InputError("this tokenizer has no chat template; run without --chat.")
                return list(self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                               add_generation_prompt=True, tokenize=True,
                                                               return_dict=False))
            ids = self.tokenizer(prompt, add_special_tokens=True).input_ids
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise InputError("the prompt is empty; give at least one token.")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise InputError(f"token id {bad[0]} is outside the vocabulary (0..{self.config.vocab_size - 1}).")
        if len(ids) >= self.max_context:
            raise InputError(f"the prompt has {len(ids)} tokens but the context holds {self.max_context}; shorten the prompt or raise --max-context.")
        return ids

    # ---- full forward -------------------------------------------------------------------
    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(batch, seq, vocab) logits of a full forward without cache; padding marked by attention_mask.

        The ids are checked on the host first: an out-of-range id would otherwise fault on the GPU
        and poison the CUDA context."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.numel() == 0:
            raise InputError("input_ids must be a non-empty 2-D tensor (batch, seq) of token ids.")
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool or input_ids.is_complex():
            raise InputError(f"input_ids must hold integer token ids, not {input_ids.dtype}.")
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= self.config.vocab_size:
            raise InputError(f"token id {low if low < 0 else high} is outside the vocabulary "
                             f"(0..{self.config.vocab_size - 1}).")
        if input_ids.shape[1] > self.max_context:
            raise InputError(f"the input has {input_ids.shape[1]} tokens but the context holds {self.max_context}; shorten it or raise max_context.")
        if attention_mask is not None:
            if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
                raise InputError("attention_mask must be a tensor of the same shape as input_ids.")
            if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
                raise InputError("attention_mask must hold only 0 (padding) and 1 (token).")
            attention_mask = attention_mask.to(self.device)
        with self._lock:
            self._drain()
            return self.runner.logits(input_ids.to(self.device, torch.long), attention_mask)

    # ---- requests and steps -------------------------------------------------------------
    def add_request(self, ids: list[int], params: SamplingParams) -> Sequence:
        """Queue one encoded prompt; it joins the running batch at the next step with room."""
        seq = self.new_sequence(ids, params)
        self.add_sequence(seq)
        return seq

    def new_sequence(self, ids: list[int], params: SamplingParams) -> Sequence:
        """A sequence for an encoded prompt, not yet queued (touches no shared state)."""
        return Sequence(ids, params, frozenset(self.eos_ids), self.tokenizer, self.max_context,
                        make_generator(params, self.device))

    def add_sequence(self, seq: Sequence) -> None:
        """Queue a sequence; it joins the running batch at the next step with room."""
        with self._lock:
            self.scheduler.add(seq)

    def step(self) -> list[Sequence]:
        """One step of the scheduler's plan: admit waiting sequences, prefill at most one chunk
        (`prefill_chunk` tokens) of their prompts (a sequence samples its first token once its whole
        prompt is in), and decode every sequence that was already decoding by one token, in one
        batch. A long prompt thus takes several steps, and a reader's `cancel` between them stops its
        prefill. Returns the sequences that got a token: with overlap, a decode step's tokens are read
        by the next call, after it has launched the step that follows (a call that only launches
        returns none)."""
        with self._lock, torch.inference_mode():
            try:
                return self._step()
            except NumericsError:   # the broken sequences ended; they leave the batch, the others go on
                try:
                    self._drain()
                except NumericsError:
                    pass
                self._retire()
                raise

    def _step(self) -> list[Sequence]:
        ahead = self._inflight
        if ahead is not None and self._can_run_ahead(ahead.seqs):
            writes = self.scheduler.reserve_ahead(ahead.seqs)
            if writes is not None:
                self._write_tables(writes)
                return self._run_ahead(ahead)
        got = self._drain()
        self._retire()   # cancelled since the last step, or ended by the step just read
        got += self._execute(self.scheduler.schedule(fill=self.pack_prompts and self.fill_steps,
                                                            ride=self.decodes_ride))
        if self._inflight is None:
            self._retire()
        self.scheduler.seal()
        return got

    def _execute(self, plan: StepPlan) -> list[Sequence]:
        """Run a step's plan: rows and blocks, prefix restores, the prompt chunks (the sequences whose
        prompt is in sample their first token together), then the decode batch. Returns the
        sequences that got a token (none for a decode step left in flight)."""
        runner, counters = self.runner, self.counters
        if plan.admitted:
            try:
                runner.ensure_rows(plan.rows)
            except BudgetError:   # no room for their rows: they wait again, the running ones keep theirs
                self.scheduler.unadmit(plan.admitted)
                raise
        counters.preemptions += len(plan.preempted)
        self._write_tables(plan.tables)
        for restore in plan.restores:
            self.prefix_cache.restore(restore.key, restore.length, runner.cache, restore.seq.row)
        ready, first = [], []
        chunks = [chunk for chunk in plan.prefills if not chunk.seq.finished]   # cancelled ones: no more work
        decoding = plan.decodes
        riding = bool(chunks and decoding and self.decodes_ride)
        if riding:   # one forward: the chunks, then each decoding sequence's token as a part of one
            logits = self._packed_forward(chunks, decoding)
            chunk_logits, decode_logits = iter(logits[:len(chunks)]), logits[len(chunks):]
        else:
            chunk_logits = self._prefill(chunks)
        for chunk, logits in zip(chunks, chunk_logits):
            seq = chunk.seq
            if logits is None:   # cancelled by its reader while an earlier chunk of this step ran: skipped
                continue
            counters.prefill_chunks += 1
            counters.prefill_tokens += chunk.tokens
            seq.prefilled = chunk.end
            if not chunk.last or seq.finished:   # finished: cancelled while its chunk ran, no token
                continue
            if seq.resuming:   # back after preemption: its next token was sampled before, it decodes on
                seq.resuming = False
                continue
            ready.append(seq)
            first.append(logits)
        got = self._take(self._sample(ready, torch.stack(first))) if ready else []
        if riding:
            self.counters.decode_steps += 1
            self.counters.decodes_packed += 1
            got += self._take(self._sample(decoding, decode_logits))
        elif decoding:
            tokens = torch.tensor([s.last_token for s in decoding], dtype=torch.long).to(self.device, non_blocking=True)
            sampled = self._decode(decoding, tokens)
            if self._can_run_ahead(decoding):
                self._inflight = sampled   # read by the next step, once it has launched the one after
            else:
                got += self._take(sampled)
        return got

    def _prefill(self, chunks: list[PrefillChunk]) -> Iterator[torch.Tensor | None]:
        """A step's prompt chunks, the logits of each one's last position (V,) as each is done: one
        forward for all of them where the model packs prompts (each layer's experts then run once for
        every chunk's tokens: a bank brings a missing expert in once a step, not once a prompt), else
        one forward each, a chunk whose sequence was cancelled meanwhile skipped (None)."""
        if len(chunks) > 1 and self.pack_prompts:
            yield from self._packed_forward(chunks, [])
            return
        for c in chunks:
            if c.seq.finished:
                yield None
                continue
            self.counters.prefill_forwards += 1
            yield self.runner.prefill(*_chunk_part(c))[0]

    @property
    def decodes_ride(self) -> bool:
        """Whether a step's decodes run inside its packed prompt forward, as parts of one token: where
        prompts are packed and the bank streams experts. A decode step at a bank pays for its missing
        experts (copied, or computed from host RAM) while the prompt's forward has just streamed nearly
        every expert of each layer, so the decode tokens ride along for the price of their attention
        (the scheduler counts them in the step's budget: a forward stays within `prefill_chunk`);
        fully resident, the decode graph is the cheaper way."""
        return self.ride_decodes and self.pack_prompts and not self.plan.memory.fully_resident

    def _packed_forward(self, chunks: list[PrefillChunk], decoding: list[Sequence]) -> torch.Tensor:
        """The logits (n, V) of one packed forward: each chunk's last position, then each decoding
        sequence's next token (its last sampled token, at its last position: a part of one token)."""
        self.counters.prefill_forwards += 1
        parts = [_chunk_part(c) for c in chunks] + [(s.row, s.id_range(s.length - 1, s.length), s.length - 1)
                                                   for s in decoding]
        return self.runner.prefill_packed(parts)

    def _write_tables(self, writes: list[TableWrite]) -> None:
        """A plan's blocks into the model's block tables (a paged cache), in the plan's order."""
        tables = self.runner.cache.tables if writes else None
        for write in writes:
            if write.blocks is None:
                tables.clear(write.row)
            else:
                tables.assign(write.row, list(write.blocks), start=write.start)

    # ---- overlapped decode ----------------------------------------------------------------
    def _can_run_ahead(self, seqs: list[Sequence]) -> bool:
        """Whether the step after the one in flight may be launched before its tokens are read:
        overlap is on and the scheduler will decode the same sequences again."""
        return self.overlapping and self.scheduler.decodes_again(seqs)

    def _run_ahead(self, ahead: _Sampled) -> list[Sequence]:
        """Launch the next decode step from the tokens in flight (still on the device), then read
        those tokens while it runs."""
        seqs = ahead.seqs
        self._inflight = self._decode(seqs, ahead.tokens, ahead=1)
        got = self._take(ahead)
        if any(s.finished for s in seqs):   # an EOS or a stop string: the batch changes with nothing in flight
            got += [s for s in self._drain() if s not in got]
            self._retire()
        self.scheduler.seal()
        return got

    def _decode(self, seqs: list[Sequence], tokens: torch.Tensor, ahead: int = 0) -> _Sampled:
        """One decode step of `seqs` (cache rows 0..B-1) fed `tokens` (B,) on the device, sampled:
        each token at its sequence's last position, or with `ahead` = 1 one past it (the token still
        in flight, not appended yet)."""
        positions = torch.tensor([s.length - 1 + ahead for s in seqs], dtype=torch.long)   # the runner copies them over
        kv_len = max(s.length for s in seqs) + ahead
        self.counters.decode_steps += 1
        return self._sample(seqs, self.runner.decode(tokens, positions, kv_len))

    def _drain(self) -> list[Sequence]:
        """Read the step in flight, if there is one; its tokens go to the sequences still running."""
        ahead, self._inflight = self._inflight, None
        return self._take(ahead) if ahead is not None else []

    def _retire(self) -> None:
        """Finished and cancelled sequences leave their rows (a rows-layout prefix cache keeps what
        their rows hold first); the others move up, and rows left empty point at the null block."""
        running = self.scheduler.running
        held = len(running)
        if self.prefix_cache is not None:
            for seq in running:
                if seq.finished:
                    self.prefix_cache.store(seq.cached_ids(), self.runner.cache, seq.row)
        for src, dst, length in self.scheduler.retire():
            self.runner.move_row(src, dst, length)
        if self.blocks is not None:
            for row in range(len(self.scheduler.running), held):
                self.runner.cache.tables.clear(row)

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> _Sampled:
        """Sample one token per sequence on the device; the tokens and a finiteness flag per row start
        their way to the host in one copy, which `_take` waits for."""
        finite = torch.isfinite(logits).all(-1)
        safe = torch.where(finite[:, None], logits, torch.zeros_like(logits))   # sampling must not fail first
        tokens = sample_rows(safe, [s.params for s in seqs], [s.generator for s in seqs])
        packed = torch.stack((tokens, finite.to(tokens.dtype)), dim=1)
        if packed.device.type != "cuda":
            return _Sampled(seqs, tokens, packed, None)
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return _Sampled(seqs, tokens, host, done)

    def _take(self, sampled: _Sampled) -> list[Sequence]:
        """Wait for a step's tokens (not for any step launched after it) and append them to its
        sequences that are still running; returns those."""
        try:
            if sampled.done is not None:
                sampled.done.synchronize()
        finally:   # a rank that died during the step (its collectives aborted, or not) is named first
            self.runner.check_ranks()
        got, broken = [], None
        for seq, (token, ok) in zip(sampled.seqs, sampled.host.tolist()):
            if seq.finished:   # ended or cancelled while this step was in flight
                continue
            if not ok:   # this sequence ends; the others keep their tokens (a step after may be in flight)
                broken = broken if broken is not None else seq.sampled + 1
                seq.finish("error")
                continue
            seq.append(token)
            got.append(seq)
        if broken is not None:
            raise NumericsError(f"the model produced NaN or infinite logits at step {broken} of a sequence; the "
                                "weights are damaged or overflow the dtype (try --dtype bfloat16 or float32).")
        return got

    def teacher_forced(self, context: list[int], targets: list[int]) -> torch.Tensor:
        """Log-probabilities (len(targets),) of `targets` after `context`, one decode step per target,
        in cache row 0 of an idle engine (`ModelRunner.teacher_forced`); a paged cache lends the row
        the blocks it needs for the call."""
        with self._lock, torch.inference_mode():
            self._drain()
            self._retire()
            if not self.scheduler.idle:
                raise InputError("teacher-forced scoring needs an idle engine; finish or cancel the running requests first.")
            self.runner.ensure_rows(1)
            if self.blocks is None:
                return self.runner.teacher_forced(context, targets)
            scoring = Sequence(list(context), SamplingParams(), row=0)
            writes = self.scheduler.reserve(scoring, len(context) + len(targets))
            if writes is None:
                raise InputError(f"the paged KV cache cannot hold {len(context) + len(targets)} positions; "
                                 "raise --kv-cache-memory or score shorter windows.")
            self._write_tables(writes)
            try:
                return self.runner.teacher_forced(context, targets)
            finally:
                self.blocks.release(scoring)
                self.runner.cache.tables.clear(0)

    def cancel(self, seq: Sequence) -> None:
        """Stop a sequence: it leaves the batch now (between steps) and its row is freed."""
        with self._lock, torch.inference_mode():   # rows move and block tables change: cache tensors
            self._drain()
            seq.finish("cancelled")
            self._retire()

    def _run(self, seqs: list[Sequence], metrics: RunMetrics) -> Iterator[tuple[Sequence, int | None, str]]:
        """Step until `seqs` finish, yielding (sequence, token or None, text delta) as they arrive."""
        t0 = time.perf_counter()
        t_first = None
        try:
            while True:
                pending = [s for s in seqs if not s.finished or s.outbox]
                if not pending:
                    break
                if not any(s.outbox for s in seqs):
                    self.step()   # advances every reader's sequences; each drains its own outbox
                if t_first is None and all(s.sampled for s in seqs):
                    t_first = time.perf_counter()
                    metrics.ttft_s = metrics.prefill_s = t_first - t0
                for seq in seqs:
                    while seq.outbox:
                        token, delta = seq.outbox.popleft()
                        yield seq, token, delta
        finally:
            for seq in seqs:   # a reader that stopped early (Ctrl-C, break) frees its rows
                if not seq.finished:
                    self.cancel(seq)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            if t_first is not None:
                metrics.decode_s = time.perf_counter() - t_first
            metrics.generated_tokens = max((s.sampled for s in seqs), default=0)
            metrics.peak_memory_bytes = (torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda"
                                         else _peak_rss_bytes())
            self.last_metrics = metrics

    def _start(self, prompts: list[Prompt], chat: bool, **kw) -> tuple[list[Sequence], RunMetrics]:
        params = _params(**kw)
        ids = [self.encode(p, chat) for p in prompts]
        seqs = [self.add_request(p, params) for p in ids]
        return seqs, RunMetrics(prompt_tokens=sum(len(p) for p in ids))

    # ---- generation ---------------------------------------------------------------------
    def generate(self, prompt: Prompt | list[Prompt], max_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None,
                 stop: str | list[str] | None = None, chat: bool = False, ignore_eos: bool = False):
        """str for a text prompt, list[int] for token ids; a list of prompts gives a list of results."""
        batch = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
        prompts = list(prompt) if batch else [prompt]
        seqs, metrics = self._start(prompts, chat, max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                    top_p=top_p, min_p=min_p, seed=seed, stop=stop, ignore_eos=ignore_eos)
        texts = {seq.id: "" for seq in seqs}
        with closing(self._run(seqs, metrics)) as events:
            for seq, _, delta in events:
                texts[seq.id] += delta
        results = [texts[s.id] if isinstance(p, str) else list(s.tokens) for s, p in zip(seqs, prompts)]
        return results if batch else results[0]

    def stream(self, prompt: Prompt, max_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None,
               stop: str | list[str] | None = None, chat: bool = False, ignore_eos: bool = False) -> Iterator[str]:
        """Incremental text of one prompt, piece by piece (never a broken character)."""
        if self.tokenizer is None:
            raise InputError("this checkpoint has no tokenizer files, so text cannot be streamed; use generate() with token ids.")
        seqs, metrics = self._start([prompt], chat, max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                    top_p=top_p, min_p=min_p, seed=seed, stop=stop, ignore_eos=ignore_eos)
        with closing(self._run(seqs, metrics)) as events:   # a reader that stops early frees its rows now
            for _, _, delta in events:
                if delta:
                    yield delta

    def stream_tokens(self, prompt: Prompt, **kw) -> Iterator[int]:
        """Token ids of one prompt as they are generated (works without a tokenizer)."""
        seqs, metrics = self._start([prompt], False, **kw)
        with closing(self._run(seqs, metrics)) as events:
            for _, token, _ in events:
                if token is not None:
                    yield token


def _params(**kw) -> SamplingParams:
    stop = kw.pop("stop", None)
    if isinstance(stop, str):
        stop = [stop]
    params = SamplingParams(stop=list(stop or []), **kw)
    params.validate()
    return params


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def prompt_lengths(tokens: int, per_prompt: int) -> list[int]:
    """Prompts of at most `per_prompt` tokens that hold `tokens` together (the fewest: all full but the last)."""
    return [per_prompt] * (tokens // per_prompt) + ([tokens % per_prompt] if tokens % per_prompt else [])


def load(model: str | EngineConfig, config: EngineConfig | None = None, **kwargs) -> Engine:
    """Load a checkpoint folder or hub id; the tokenizer comes along when the checkpoint has one.

    Keywords (or an EngineConfig, whose sections they fill): device, dtype, max_context,
    prefill_chunk (prompt tokens per forward and per step: longer prompts take several steps; "auto" sizes
    it for a bounded bank, `plan.auto_prefill_chunk`),
    max_batch; the KV cache's `kv_layout` (auto | paged | rows), `kv_block_size` and
    `kv_cache_memory` (a paged cache's bytes), `prefix_cache_memory` (> 0: reuse cached prefixes);
    `gpu_memory` (alias `memory`, which names no device) bounds
    everything the engine takes on the device, `capacity` fixes the bank slots per layer instead;
    experts beyond the bank stay in pinned host RAM (`host_memory` bounds it, `host_tier` chooses)
    or on disk; miss_policy, residency, prefetch, pinned.

    `profile` (a path or a Profile, from `moestream profile`) seeds the bank with the experts that
    its prompts used most; `pin_top_k` / `pin_threshold` also pin its top experts per layer.
    With a bounded bank and no profile, `discovery` (True: a built-in prompt; or your text or
    token ids) runs a router-only pass first so the bank starts with the experts it used.
    `prepack` names a folder for a snapshot of the warmed bank: loaded when it matches, else
    built, warmed with `warmup_tokens` generated tokens, and saved. `warmup_tokens` > 0 also
    compiles kernels and captures decode graphs before the first request.
    """
    from moestream.engine.build import build

    if isinstance(model, EngineConfig):
        config, model = model, model.model
    if config is None:
        config = EngineConfig.from_kwargs(model, **kwargs)
    elif kwargs:
        raise InputError("give either an EngineConfig or keyword options, not both.")
    return build(config)
