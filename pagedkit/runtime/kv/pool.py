"""One group's block pool: free list, reference counts and the prefix cache (host-side only).

Every block is in exactly one of three states:
  free       refcount 0, not cached            (in `free`)
  evictable  refcount 0, cached under a hash   (in `evictable`, least recently released first)
  in use     refcount >= 1                     (maybe cached too)
Allocation takes a free block, else evicts the least recently released cached block.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from typing import Iterable, Sequence

import numpy as np


class KVCacheExhausted(RuntimeError):
    """The pool of a group cannot supply the blocks a request needs."""


def block_hash(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Prefix-cache key of a full block: BLAKE2b over the parent block's key and the block's token ids."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


class BlockPool:
    def __init__(self, group: str, num_blocks: int):
        self.group = group
        self.num_blocks = num_blocks
        self.refcount = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.cached: dict[bytes, int] = {}  # hash -> block
        self.hash_of: dict[int, bytes] = {}  # block -> hash

    # ---- capacity ------------------------------------------------------------------------------
    @property
    def available(self) -> int:
        """Blocks an allocation can obtain now (free plus evictable cached)."""
        return len(self.free) + len(self.evictable)

    def require(self, needed: int, what: str) -> None:
        if needed > self.available:
            raise KVCacheExhausted(
                f"KV cache group {self.group!r} is exhausted: {what} needs {needed} blocks, {self.available} "
                f"are free ({len(self.free)} unused + {len(self.evictable)} evictable cached) of {self.num_blocks}; "
                "free finished sequences, shrink the batch, or allocate more num_blocks")

    # ---- reference counting ------------------------------------------------------------------
    def allocate(self) -> int:
        if self.free:
            b = self.free.popleft()
        elif self.evictable:
            b, _ = self.evictable.popitem(last=False)  # least recently released
            del self.cached[self.hash_of.pop(b)]
        else:
            self.require(1, "an allocation")
            raise AssertionError("unreachable")
        assert self.refcount[b] == 0, (self.group, b)
        self.refcount[b] = 1
        return b

    def incref(self, b: int) -> None:
        if self.refcount[b] == 0:
            if b not in self.evictable:
                raise AssertionError(f"group {self.group!r}: incref of block {b} that is neither used nor cached")
            del self.evictable[b]
        self.refcount[b] += 1

    def decref(self, b: int) -> None:
        if self.refcount[b] <= 0:
            raise AssertionError(f"group {self.group!r}: block {b} released more often than referenced")
        self.refcount[b] -= 1
        if self.refcount[b] == 0:
            if b in self.hash_of:
                self.evictable[b] = None  # most recently released goes last
            else:
                self.free.append(b)

    def release_all(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if b >= 0:
                self.decref(b)

    # ---- prefix cache ------------------------------------------------------------------------
    def lookup(self, h: bytes) -> int | None:
        return self.cached.get(h)

    def register(self, b: int, h: bytes) -> None:
        """Cache a full, in-use block under its hash (no-op when the hash already has a block)."""
        if h in self.cached or b in self.hash_of:
            return
        self.cached[h] = b
        self.hash_of[b] = h

    def clear_cache(self) -> None:
        """Forget every hash; evictable blocks become free, in-use blocks stay in use uncached."""
        for b in self.evictable:
            self.free.append(b)
        self.evictable.clear()
        self.cached.clear()
        self.hash_of.clear()

    # ---- introspection ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks not referenced by any sequence (unused + evictable cached)."""
        return self.available

    def check(self, expected_refs: dict[int, int]) -> list[str]:
        """Invariants against the references the sequences hold (block -> count)."""
        errs = []
        free, ev = set(self.free), set(self.evictable)
        if len(free) != len(self.free):
            errs.append(f"group {self.group!r}: a block is twice in the free list")
        for b in range(self.num_blocks):
            want = expected_refs.get(b, 0)
            if self.refcount[b] != want:
                errs.append(f"group {self.group!r}: block {b} refcount {self.refcount[b]}, sequences hold {want}")
            states = (b in free) + (b in ev) + (self.refcount[b] > 0)
            if states != 1:
                errs.append(f"group {self.group!r}: block {b} is in {states} states (free/evictable/used)")
            if (b in ev) and b not in self.hash_of:
                errs.append(f"group {self.group!r}: evictable block {b} has no hash")
        for h, b in self.cached.items():
            if self.hash_of.get(b) != h:
                errs.append(f"group {self.group!r}: hash map and block map disagree on block {b}")
        return errs
