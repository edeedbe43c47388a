"""Rank 0's session of a tensor-parallel set: an InferenceSession whose every run is first announced to the
followers (launch.py, messages.py).

`run_torch(feeds, ...)` broadcasts the step: the feeds that are not caches (token ids, block tables, sequence
lengths, slot mapping, attention_metadata: the plan rank 0's KV manager made) travel in the message; caches are
named only (each rank has its own, of the same shape); the block copies rank 0's KV manager made since the last
step (copy-on-write of shared blocks: `mirror_copies`) ride along. Then rank 0 runs its own shard; every rank takes
part in the graph's AllReduce / AllGather nodes in the same order. Anything else (get_inputs, device,
cache_inputs, attention_variants, ...) is rank 0's session's.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from . import messages as M


class DistributedSession:
    def __init__(self, tp, sid: int, session):
        self._tp, self._sid, self._session = tp, sid, session
        self._copies: list = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)

    @property
    def world_size(self) -> int:
        return self._tp.world

    def run_torch(self, feeds: Mapping[str, torch.Tensor], output_names: Sequence[str] | None = None, *,
                  plan: str | None = None, distinct_slots: bool = False) -> dict[str, torch.Tensor]:
        names = list(output_names or [o.name for o in self._session.get_outputs()])
        caches = self._session.cache_inputs
        meta = {"sid": self._sid, "outputs": names, "plan": plan, "distinct": bool(distinct_slots),
                "copies": self._copies, "feeds": [], "caches": []}
        tensors = []
        for name, t in feeds.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"input '{name}': run_torch takes torch tensors, got {type(t).__name__}")
            if name in caches:  # the token tells a follower when rank 0's cache tensor is a new one
                meta["caches"].append([name, M.dtype_name(t.dtype), list(t.shape),
                                       f"{t.untyped_storage().data_ptr()}:{t.storage_offset()}"])
            else:
                meta["feeds"].append(name)
                tensors.append(t)
        self._copies = []
        self._tp.send(M.RUN, meta, tensors)
        return self._tp.guard(lambda: self._session.run_torch(feeds, names, plan=plan, distinct_slots=distinct_slots))

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any], run_options=None, *,
            plan: str | None = None) -> list:
        """numpy in, numpy out (InferenceSession.run's contract), through run_torch."""
        from ..tensors import to_numpy, to_torch

        feeds = {n: to_torch(v, "cpu" if n in self._session.host_inputs else self._session.device, copy=True)
                 for n, v in input_feed.items()}
        names = list(output_names or [o.name for o in self._session.get_outputs()])
        outs = self.run_torch(feeds, names, plan=plan)
        return [to_numpy(outs[n]).copy() for n in names]

    def mirror_copies(self, mgr) -> None:
        """Record the block copies of `mgr` (a KVCacheManager over this session's caches) so that every rank
        makes them on its caches before the next step."""
        feeds = mgr.cache_feeds()
        for group, blk in mgr.blocks.items():
            tensors = [t for layer in blk.g.layers for t in mgr.caches[layer.layer_id].values()]
            names = [n for n, t in feeds.items() if any(t is x for x in tensors)]
            blk.copy_block = self._recording(blk.copy_block, names)

    def _recording(self, copy, names: list[str]):
        def copy_block(src: int, dst: int) -> None:
            copy(src, dst)
            self._copies.append([names, int(src), int(dst)])

        return copy_block

    def close(self) -> None:
        """Drop this session on every rank (the set stays)."""
        if not self._tp.broken and self._tp._finalizer.alive:
            self._tp.send(M.DROP, {"sid": self._sid})
