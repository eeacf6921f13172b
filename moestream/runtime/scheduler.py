"""The scheduler: the step's policy. Which sequences run, in which cache rows, and what each step does.

Sequences wait in arrival order and are admitted between steps while fewer than `max_batch` run.
Running sequences always occupy cache rows 0..B-1 in order, so a decode step is one batch of the
first B rows and the CUDA graphs captured for batch size B serve whichever sequences run; when a
sequence finishes, the ones after it move up and `retire` says which rows to copy where. Admitted
sequences whose prompts are still being prefilled sit after the decoding ones and finish their
prefill in admission order, so the decoding sequences stay a prefix of the rows.

Each step, `schedule` plans the work and the engine executes the plan (`StepPlan`): the newly
admitted sequences, the cached prefixes they reuse, the prompt chunks to prefill, the sequences
that decode one token, the blocks a paged cache hands out for all of that (written into the
model's block tables by the engine) and the sequences preempted when those blocks ran out. The
planner touches no tensor: it is bookkeeping on the host (the `BlockManager`'s blocks, the rows
prefix cache's lookup), so the policy can be tested without a model.

Prompts go in by chunks of at most `prefill_chunk` tokens, and a step prefills at most one chunk's
worth of prompt tokens, whether or not others decode: a long prompt takes several steps, the
running streams keep their token per step, and between chunks the caller sees cancellations and
reads the queue. Where the step's chunks run as one forward (`schedule(fill=True)`: the engine packs
prompts), the next prompt is cut to fill what is left of the step's budget: each forward streams the
experts a bounded bank lacks once, so full steps mean fewer passes over them (sixteen 3,000-token
prompts in 4,096-token steps: 12 forwards, not 16). Where each chunk is a forward of its own, a chunk
is never cut to fill a step (the rest waits for the next step, whole), so a prompt that fits one
chunk is always one forward.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from moestream.runtime.blocks import BlockManager
from moestream.runtime.prefix_cache import PrefixCache
from moestream.runtime.sequence import Sequence, Status


@dataclass(frozen=True)
class TableWrite:
    """Blocks to write into entries start.. of a row of the model's block tables (a paged cache);
    `blocks` None clears the row (its sequence was preempted)."""

    row: int
    blocks: tuple[int, ...] | None
    start: int = 0


@dataclass(frozen=True)
class Restore:
    """Rows layout: the first `length` positions of prefix-cache entry `key` go into `seq`'s row
    before its first chunk is prefilled."""

    seq: Sequence
    key: int
    length: int


@dataclass(frozen=True)
class PrefillChunk:
    """Positions start..end-1 of `seq`'s prefill (`Sequence.prefill_ids`) go into its row; the ones
    before are in the cache already (a reused prefix, earlier chunks)."""

    seq: Sequence
    start: int
    end: int

    @property
    def tokens(self) -> int:
        return self.end - self.start

    @property
    def last(self) -> bool:
        """Whether the prefill is complete after this chunk (then the sequence samples, or, resuming
        after preemption, decodes on)."""
        return self.end >= self.seq.prefill_len


@dataclass
class StepPlan:
    """One step's work, in the order the engine runs it: the cache grows to `rows` rows when
    sequences were admitted; the block-table writes (in order: a preempted row is cleared); the
    prefix restores; the prompt chunks (their last chunks' logits sampled together); then one
    decode step of `decodes`, cache rows 0..len(decodes)-1."""

    admitted: list[Sequence] = field(default_factory=list)
    rows: int = 0                                               # running sequences once admitted
    preempted: list[Sequence] = field(default_factory=list)
    tables: list[TableWrite] = field(default_factory=list)
    restores: list[Restore] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)

    @property
    def prefill_tokens(self) -> int:
        return sum(c.tokens for c in self.prefills)


class Scheduler:
    def __init__(self, max_batch: int = 64, prefill_chunk: int = 512, blocks: BlockManager | None = None,
                 prefix_cache: PrefixCache | None = None):
        """`prefill_chunk`: prompt tokens per chunk and per step. `blocks`: a paged cache's block
        manager (admission waits for blocks, decode steps reserve them, preemption frees them);
        `prefix_cache`: the rows layout's cache of finished sequences, looked up at admission."""
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be at least 1, got {prefill_chunk}")
        self.max_batch, self.prefill_chunk = max_batch, prefill_chunk
        self.blocks, self.prefix_cache = blocks, prefix_cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    # ---- the plan of a step ----------------------------------------------------------------
    def schedule(self, fill: bool = False, ride: bool = False) -> StepPlan:
        """Plan one step: admit, reserve the decode tokens' blocks (preempting the newest sequences
        when the pool is dry), then take prompt chunks, oldest prompt first, within one chunk's budget
        (`fill`: the last one cut to what the budget has left, for a step whose chunks are one forward;
        `ride`: the decode tokens join that forward, so they count against the budget, which keeps at
        least one prompt token). The sequences decoding are those that were decoding before this step's
        admissions."""
        plan = StepPlan()
        decoding = [s for s in self.running if not s.prefilling]   # rows 0..B-1
        plan.admitted = self.admit(self._fits if self.blocks is not None else None)
        plan.rows = len(self.running)
        if self.blocks is not None:
            decoding = self._reserve_decode(decoding, plan)
        budget = max(self.prefill_chunk - len(decoding), 1) if ride else self.prefill_chunk
        for seq in [s for s in self.running if s.prefilling]:
            if budget <= 0:
                break
            if seq.prefilled == 0:
                seq.prefilled = self._reuse_prefix(seq, plan)
            start, total = seq.prefilled, seq.prefill_len
            end = min(total, start + (budget if fill else self.prefill_chunk))
            if end - start > budget:
                break   # a whole chunk next step rather than a cut one now: one forward per chunk
            if self.blocks is not None and not self._grow(seq, end, plan.tables):
                break   # no blocks left for it this step: it waits while others finish
            plan.prefills.append(PrefillChunk(seq, start, end))
            budget -= end - start
            if end < total:
                break   # keeps prefills finishing in row order
        plan.decodes = decoding
        return plan

    def admit(self, fits: Callable[[Sequence], bool] | None = None) -> list[Sequence]:
        """Move waiting sequences into free rows (in arrival order, stopping at the first that `fits`
        refuses: a paged cache without the blocks for its prompt); returns the newly admitted ones."""
        admitted = []
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            if not seq.finished and fits is not None and not fits(seq):
                break
            self.waiting.popleft()
            if seq.finished:   # cancelled while waiting
                continue
            seq.status, seq.row = Status.RUNNING, len(self.running)
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def unadmit(self, seqs: list[Sequence]) -> None:
        """Put sequences admitted this step back at the head of the queue, as they were: the cache
        could not grow to hold their rows (they are the last rows, so no other sequence moves)."""
        for seq in reversed(seqs):
            self.running.remove(seq)
            if self.blocks is not None:
                self.blocks.release(seq)
            seq.status, seq.row, seq.prefilled = Status.WAITING, None, 0
            self.waiting.appendleft(seq)

    def decodes_again(self, seqs: list[Sequence]) -> bool:
        """Whether the next step will decode exactly `seqs` again, whatever tokens they sample now:
        nobody prefills or waits for a free row, and each has room for one more token after this
        one (so a step launched ahead of reading this one's tokens is never wasted on a length limit)."""
        if self.running != seqs:
            return False
        if self.waiting and len(self.running) < self.max_batch:
            return False
        return all(not s.finished and not s.prefilling and s.sampled + 2 <= s.token_budget() for s in seqs)

    def reserve_ahead(self, seqs: list[Sequence]) -> list[TableWrite] | None:
        """A paged cache's blocks for the positions a step launched ahead writes (one past each
        sequence's length), all or none: None, taking nothing, when the pool is short (a planned step
        then reserves, preempting if it must)."""
        if self.blocks is None:
            return []
        need = sum(max(self.blocks.blocks_for(s.length + 1) - len(s.blocks), 0) for s in seqs)
        if need > self.blocks.available:
            return None
        writes: list[TableWrite] = []
        for seq in seqs:
            self._grow(seq, seq.length + 1, writes)
        return writes

    def reserve(self, seq: Sequence, tokens: int) -> list[TableWrite] | None:
        """Blocks for a sequence's first `tokens` positions outside any step (teacher-forced scoring
        in row 0 of an idle engine); None when the pool cannot hold them."""
        writes: list[TableWrite] = []
        return writes if self._grow(seq, tokens, writes) else None

    # ---- paged KV blocks -------------------------------------------------------------------
    def _fits(self, seq: Sequence) -> bool:
        """Admit a sequence only while the blocks of its whole prompt, and one more for each running
        sequence's next token, are available (blocks shared through the prefix cache count as new)."""
        blocks = self.blocks
        return blocks.blocks_for(seq.prefill_len + 1) + len(self.running) <= blocks.available

    def _grow(self, seq: Sequence, tokens: int, writes: list[TableWrite]) -> bool:
        """Blocks for the sequence's first `tokens` positions; the new ones go to its table row."""
        added = self.blocks.ensure(seq, tokens)
        if added is None:
            return False
        if added:
            writes.append(TableWrite(seq.row, tuple(added), len(seq.blocks) - len(added)))
        return True

    def _reserve_decode(self, decoding: list[Sequence], plan: StepPlan) -> list[Sequence]:
        """Blocks for this step's decode tokens, oldest sequence first; when the pool runs dry, the
        newest running sequences give theirs back and wait to be computed again (their keyed blocks
        stay cached, so that is mostly a prefix-cache hit). The oldest always fits: the pool holds a
        whole context."""
        decoding = list(decoding)
        i = 0
        while i < len(decoding):
            if self._grow(decoding[i], decoding[i].length, plan.tables):
                i += 1
                continue
            row = self.running[-1].row
            victim = self.preempt()
            plan.tables.append(TableWrite(row, None))
            plan.preempted.append(victim)
            if victim in decoding:
                decoding.remove(victim)
        return decoding

    def preempt(self) -> Sequence:
        """Send the newest running sequence back to the head of the queue (its cache blocks are
        needed by older ones); it holds the last row, so no other row moves. Its blocks go back to
        the pool (the keyed ones stay cached) and it will be prefilled again: its prompt, or having
        sampled, its whole context (`Sequence.resuming`)."""
        seq = self.running.pop()
        if self.blocks is not None:
            self.blocks.release(seq)
        seq.prefilled, seq.resuming = 0, seq.sampled > 0
        seq.status, seq.row = Status.WAITING, None
        self.waiting.appendleft(seq)
        return seq

    def _reuse_prefix(self, seq: Sequence, plan: StepPlan) -> int:
        """Positions of the sequence's prefill found in a cache: a paged cache's keyed blocks (shared
        at once), or the rows layout's longest entry (restored by the engine before the chunks)."""
        if self.blocks is not None:
            shared = self.blocks.match(seq, seq.prefill_ids())
            if shared:
                plan.tables.append(TableWrite(seq.row, tuple(shared)))
            reused = len(shared) * self.blocks.block_size
            if not seq.resuming:
                seq.cached_tokens = reused
            return reused
        if self.prefix_cache is not None:
            key, seq.cached_tokens = self.prefix_cache.lookup(seq.prompt)
            if key is not None:
                plan.restores.append(Restore(seq, key, seq.cached_tokens))
        return seq.cached_tokens

    # ---- after a step ----------------------------------------------------------------------
    def seal(self) -> None:
        """Key the blocks the running sequences have filled, so later prompts can share them."""
        if self.blocks is not None:
            for seq in self.running:
                self.blocks.seal(seq)

    def retire(self) -> list[tuple[int, int, int]]:
        """Drop finished sequences (a paged cache's blocks go back, the full ones keyed and cached)
        and move the others up; returns the row moves (src, dst, length) to apply to the cache, in an
        order that never overwrites a row before it has moved."""
        moves = []
        survivors = [s for s in self.running if not s.finished]
        for s in self.running:
            if s.finished:
                if self.blocks is not None:
                    self.blocks.seal(s)
                    self.blocks.release(s)
                s.row = None
        for new_row, seq in enumerate(survivors):
            if seq.row != new_row:
                moves.append((seq.row, new_row, seq.cached_len))
                seq.row = new_row
        self.running = survivors
        return moves
