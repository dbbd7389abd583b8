"""Block-level prefix-cache model of one engine's KV pool (pure Python, no I/O).

The pool holds ``num_blocks`` blocks of ``block_size`` tokens.  A block is in one
of three states:

* **private**: held by a running request and not (yet) in the prefix cache: the
  partial tail of a prompt, decode tokens, or prompt blocks whose prefill has not
  finished.  Only a count is kept (``private_blocks``).
* **cached, referenced**: a full block identified by a chained hash of
  ``(parent_hash, block_tokens)``, with a reference count > 0 (running requests
  that share the prefix, or an open session in session-radix mode).  Not
  evictable.
* **cached, evictable**: a full cached block with no reference.  Kept in an
  ``OrderedDict`` in LRU order (least recent first) and evicted from the front
  when an allocation needs room.

Free blocks are ``num_blocks - len(cached) - private``.  Nothing here walks the
whole cache: every operation costs O(blocks of the request it touches).

When a request releases its blocks they are appended to the LRU in *reverse*
order (last block first), so the leading blocks of a prefix are the most
recently used and a prefix is eaten from its tail, as SGLang's radix tree evicts
leaves first and vLLM frees blocks in reverse order.  A block whose parent was
evicted stays cached until LRU reaches it but is unreachable for prefix matches
(matching stops at the first miss), exactly as in a hash-based block pool.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, List, Sequence

#: Parent hash of the first block of every sequence.
ROOT_HASH = 0x6B76676174655F73  # "kvgate_s"


def block_hashes(tokens: Sequence[int], block_size: int, parent: int = ROOT_HASH,
                 start: int = 0) -> List[int]:
    """Chained hashes of the full blocks of ``tokens[start:]``.

    ``hash((parent, tuple(block)))`` on ints is deterministic across processes
    (no hash randomisation for ints and tuples), so two engines and two runs agree.
    """
    out: List[int] = []
    end = len(tokens) - (len(tokens) - start) % block_size
    h = parent
    for i in range(start, end, block_size):
        h = hash((h, tuple(tokens[i:i + block_size])))
        out.append(h)
    return out


class PrefixCache:
    """KV pool + prefix cache of one scheduler (one DP rank)."""

    __slots__ = ("block_size", "num_blocks", "_ref", "_lru", "private_blocks",
                 "evicted_blocks", "version")

    def __init__(self, capacity_tokens: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if capacity_tokens < block_size:
            raise ValueError(
                f"kv capacity ({capacity_tokens} tokens) is smaller than one block ({block_size})")
        self.block_size = block_size
        self.num_blocks = capacity_tokens // block_size
        self._ref: dict = {}                 # cached block hash -> reference count
        self._lru: OrderedDict = OrderedDict()  # evictable hashes, least recent first
        self.private_blocks = 0
        self.evicted_blocks = 0
        # bumped by every change to the cached set or the LRU membership, so callers
        # can reuse a match() / evictable_among() result while it is unchanged
        self.version = 0

    # ---- read-only views -------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def cached_blocks(self) -> int:
        return len(self._ref)

    @property
    def evictable_blocks(self) -> int:
        return len(self._lru)

    @property
    def free_blocks(self) -> int:
        return self.num_blocks - len(self._ref) - self.private_blocks

    @property
    def used_blocks(self) -> int:
        """Blocks that can not be handed out: referenced cached + private."""
        return len(self._ref) - len(self._lru) + self.private_blocks

    def is_cached(self, h: int) -> bool:
        return h in self._ref

    def refcount(self, h: int) -> int:
        return self._ref.get(h, 0)

    def match(self, hashes: Sequence[int]) -> int:
        """Number of leading ``hashes`` present in the cache.  No side effects."""
        ref = self._ref
        n = 0
        for h in hashes:
            if h not in ref:
                break
            n += 1
        return n

    def evictable_among(self, hashes: Iterable[int]) -> int:
        """How many of ``hashes`` sit in the evictable LRU (pinning them shrinks it)."""
        lru = self._lru
        return sum(1 for h in hashes if h in lru)

    def available_blocks(self) -> int:
        """Blocks an allocation could get: free + evictable."""
        return self.free_blocks + len(self._lru)

    # ---- references --------------------------------------------------------
    def acquire(self, hashes: Iterable[int]) -> None:
        """Take one reference on each (already cached) block."""
        self.version += 1
        ref, lru = self._ref, self._lru
        for h in hashes:
            c = ref[h]
            if c == 0:
                del lru[h]
            ref[h] = c + 1

    def release(self, hashes: Sequence[int]) -> None:
        """Drop one reference on each block; blocks reaching zero become evictable.

        Released in reverse so the tail of a prefix is evicted before its head.
        """
        self.version += 1
        ref, lru = self._ref, self._lru
        for h in reversed(hashes):
            c = ref.get(h)
            if c is None:  # evicted meanwhile cannot happen for referenced blocks
                continue
            c -= 1
            ref[h] = c
            if c == 0:
                lru[h] = None

    # ---- allocation ----------------------------------------------------------
    def _evict(self, n: int) -> None:
        self.version += 1
        lru, ref = self._lru, self._ref
        for _ in range(n):
            h, _ = lru.popitem(last=False)
            del ref[h]
        self.evicted_blocks += n

    def alloc_private(self, n: int) -> bool:
        """Allocate ``n`` private blocks, evicting LRU blocks if needed.

        Returns False (and changes nothing) when free + evictable < n.
        """
        if n <= 0:
            return True
        free = self.free_blocks
        if free < n:
            short = n - free
            if short > len(self._lru):
                return False
            self._evict(short)
        self.private_blocks += n
        return True

    def free_private(self, n: int) -> None:
        if n > self.private_blocks:
            raise AssertionError(f"freeing {n} private blocks, only {self.private_blocks} held")
        self.private_blocks -= n

    def commit(self, hashes: Sequence[int]) -> None:
        """Turn one private block per hash into a cached block referenced once.

        A hash already cached (another request computed the same block meanwhile)
        is shared instead and the duplicate private block is freed.
        """
        self.version += 1
        ref, lru = self._ref, self._lru
        for h in hashes:
            c = ref.get(h)
            if c is None:
                ref[h] = 1
            else:
                if c == 0:
                    del lru[h]
                ref[h] = c + 1
        self.private_blocks -= len(hashes)

    def check(self) -> None:
        """Internal consistency check (tests)."""
        assert self.private_blocks >= 0
        assert self.free_blocks >= 0, (self.free_blocks, len(self._ref), self.private_blocks)
        zero = {h for h, c in self._ref.items() if c == 0}
        assert zero == set(self._lru), "evictable set must be exactly the zero-ref blocks"
        assert all(c >= 0 for c in self._ref.values())
