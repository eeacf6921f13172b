"""The block manager: which KV blocks each sequence holds, and the prefix cache built on them.

A paged cache (`model/cache.py: PagedKVCache`) keeps keys and values in fixed-size blocks of one
pool; a sequence holds just the blocks its length needs (`ensure`), listed in `Sequence.blocks` in
position order. Once a block is full, its content depends only on the tokens up to its end, so it
gets a key chaining its tokens to its predecessor's key (`seal`), and a later prompt whose blocks
have the same keys points its block table at them instead of computing them again (`match`):
a conversation's next turn, a shared system prompt, or a preempted sequence coming back. Blocks
are shared by reference count; a block whose last user leaves stays in the cache, evictable in
least-recently-used order, until its room is needed for a new block. So the prefix cache costs
no memory of its own: it is whatever the running sequences do not use.

Pure bookkeeping on the host: the scheduler hands blocks out as it plans each step, and the
engine writes the block ids of the plan into the model's `BlockTables`. Block 0 is never handed
out (it is the null block padding rows write to). Used under the engine's lock only.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

from moestream.runtime.prefix_cache import PrefixCacheStats
from moestream.runtime.sequence import Sequence


def block_key(parent: bytes, tokens: list[int]) -> bytes:
    """The key of a full block: a 128-bit digest of its predecessor's key and its own token ids."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True, block_bytes: int = 0):
        """`block_bytes`: device bytes of one block across every layer (for reporting only)."""
        if num_blocks < 2:
            raise ValueError("a paged cache needs at least two blocks (block 0 is the null block)")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.block_bytes = block_bytes
        self.refs = [0] * num_blocks
        self.free: deque[int] = deque(range(1, num_blocks))
        self.cached: OrderedDict[int, None] = OrderedDict()   # unused but keyed blocks, oldest use first
        self.block_of: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.stats = PrefixCacheStats()

    # ---- sizes ---------------------------------------------------------------------------
    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @property
    def capacity(self) -> int:
        """Blocks sequences can hold (all but the null block)."""
        return self.num_blocks - 1

    @property
    def available(self) -> int:
        """Blocks a new allocation can take: free ones and cached ones nobody uses."""
        return len(self.free) + len(self.cached)

    @property
    def used(self) -> int:
        """Blocks held by sequences."""
        return self.capacity - self.available

    # ---- a sequence's blocks ---------------------------------------------------------------
    def match(self, seq: Sequence, ids: list[int]) -> list[int]:
        """Give a sequence that holds no blocks yet the cached blocks of the longest prefix of `ids`,
        leaving at least the last id to compute (its logits are needed); returns those blocks
        (`len(blocks) * block_size` positions are then in the cache)."""
        self.stats.lookups += 1
        self.stats.prompt_tokens += len(ids)
        if not self.prefix_caching:
            return []
        key = b""
        for i in range((len(ids) - 1) // self.block_size):
            key = block_key(key, ids[i * self.block_size:(i + 1) * self.block_size])
            block = self.block_of.get(key)
            if block is None:
                break
            self._take(block)
            seq.blocks.append(block)
            seq.sealed, seq.block_key = len(seq.blocks), key
        if seq.blocks:
            self.stats.hits += 1
            self.stats.reused_tokens += len(seq.blocks) * self.block_size
        return list(seq.blocks)

    def ensure(self, seq: Sequence, tokens: int) -> list[int] | None:
        """Blocks for the sequence's first `tokens` positions: returns the blocks added (appended to
        `seq.blocks`), or None, taking nothing, when too few are available."""
        need = self.blocks_for(tokens) - len(seq.blocks)
        if need <= 0:
            return []
        if need > self.available:
            return None
        added = [self._allocate() for _ in range(need)]
        seq.blocks.extend(added)
        return added

    def seal(self, seq: Sequence) -> None:
        """Key the sequence's blocks that the positions it holds (`cached_len`) now fill, so later
        prompts can share them."""
        if not self.prefix_caching:
            return
        full = min(seq.cached_len // self.block_size, len(seq.blocks))
        for i in range(seq.sealed, full):
            key = block_key(seq.block_key, seq.id_range(i * self.block_size, (i + 1) * self.block_size))
            block = seq.blocks[i]
            if key not in self.block_of and block not in self.key_of:   # else the same content is cached already
                self.block_of[key], self.key_of[block] = block, key
                self.stats.stored += 1
            seq.sealed, seq.block_key = i + 1, key

    def release(self, seq: Sequence) -> None:
        """The sequence leaves (finished, cancelled or preempted): its keyed blocks stay cached, the
        rest are free."""
        for block in reversed(seq.blocks):   # the tail first: evicted before the prefix it extends
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self.key_of:
                    self.cached[block] = None
                else:
                    self.free.append(block)
        seq.blocks, seq.sealed, seq.block_key = [], 0, b""

    def clear(self) -> None:
        """Forget every cached prefix (blocks held by sequences stay theirs)."""
        for block in self.cached:
            self.free.append(block)
        self.cached.clear()
        self.block_of = {key: block for key, block in self.block_of.items() if self.refs[block] > 0}
        self.key_of = {block: key for key, block in self.block_of.items()}

    # ---- one block -------------------------------------------------------------------------
    def _take(self, block: int) -> None:
        if self.refs[block] == 0:
            del self.cached[block]
        self.refs[block] += 1

    def _allocate(self) -> int:
        if self.free:
            block = self.free.popleft()
        else:   # evict the least recently used cached block
            block, _ = self.cached.popitem(last=False)
            del self.block_of[self.key_of.pop(block)]
            self.stats.evicted += 1
        self.refs[block] = 1
        return block

    def as_dict(self) -> dict[str, float]:
        """Prefix-cache figures in `PrefixCache.as_dict`'s shape, plus the pool's blocks."""
        cached_tokens = len(self.key_of) * self.block_size
        return {**self.stats.as_dict(), "entries": len(self.cached), "cached_tokens": cached_tokens,
                "used_bytes": len(self.cached) * self.block_bytes, "budget_bytes": self.capacity * self.block_bytes, "blocks": self.capacity, "blocks_used": self.used,
                "blocks_cached": len(self.cached), "block_size": self.block_size}
