"""First-prompt prefills as CUDA-graph replays, one graph per (sequences B, padded prompt length L).

A batch-1 prefill of ~1k tokens runs ~4.5 ms of kernels on an H200 but took ~21 ms eagerly: the host
(Python around ~27 ops a layer, Triton launches) is the step. A replay costs the kernels alone.

A step of B first prompts (no cached prefix, each prompt whole in the step, B * L <= max_tokens) is planned
with every sequence padded to L = the first TOKEN_BUCKETS entry >= its longest prompt
(`KVCacheManager.plan(pad_len=L)`): sequence b's n_b tokens, then L - n_b pad tokens (id 0) at the next
positions, whose K / V go to the tail of the sequence's last block, then to the pad block that fills the
rest of its block-table row. Every graph of a key has the same shapes and addresses:

    input_ids   [B * L] int64   persistent (self.ids), pad tokens 0, written by a non-blocking copy per step
    pagedkit.logit_rows [B] int64  persistent: the rows read (padded positions b * L + j), same copy path
    cumulative_sequence_lengths [B + 1] = 0, L, 2L, ...; past_sequence_lengths [B] = 0
    block_table [B, max_blocks]  the manager's persistent plan buffers
    attention_metadata [3]      CPU, (L, L, 0): read at capture (uniform prompts: sdpa_prefill's fused route)

Why the padding changes no real row: attention is causal, so a real query never reads a later position;
the pad tokens' keys are finite (written this step, or the pad block's earlier finite writes: caches start
at zero), so a fused kernel's masked diagonal tile multiplies zeros by finite values; the pad rows' own
outputs are never read (the head reads only the real rows, `pagedkit.logit_rows`). A pad token's write into
the sequence's last block lands past its length, where its own next tokens are written before any read.

Served only for models whose head reads the rows asked for (the `pagedkit.logit_rows` input: the graph's
logits are [B, V], not [B * L, V]) and whose caches are all full-attention. The first step of a key runs
eagerly and is then captured (graphs.GraphCapture, the decode graphs' pool and stream); at most
`max_graphs` keys are captured, later new keys run eagerly (unpadded). A failed capture turns prefill
graphs off for the engine's life (`stats.capture_error`); that step's eager result stands.
`PrefillGraphs(model, runs, capture=False)` plans and runs the same padded steps eagerly (the CPU tests).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from ..runtime.kv.staging import PinnedRing
from ..runtime.session import ROWS_INPUT
from .graphs import GraphCapture, _Graph

# padded prompt lengths: each at most 1.5x the one before (a prompt pads by < 50%; ~25% on average)
TOKEN_BUCKETS = (16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384)
MAX_TOKENS = 4096  # default largest B * L a graph serves: beyond it the kernels outweigh the host
MAX_GRAPHS = 32  # default most keys captured


def token_bucket(n: int) -> int | None:
    """The padded length of a prompt of n tokens: the first TOKEN_BUCKETS entry >= n (None beyond them)."""
    i = bisect.bisect_left(TOKEN_BUCKETS, n)
    return TOKEN_BUCKETS[i] if i < len(TOKEN_BUCKETS) else None


@dataclass
class PrefillStats:
    captured: int = 0  # graphs captured
    replays: int = 0  # prefill steps replayed
    eager_padded: int = 0  # padded prefill steps run eagerly (each key's first step, or capture=False)
    keys: list = field(default_factory=list)  # (B, L) of the captured graphs, in order
    capture_error: str | None = None  # why a capture failed (prefill steps then run eagerly, unpadded)


class PrefillGraphs:
    """Plans and runs padded first-prompt prefill steps of a PagedModel; on CUDA (capture=True) as replays."""

    def __init__(self, model, runs: GraphCapture, *, capture: bool = True, max_tokens: int = MAX_TOKENS,
                 max_graphs: int = MAX_GRAPHS):
        mgr = model.mgr
        if not mgr.config.pad_block:
            raise ValueError("PrefillGraphs needs a KVCacheManager built with KVCacheConfig(pad_block=True)")
        if model.rows is None:
            raise ValueError("PrefillGraphs needs a model whose head reads the rows asked for (the "
                             "'pagedkit.logit_rows' input)")
        self.model, self.runs, self.capture = model, runs, capture
        self.max_tokens = min(max_tokens, mgr.config.max_num_tokens)
        self.max_graphs = max_graphs
        dev = mgr.device
        self.ids = torch.zeros(max(self.max_tokens, 1), dtype=torch.int64, device=dev)
        self.rows = torch.zeros(mgr.config.max_batch_size, dtype=torch.int64, device=dev)
        n_stage = self.ids.shape[0] + self.rows.shape[0]
        self._stage = PinnedRing.of(n_stage, torch.int64, capture)  # ids then rows, one staging buffer a step
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.stats = PrefillStats()
        self._keys: dict[int, tuple[int, int]] = {}  # plan id -> key of a padded plan not yet run

    # ---- planning ----------------------------------------------------------------------------------
    def key(self, batch: Sequence[tuple]) -> tuple[int, int] | None:
        """(B, L) when `batch` [(seq_id, ids)] is a step of whole first prompts a graph serves, else None."""
        mgr = self.model.mgr
        if not batch or self.stats.capture_error:
            return None
        longest = 0
        for sid, new in batch:
            if isinstance(new, int):
                return None  # ids unknown at plan time
            seq = mgr.seqs[sid]
            if seq.length or seq.pending_draft:
                return None
            longest = max(longest, len(new))
        L = token_bucket(longest)
        if L is None or len(batch) * L > self.max_tokens or L > mgr.config.max_seq_len:
            return None
        key = (len(batch), L)
        if key not in self.graphs and len(self.graphs) >= self.max_graphs and self.capture:
            return None
        return key

    def plan(self, batch: Sequence[tuple]):
        """The step's padded plan when a graph serves it, else None."""
        key = self.key(batch)
        if key is None:
            return None
        plan = self.model.mgr.plan(batch, bounds=(key[1], key[1], 0), pad_len=key[1])
        self._keys[plan.plan_id] = key
        return plan

    def serves(self, plan) -> bool:
        return plan.plan_id in self._keys

    def abort(self, plan) -> None:
        self._keys.pop(plan.plan_id, None)

    # ---- running -----------------------------------------------------------------------------------
    def run(self, plan, token_ids: Sequence[int], rows: Sequence[int] | None) -> torch.Tensor:
        """The logits [len(rows), V] of a padded plan's flat rows (None: every real token), as PagedModel.run
        (token_ids: the plan's real tokens, batch order). Up to B rows: the graph (a replay, or the key's first
        step); more: the padded step eagerly, its head on those rows."""
        B, L = key = self._keys.pop(plan.plan_id)
        starts = np.cumsum((0,) + tuple(plan.query_lens))
        flat = range(int(starts[-1])) if rows is None else rows
        seq = np.searchsorted(starts, np.asarray(flat, dtype=np.int64), side="right") - 1
        padded = seq * L + (np.asarray(flat, dtype=np.int64) - starts[seq])  # [R] rows in the padded step
        n_rows = len(padded)
        ids, row_feed = self._write(plan.query_lens, token_ids, L, padded if n_rows <= B else None, B)
        if n_rows > B:  # more rows than the graph reads: this step eagerly
            feeds = self.model.feeds(plan, ids)
            feeds[ROWS_INPUT] = self.model.rows.feed(padded.tolist())
            self.stats.eager_padded += 1
            return self.model.forward(feeds, plan.hint).reshape(n_rows, -1)
        g = self.graphs.get(key)
        if g is not None:
            g.graph.replay()
            self.stats.replays += 1
            return g.logits.reshape(B, -1)[:n_rows]
        feeds = self.model.feeds(plan, ids)
        feeds[ROWS_INPUT] = row_feed
        out = self.runs.first(self.graphs, key, feeds, plan.hint, self.stats, "prefill")
        return out.reshape(B, -1)[:n_rows]

    def _write(self, query_lens, token_ids, L: int, padded: np.ndarray | None, B: int):
        """The persistent input_ids [B * L] (each prompt, then zeros) and logit rows [B] (the padded rows read,
        then row 0 for the unused ones): one pinned staging buffer, two non-blocking copies on CUDA."""
        host = self._stage.take()
        n_ids = B * L
        hid = host[:n_ids].numpy()
        hid[:] = 0
        src = np.asarray(token_ids, dtype=np.int64)
        start = 0
        for b, n in enumerate(query_lens):
            hid[b * L : b * L + n] = src[start : start + n]
            start += n
        ids = self.ids[:n_ids]
        ids.copy_(host[:n_ids], non_blocking=self.capture)
        rows = None
        if padded is not None:
            off = self.ids.shape[0]
            hr = host[off : off + B].numpy()
            hr[:] = 0
            hr[: len(padded)] = padded
            rows = self.rows[:B]
            rows.copy_(host[off : off + B], non_blocking=self.capture)
        self._stage.done()
        return ids, rows
