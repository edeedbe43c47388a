"""One group's per-sequence block mapping: full-attention tables and windowed rings (host-side only).

Full-attention group: `table[i]` is the block holding positions [i*BS, (i+1)*BS) of the sequence; the
sequence holds one reference on each mapped block (shared blocks come from fork and prefix hits).

Windowed group (design §9.3.2, policy 1, the ring): the sequence holds N = ring_blocks blocks
`ring[0..N-1]`; logical block i lives in ring[i % N] (`ring_idx[r]` = the logical block slot r holds
now). `table` stays indexed by absolute position: live entries point into the ring, entries below the
live range are -1 (evicted), entries beyond the extent are -1. The sequence holds one reference on each
ring block; the table holds none.

A write into block i is one action:
  keep     the block is mapped and private: write in place
  new      unmapped (or an empty ring slot): allocate
  cow      mapped but shared: allocate, copy the block (every layer, scale caches too), drop the shared one
  recycle  (ring) the slot holds a dead block (below the window) that is private: overwrite in place
  fresh    (ring) the slot holds a dead block that is shared: allocate, no copy, drop the shared one
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .config import GroupConfig
from .pool import BlockPool

ALLOCATING = ("new", "cow", "fresh")


@dataclass
class GroupState:
    table: list[int] = field(default_factory=list)  # logical block -> block id, -1 = unmapped / evicted
    ring: list[int] | None = None  # windowed: ring slot -> block id (-1 = not yet allocated)
    ring_idx: list[int] | None = None  # windowed: logical block each ring slot holds (-1 = none)

    def held(self) -> list[int]:
        """Blocks this sequence holds a reference on."""
        return [b for b in (self.ring if self.ring is not None else self.table) if b >= 0]


class GroupBlocks:
    def __init__(self, group: GroupConfig, pool: BlockPool, copy_block: Callable[[int, int], None]):
        self.g = group
        self.pool = pool
        self.copy_block = copy_block  # (src, dst): copy a block in every cache tensor of the group

    def new_state(self) -> GroupState:
        if self.g.windowed:
            n = self.g.ring_blocks
            return GroupState(ring=[-1] * n, ring_idx=[-1] * n)
        return GroupState()

    def fork(self, st: GroupState) -> GroupState:
        """A child state sharing every block of `st` (one more reference each)."""
        c = GroupState(table=list(st.table),
                       ring=None if st.ring is None else list(st.ring),
                       ring_idx=None if st.ring_idx is None else list(st.ring_idx))
        for b in c.held():
            self.pool.incref(b)
        return c

    def release(self, st: GroupState) -> None:
        self.pool.release_all(reversed(st.held()))  # tail first: evicted before its prefix

    def live_start(self, length: int) -> int:
        """First logical block a query at position >= length can still see (0 for full attention)."""
        if not self.g.windowed:
            return 0
        return max(0, length - self.g.window + 1) // self.g.block_size

    def max_step(self, length: int) -> int:
        """Most tokens a step at past length `length` may write without overrunning the ring."""
        if not self.g.windowed:
            return 1 << 62
        return (self.live_start(length) + self.g.ring_blocks) * self.g.block_size - length

    def actions(self, st: GroupState, length: int, n: int, who: str) -> list[tuple[int, str]]:
        """(logical block, action) for writing positions [length, length + n); raises if a ring overruns."""
        g, bs, pool = self.g, self.g.block_size, self.pool
        first, last = length // bs, (length + n - 1) // bs
        acts = []
        if not g.windowed:
            for i in range(first, last + 1):
                b = st.table[i] if i < len(st.table) else -1
                acts.append((i, "new" if b < 0 else ("cow" if pool.refcount[b] > 1 else "keep")))
            return acts
        start = self.live_start(length)
        if last - start + 1 > g.ring_blocks:
            raise ValueError(
                f"group {g.name!r}: {who}: a step of {n} tokens at position {length} spans blocks {start}..{last}, "
                f"more than its ring of {g.ring_blocks} blocks (window {g.window}, chunk_tokens {g.chunk_tokens}); "
                f"split it into steps of at most {self.max_step(length)} tokens or raise chunk_tokens")
        for i in range(first, last + 1):
            r = i % g.ring_blocks
            b = st.ring[r]
            if b >= 0 and st.ring_idx[r] == i:
                acts.append((i, "cow" if pool.refcount[b] > 1 else "keep"))
            elif b < 0:
                acts.append((i, "new"))
            else:  # the slot holds a block below the window: dead content
                acts.append((i, "fresh" if pool.refcount[b] > 1 else "recycle"))
        return acts

    def apply(self, st: GroupState, acts: list[tuple[int, str]], length: int, n: int) -> list[int]:
        """Carry out `actions`; returns the flat slots [n] of positions [length, length + n)."""
        pool, bs = self.pool, self.g.block_size
        for i, a in acts:
            while len(st.table) <= i:
                st.table.append(-1)
            if st.ring is None:
                old = st.table[i]
                if a != "keep":
                    st.table[i] = pool.allocate()
                    if a == "cow":
                        self.copy_block(old, st.table[i])
                        pool.decref(old)
                continue
            r = i % len(st.ring)
            old = st.ring[r]
            if a in ALLOCATING:
                st.ring[r] = pool.allocate()
                if a == "cow":
                    self.copy_block(old, st.ring[r])
                if old >= 0:
                    pool.decref(old)
            dead = st.ring_idx[r]
            if dead != i and 0 <= dead < len(st.table):
                st.table[dead] = -1  # the slot's previous block is overwritten: unmap it
            st.ring_idx[r] = i
            st.table[i] = st.ring[r]
        return [st.table[p // bs] * bs + p % bs for p in range(length, length + n)]

    def truncate(self, st: GroupState, length: int) -> None:
        """Give back blocks wholly at or beyond `length` (a ring slot holding such a block is emptied)."""
        keep = -(-length // self.g.block_size)
        tail = st.table[keep:]
        del st.table[keep:]
        if st.ring is None:
            self.pool.release_all(reversed(tail))
            return
        for r, i in enumerate(st.ring_idx):
            if i >= keep and st.ring[r] >= 0:
                self.pool.decref(st.ring[r])
                st.ring[r], st.ring_idx[r] = -1, -1

    def evict(self, st: GroupState, length: int) -> None:
        """Post-step eviction (design §9.3.2): unmap blocks below the window of any future query."""
        for i in range(min(len(st.table), self.live_start(length))):
            st.table[i] = -1
