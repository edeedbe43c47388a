"""Decode steps as CUDA-graph replays, one graph per (batch bucket, KV-length bucket).

A decode step (every sequence adds one token over a cached context) is planned padded to a batch bucket
(`KVCacheManager.plan(pad_to=...)`: the pad rows are one-token sequences on the pad block) with replay-wide
attention_metadata bounds (max_query_len 1, max_kv_len the KV bucket, lower bound 0 = unknown), so every
step of one key has the same shapes, the same host facts and the same buffer addresses:

    input_ids   [Bp] int64         persistent (self.ids), written by a non-blocking copy each step
    block_table [Bp, max_blocks]   views of the KVCacheManager's persistent plan buffers
    cumulative_sequence_lengths [Bp + 1], past_sequence_lengths [Bp], query_positions / slot_mapping [Bp]
    caches      [NB + 1, BS, Hkv, Dc]  the manager's tensors (block NB: the pad block), updated in place
    attention_metadata [3] int32   CPU, read on the host at capture: (1, kv bucket, 0) for the key's graph

The first step of a key runs eagerly on a side stream (it is that step's real result, and it warms up the
kernels and the session's host-constant copies), then the graph is captured (capture records, it does not
run); later steps of the key replay it. All graphs share one memory pool; a graph's logits [Bp, V] are
read before the next replay. Host values that an op copies to the device at run time are pinned and kept
alive with the graph, so the captured copy reads the same bytes on every replay.

`DecodeGraphs(model, capture=False)` runs the same padded plans eagerly (what the CPU tests check: padding
changes no real row's logits).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import logging

import torch

from ..runtime.kv.staging import PinnedRing

log = logging.getLogger("pagedkit.engine")

KV_BUCKET_MIN = 256  # smallest replay-wide max_kv_len bound: short contexts share one graph per batch bucket


def batch_buckets(max_batch_size: int) -> tuple[int, ...]:
    """Batch sizes graphs are captured for: 1, 2, 4, 8, then every multiple of 8, and max_batch_size."""
    out = {b for b in (1, 2, 4, 8) if b <= max_batch_size}
    out |= set(range(16, max_batch_size + 1, 8)) | {max_batch_size}
    return tuple(sorted(out))


def kv_bucket(max_kv_len: int, max_seq_len: int) -> int:
    """The replay-wide max_kv_len bound of a step whose longest sequence reaches max_kv_len tokens: the next
    power of two >= max(max_kv_len, KV_BUCKET_MIN), at most max_seq_len."""
    b = KV_BUCKET_MIN
    while b < max_kv_len:
        b *= 2
    return min(b, max_seq_len)


@dataclass
class _Graph:
    graph: object  # torch.cuda.CUDAGraph
    logits: torch.Tensor  # [rows, V] (or [rows, 1, V]): the captured output, rewritten by every replay
    keep: list = field(default_factory=list)  # pinned host tensors the captured copies read


@dataclass
class GraphStats:
    captured: int = 0  # graphs captured
    replays: int = 0  # steps replayed
    eager_padded: int = 0  # padded decode steps run eagerly (each key's first step, or capture=False)
    keys: list = field(default_factory=list)  # (batch bucket, kv bucket) of the captured graphs, in order
    capture_error: str | None = None  # why a capture failed (decode steps then run eagerly, unpadded)


class DecodeGraphs:
    """Plans and runs padded decode steps of a PagedModel; on CUDA (capture=True) as CUDA-graph replays."""

    def __init__(self, model, capture: bool = True):
        self.model = model
        mgr = model.mgr
        if not mgr.config.pad_block:
            raise ValueError("DecodeGraphs needs a KVCacheManager built with KVCacheConfig(pad_block=True)")
        self.capture = capture
        if capture and mgr.device.type != "cuda":
            raise ValueError(f"cuda_graphs: CUDA graphs need device 'cuda', the model runs on {mgr.device}")
        cfg = mgr.config
        self.buckets = tuple(b for b in batch_buckets(cfg.max_batch_size) if b <= cfg.max_num_tokens)
        self.ids = torch.zeros(max(self.buckets), dtype=torch.int64, device=mgr.device)
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.runs = GraphCapture(model, capture)  # shared with the prefill graphs (one pool, one side stream)
        self.stats = GraphStats()
        self._keys: dict[int, tuple[int, int]] = {}  # plan id -> key of a padded plan not yet run
        self._stage = PinnedRing.of(self.ids.shape[0], torch.int64, capture)  # input ids' host staging

    # ---- planning ----------------------------------------------------------------------------------
    def key(self, batch: Sequence[tuple]) -> tuple[int, int] | None:
        """(batch bucket, kv bucket) when `batch` [(seq_id, ids)] is a decode step graphs serve, else None."""
        mgr = self.model.mgr
        if not batch or len(batch) > self.buckets[-1] or self.stats.capture_error:
            return None
        longest = 0
        for sid, new in batch:
            n = new if isinstance(new, int) else len(new)
            length = mgr.length(sid)
            if n != 1 or length < 1 or mgr.seqs[sid].pending_draft:
                return None
            longest = max(longest, length + 1)
        return self.batch_bucket(len(batch)), kv_bucket(longest, mgr.config.max_seq_len)

    def batch_bucket(self, n: int) -> int | None:
        """The rows a decode step of n sequences runs padded to (None: more than the largest bucket)."""
        return next((b for b in self.buckets if b >= n), None)

    def plan(self, batch: Sequence[tuple]):
        """The step's plan: padded with replay-wide bounds when graphs serve it, else the manager's plain plan."""
        mgr = self.model.mgr
        key = self.key(batch)
        if key is None:
            return mgr.plan(batch)
        plan = mgr.plan(batch, bounds=(1, key[1], 0), pad_to=key[0])
        self._keys[plan.plan_id] = key
        return plan

    def serves(self, plan) -> bool:
        return plan.plan_id in self._keys

    # ---- running -----------------------------------------------------------------------------------
    def run(self, plan, token_ids: Sequence[int], device_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, V] of a padded decode plan's real rows (a view: valid until the next step). device_ids
        ([B] int64 on the run device, e.g. the previous step's greedy choices): the step's input ids, copied
        on the device (token_ids then only gives B)."""
        key = self._keys.pop(plan.plan_id)
        bp, b = key[0], len(token_ids)
        ids = self._write_ids(bp, token_ids) if device_ids is None else self._copy_ids(bp, device_ids)
        g = self.graphs.get(key)
        if g is not None:
            g.graph.replay()
            self.stats.replays += 1
            return g.logits.reshape(bp, -1)[:b]
        out = self.runs.first(self.graphs, key, self.model.feeds(plan, ids), plan.hint, self.stats, "decode")
        return out.reshape(bp, -1)[:b]

    def _write_ids(self, bp: int, token_ids: Sequence[int]) -> torch.Tensor:
        """The persistent input_ids [bp]: the step's ids, then zeros for the pad rows (on CUDA a non-blocking
        copy from a pinned staging buffer of a small ring, reused once its last copy has run)."""
        host = self._stage.take()[:bp]
        host.zero_()
        host[: len(token_ids)] = torch.as_tensor(list(token_ids), dtype=torch.int64)
        ids = self.ids[:bp]
        ids.copy_(host, non_blocking=self.capture)
        self._stage.done()
        return ids

    def _copy_ids(self, bp: int, device_ids: torch.Tensor) -> torch.Tensor:
        """The persistent input_ids [bp] from ids already on the device (pad rows zero): no host round trip."""
        b = device_ids.shape[0]
        ids = self.ids[:bp]
        ids[:b].copy_(device_ids)
        if bp > b:
            ids[b:].zero_()
        return ids

    def abort(self, plan) -> None:
        self._keys.pop(plan.plan_id, None)


