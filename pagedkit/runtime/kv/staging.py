"""Host buffers reused round robin for asynchronous host <-> device copies (pinned on CUDA).

    ring = PinnedRing.of(size, torch.int64, cuda=True)
    host = ring.take()            # the next buffer, once the copy that last used it has run
    dev.copy_(host[:n], non_blocking=True)
    ring.done()                   # an event after that copy: the buffer's next take() waits for it

Without the event, a non-blocking copy from a buffer the host rewrites for the next step could read the new
bytes. Used by the plan buffers (kv/plan.py), the graphs' input ids and the overlapped decode's choices
(engine/graphs.py, engine/overlap.py). Off CUDA the copies are synchronous: no events.
"""

from __future__ import annotations

import torch


class PinnedRing:
    def __init__(self, bufs: list[torch.Tensor], cuda: bool):
        self.bufs, self.cuda = bufs, cuda
        self.events: list = [None] * len(bufs)
        self.current, self._next = 0, 0

    @classmethod
    def of(cls, size: int, dtype: torch.dtype, cuda: bool, depth: int = 3, fill: int = 0) -> "PinnedRing":
        """depth buffers [size] of dtype filled with `fill` (pinned when cuda)."""
        return cls([torch.full((size,), fill, dtype=dtype, pin_memory=cuda) for _ in range(depth)], cuda)

    def take(self) -> torch.Tensor:
        """The next buffer (its index: `current`), after the copies recorded by its last done() have run."""
        k = self._next
        self._next = (k + 1) % len(self.bufs)
        self.current = k
        if self.events[k] is not None:
            self.events[k].synchronize()
            self.events[k] = None
        return self.bufs[k]

    def done(self):
        """Record an event on the current stream after the copies that use the last taken buffer; returns it
        (None off CUDA)."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record()
        self.events[self.current] = ev
        return ev
