"""Block-level prefix-cache model of one engine's KV pool (pure Python, no I/O).

The pool holds ``num_blocks`` blocks of ``block_size`` tokens.  A block is in one
of these states:

* **private**: held by a running request and not (yet) in the prefix cache: the
  partial tail of a prompt, decode tokens, or prompt blocks whose prefill has not
  finished.  Only a count is kept (``private_blocks``).
* **cached, locked**: a full block identified by a chained hash of
  ``(parent_hash, block_tokens)``, with a lock count > 0 (running requests that
  share the prefix, SGLang's ``lock_ref``).  Not evictable.
* **cached, evictable**: a full cached block with no lock.  Two LRU tiers, each an
  ``OrderedDict`` (least recent first): blocks no session pins, then blocks that
  an open session pins (session radix cache).  Eviction empties the first tier
  before it touches the second, as SGLang's ``priority`` eviction key
  ``(session_ref > 0, session_ref, priority, last_access)`` puts session-referenced
  nodes last without making them unevictable.  Both tiers count as evictable.

Session pins are kept apart from locks: ``set_session`` / ``drop_session`` pin and
unpin a session's blocks; a pinned block that gets evicted leaves its session's list.

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
from typing import Dict, Iterable, List, Optional, Sequence

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

    __slots__ = ("block_size", "num_blocks", "_ref", "_lru", "_lru2", "_pin", "sessions",
                 "private_blocks", "evicted_blocks", "version")

    def __init__(self, capacity_tokens: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if capacity_tokens < block_size:
            raise ValueError(
                f"kv capacity ({capacity_tokens} tokens) is smaller than one block ({block_size})")
        self.block_size = block_size
        self.num_blocks = capacity_tokens // block_size
        self._ref: dict = {}                 # cached block hash -> lock count (running requests)
        self._lru: OrderedDict = OrderedDict()   # unlocked, unpinned: evicted first
        self._lru2: OrderedDict = OrderedDict()  # unlocked, pinned by a session: evicted after
        self._pin: Dict[int, List[str]] = {}     # cached block hash -> sessions pinning it
        # session id -> its pinned hashes (insertion order: prefix first)
        self.sessions: Dict[str, Dict[int, None]] = {}
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
        """Unlocked cached blocks, session-pinned ones included (SGLang's evictable size)."""
        return len(self._lru) + len(self._lru2)

    @property
    def pinned_evictable_blocks(self) -> int:
        """The evictable blocks an open session pins (second eviction tier)."""
        return len(self._lru2)

    @property
    def free_blocks(self) -> int:
        return self.num_blocks - len(self._ref) - self.private_blocks

    @property
    def used_blocks(self) -> int:
        """Blocks that can not be handed out: locked cached + private.

        SGLang: ``num_used = max_total - (available + evictable)``."""
        return len(self._ref) - len(self._lru) - len(self._lru2) + self.private_blocks

    def is_cached(self, h: int) -> bool:
        return h in self._ref

    def refcount(self, h: int) -> int:
        """Locks (running requests) on a block."""
        return self._ref.get(h, 0)

    def pincount(self, h: int) -> int:
        """Sessions pinning a block."""
        return len(self._pin.get(h, ()))

    def match(self, hashes: Sequence[int], limit: Optional[int] = None) -> int:
        """Number of leading ``hashes`` (at most ``limit``) present in the cache.  No side effects."""
        ref = self._ref
        n = 0
        for h in hashes if limit is None else hashes[:limit]:
            if h not in ref:
                break
            n += 1
        return n

    def evictable_among(self, hashes: Iterable[int]) -> int:
        """How many of ``hashes`` are evictable (locking them shrinks what can be evicted)."""
        lru, lru2 = self._lru, self._lru2
        return sum(1 for h in hashes if h in lru or h in lru2)

    def available_blocks(self) -> int:
        """Blocks an allocation could get: free + evictable (both tiers)."""
        return self.free_blocks + len(self._lru) + len(self._lru2)

    # ---- locks (running requests) ---------------------------------------------
    def acquire(self, hashes: Iterable[int]) -> None:
        """Take one lock on each (already cached) block."""
        self.version += 1
        ref, lru, lru2 = self._ref, self._lru, self._lru2
        for h in hashes:
            c = ref[h]
            if c == 0:
                if h in lru:
                    del lru[h]
                else:
                    del lru2[h]
            ref[h] = c + 1

    def _to_lru(self, h: int) -> None:
        if h in self._pin:
            self._lru2[h] = None
        else:
            self._lru[h] = None

    def release(self, hashes: Sequence[int]) -> None:
        """Drop one lock on each block; blocks reaching zero become evictable.

        Released in reverse so the tail of a prefix is evicted before its head.
        """
        self.version += 1
        ref = self._ref
        for h in reversed(hashes):
            c = ref.get(h)
            if c is None:  # evicted meanwhile cannot happen for locked blocks
                continue
            c -= 1
            ref[h] = c
            if c == 0:
                self._to_lru(h)

    # ---- session pins (session radix cache) ------------------------------------
    def set_session(self, session_id: str, hashes: Sequence[int]) -> None:
        """Make ``hashes`` (cached blocks) the pins of ``session_id``, replacing its old ones.

        A pin changes only the eviction tier of an unlocked block, never its lock count."""
        self.version += 1
        ref, lru, lru2, pin = self._ref, self._lru, self._lru2, self._pin
        old = self.sessions.get(session_id) or {}
        new: Dict[int, None] = {}
        for h in reversed(hashes):           # tail first: the tail is the older end of lru2
            if h in new or h not in ref:
                continue
            new[h] = None
            if h in old:
                continue
            owners = pin.get(h)
            if owners is None:
                pin[h] = [session_id]
                if ref[h] == 0:
                    del lru[h]
                    lru2[h] = None
            else:
                owners.append(session_id)
        for h in reversed(list(old)):
            if h not in new:
                self._unpin(session_id, h)
        if new:
            self.sessions[session_id] = dict.fromkeys(reversed(list(new)))
        else:
            self.sessions.pop(session_id, None)

    def drop_session(self, session_id: str) -> bool:
        """Unpin every block of ``session_id``: they return to the first LRU tier.
        False when the session pins nothing (never pinned, closed, or all of it evicted)."""
        pins = self.sessions.pop(session_id, None)
        if not pins:
            return False
        self.version += 1
        for h in reversed(list(pins)):
            self._unpin(session_id, h)
        return True

    def _unpin(self, session_id: str, h: int) -> None:
        owners = self._pin.get(h)
        if owners is None:
            return
        owners.remove(session_id)
        if not owners:
            del self._pin[h]
            if self._ref.get(h) == 0:
                del self._lru2[h]
                self._lru[h] = None

    # ---- allocation ----------------------------------------------------------
    def _evict(self, n: int) -> None:
        self.version += 1
        lru, lru2, ref, pin, sessions = self._lru, self._lru2, self._ref, self._pin, self.sessions
        for _ in range(n):
            if lru:
                h, _ = lru.popitem(last=False)
            else:
                h, _ = lru2.popitem(last=False)
                for sid in pin.pop(h):       # the evicted block leaves its sessions' lists
                    pins = sessions[sid]
                    del pins[h]
                    if not pins:
                        del sessions[sid]
            del ref[h]
        self.evicted_blocks += n

    def alloc_private(self, n: int) -> bool:
        """Allocate ``n`` private blocks, evicting LRU blocks if needed (unpinned first).

        Returns False (and changes nothing) when free + evictable < n.
        """
        if n <= 0:
            return True
        free = self.free_blocks
        if free < n:
            short = n - free
            if short > len(self._lru) + len(self._lru2):
                return False
            self._evict(short)
        self.private_blocks += n
        return True

    def free_private(self, n: int) -> None:
        if n > self.private_blocks:
            raise AssertionError(f"freeing {n} private blocks, only {self.private_blocks} held")
        self.private_blocks -= n

    def commit(self, hashes: Sequence[int]) -> None:
        """Turn one private block per hash into a cached block locked once.

        A hash already cached (another request computed the same block meanwhile)
        is shared instead and the duplicate private block is freed.
        """
        self.version += 1
        ref, lru, lru2 = self._ref, self._lru, self._lru2
        for h in hashes:
            c = ref.get(h)
            if c is None:
                ref[h] = 1
            else:
                if c == 0:
                    if h in lru:
                        del lru[h]
                    else:
                        del lru2[h]
                ref[h] = c + 1
        self.private_blocks -= len(hashes)

    def check(self) -> None:
        """Internal consistency check (tests)."""
        assert self.private_blocks >= 0
        assert self.free_blocks >= 0, (self.free_blocks, len(self._ref), self.private_blocks)
        zero = {h for h, c in self._ref.items() if c == 0}
        assert not (set(self._lru) & set(self._lru2))
        assert zero == set(self._lru) | set(self._lru2), \
            "evictable set must be exactly the unlocked blocks"
        assert all(h in self._pin for h in self._lru2), "second tier holds pinned blocks only"
        assert not any(h in self._pin for h in self._lru), "first tier holds unpinned blocks only"
        assert all(c >= 0 for c in self._ref.values())
        assert set(self._pin) <= set(self._ref), "only cached blocks are pinned"
        owners: dict = {}
        for sid, pins in self.sessions.items():
            assert pins, f"session {sid!r} listed with no pins"
            for h in pins:
                owners.setdefault(h, []).append(sid)
        assert {h: sorted(v) for h, v in owners.items()} == \
            {h: sorted(v) for h, v in self._pin.items()}, "pins and session lists disagree"
