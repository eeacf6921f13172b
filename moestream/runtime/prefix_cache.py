"""The prefix cache: the KV of finished sequences, reused by later prompts that begin the same way.

Coding agents resend the whole conversation on every turn, so each turn's prompt starts with the
previous turn's prompt and reply. When a sequence leaves the batch, the positions its cache row
holds (the prompt and every generated token fed back) are snapshotted into a compact entry of
exactly that length; a newly admitted prompt takes the entry that shares its longest prefix,
has those positions restored into its row and prefills only the rest. Entries live on the
device, are evicted least-recently-used within a byte budget, and an entry that is a prefix of a
newer one is dropped (the newer one serves every prompt the old one did).

Restoring copies the prefix into the sequence's row (a device memcpy, far cheaper than the
prefill it replaces) rather than sharing blocks through block tables as a paged cache does; the
cost is that a prefix shared by sequences running at the same time is held once per row.
The scheduler looks entries up when it plans a step; the engine stores and restores them (device
copies). Used under the engine's lock only.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from moestream.model.cache import ModelCache


@dataclass(eq=False)
class PrefixEntry:
    tokens: torch.Tensor                    # (n,) long on the host: the ids of the cached positions
    state: list                             # one snapshot per layer (ModelCache.snapshot)
    nbytes: int
    can_cut: bool = True                    # a shorter prefix of it is usable too (ModelCache.can_cut)

    def __len__(self) -> int:
        return self.tokens.numel()


@dataclass
class PrefixCacheStats:
    lookups: int = 0
    hits: int = 0
    prompt_tokens: int = 0                  # tokens of every prompt looked up
    reused_tokens: int = 0                  # of those, positions restored instead of prefilled
    stored: int = 0
    evicted: int = 0

    def as_dict(self) -> dict[str, float]:
        return {"lookups": self.lookups, "hits": self.hits, "prompt_tokens": self.prompt_tokens,
                "reused_tokens": self.reused_tokens, "stored": self.stored, "evicted": self.evicted,
                "hit_rate": self.hits / self.lookups if self.lookups else 0.0,
                "token_reuse": self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0}


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(a.numel(), b.numel())
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if differ.numel() else n


@dataclass
class PrefixCache:
    budget_bytes: int
    entries: OrderedDict[int, PrefixEntry] = field(default_factory=OrderedDict)   # oldest use first
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    _next: int = 0

    @property
    def used_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    @property
    def cached_tokens(self) -> int:
        return sum(len(e) for e in self.entries.values())

    def reuse(self, prompt: list[int], cache: ModelCache, row: int) -> int:
        """Restore the longest cached prefix of `prompt` into `row`; returns how many positions it
        filled. At most len(prompt) - 1: the last prompt token always runs, for its logits."""
        key, length = self.lookup(prompt)
        if key is not None:
            self.restore(key, length, cache, row)
        return length

    def lookup(self, prompt: list[int]) -> tuple[int | None, int]:
        """The entry sharing the longest prefix with `prompt` and how many positions of it serve
        (at most len(prompt) - 1: the last prompt token always runs, for its logits); (None, 0) when
        none does. Host work only (the scheduler's); `restore` copies the positions into a row."""
        self.stats.lookups += 1
        self.stats.prompt_tokens += len(prompt)
        if not self.entries or len(prompt) < 2:
            return None, 0
        ids = torch.tensor(prompt, dtype=torch.long)
        best_key, best = None, 0
        for key, entry in self.entries.items():
            n = min(_common_prefix(entry.tokens, ids), len(prompt) - 1)
            if not entry.can_cut and n != len(entry):
                n = 0
            if n > best:
                best_key, best = key, n
        if best_key is None:
            return None, 0
        self.entries.move_to_end(best_key)
        self.stats.hits += 1
        self.stats.reused_tokens += best
        return best_key, best

    def restore(self, key: int, length: int, cache: ModelCache, row: int) -> None:
        """Copy the first `length` positions of entry `key` (from `lookup`) into `row`."""
        cache.restore(row, self.entries[key].state, length)

    def store(self, tokens: list[int], cache: ModelCache, row: int) -> None:
        """Keep what `row` holds for `tokens` (its first len(tokens) positions)."""
        if len(tokens) < 2:
            return
        ids = torch.tensor(tokens, dtype=torch.long)
        for key, entry in list(self.entries.items()):
            common = _common_prefix(entry.tokens, ids)
            if common == len(ids):                    # already covered by a longer (or equal) entry
                self.entries.move_to_end(key)
                return
            if common == len(entry) and cache.can_cut:   # the new one covers this one
                del self.entries[key]
        state = cache.snapshot(row, len(tokens))
        nbytes = sum(t.numel() * t.element_size() for part in state for t in part)
        if nbytes > self.budget_bytes:
            return
        while self.entries and self.used_bytes + nbytes > self.budget_bytes:
            self.entries.popitem(last=False)
            self.stats.evicted += 1
        self.entries[self._next] = PrefixEntry(ids, state, nbytes, cache.can_cut)
        self._next += 1
        self.stats.stored += 1

    def clear(self) -> None:
        self.entries.clear()

    def as_dict(self) -> dict[str, float]:
        return {**self.stats.as_dict(), "entries": len(self.entries), "cached_tokens": self.cached_tokens,
                "used_bytes": self.used_bytes, "budget_bytes": self.budget_bytes}