class GraphCapture:
    """The side stream and the memory pool all CUDA graphs of one model share (decode and prefill graphs:
    their replays never overlap), and the two runs of a graph's first step: `eager` (the step's real result,
    run off the capture stream: torch.cuda.graphs' advice for a warm-up) and `capture` (records the same
    forward; runs nothing). capture=False: `eager` is the model's plain forward (no stream)."""

    def __init__(self, model, capture: bool):
        self.model, self.enabled = model, capture
        self.pool = None
        self.stream = None

    def eager(self, feeds, hint) -> torch.Tensor:
        if not self.enabled:
            return self.model.forward(feeds, hint)
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.model.mgr.device)
        main = torch.cuda.current_stream(self.model.mgr.device)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            out = self.model.forward(feeds, hint)
        main.wait_stream(self.stream)
        out.record_stream(main)
        return out

    def first(self, graphs: dict, key, feeds, hint, stats, kind: str) -> torch.Tensor:
        """A key's first step: run eagerly (its result), then, with capture on, captured into graphs[key]
        (stats: captured, keys, eager_padded). A failed capture is recorded in stats.capture_error and logged;
        this step's result stands and the caller's later steps of that kind run eagerly, unpadded. So is a step
        whose eager run took a path that reads the host (the model's host_routes(): a MoE node off the fused
        kernel), before any capture is tried; on the CPU too (capture off), so that the steps run alike."""
        out = self.eager(feeds, hint)
        stats.eager_padded += 1
        why = self.model.host_routes()
        if why is not None:
            stats.capture_error = why
            log.warning("%s bucket %s is not captured, %s steps run eagerly: %s", kind, key, kind, why)
            return out
        if self.enabled:
            try:
                graphs[key] = self.capture(feeds, hint)
                stats.captured += 1
                stats.keys.append(key)
            except Exception as exc:
                stats.capture_error = f"{type(exc).__name__}: {exc}"[:500]
                log.warning("CUDA-graph capture of %s bucket %s failed, %s steps run eagerly: %s", kind, key, kind,
                            stats.capture_error)
        return out

    def capture(self, feeds, hint) -> _Graph:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        keep: list = []
        session = self.model.session
        session._capture_keep = keep  # run-time host -> device copies are pinned and kept (session._place)
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                out = self.model.forward(feeds, hint)
        finally:
            session._capture_keep = None
        return _Graph(graph, out, keep)
