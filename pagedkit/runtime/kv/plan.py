"""Persistent step buffers and the StepPlan that views them.

All per-step int32 inputs of a PagedAttention model live in ONE flat device buffer allocated once at
capacity (max batch, max tokens, block-table width per group), so a captured CUDA graph sees the same
addresses on every replay. A plan writes the host values into a pinned staging buffer and copies the used rows
to the device with non-blocking host-to-device copies: segments whose used rows lie within MERGE_GAP elements of
each other go in one copy (the batch-indexed segments come first, so a decode step's cu / past / block-table
rows are one copy), and segments the model does not read (`PlanBuffers.fed`, set by the engine from its input
names: an exported model reads no slot_mapping or query_positions) are not copied at all (the plan then holds
None for them). Staging buffers rotate and each is reused only after the copy that last read it has completed
(an event wait on the host in `plan`, never in `run`). On a CPU device the flat buffer is written directly.

`attention_metadata` [3] is CPU-resident (ORT's OrtMemTypeCPUInput), also persistent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ...interface import names as N
from .config import KVCacheConfig
from .staging import PinnedRing

# model input names (onnxruntime-genai paged layout; contract-decisions §5, §8)
CU_SEQLENS = N.CUMULATIVE_SEQUENCE_LENGTHS
PAST_SEQLENS = N.PAST_SEQUENCE_LENGTHS
METADATA = N.ATTENTION_METADATA
QUERY_POSITIONS = N.QUERY_POSITIONS


@dataclass
class StepPlan:
    """One step's inputs: views into persistent buffers (valid until the next `plan`).

    block_tables[group]  [B, max_blocks] int32, indexed by absolute position, -1 = unmapped
    slot_mappings[group] [T] int32, flat slot block * block_size + offset (or -1: no write)
    cumulative_sequence_length [B + 1], past_seqlens [B], query_positions [T]  (int32, run device)
    (a segment the model does not read, PlanBuffers.fed, is None: never a stale device view)
    attention_metadata [3] int32 on the CPU: max_query_len_bound, max_kv_len_bound, max_kv_len_lower_bound
    host_slots[group]: the slot mapping as a Python list (host bookkeeping, tests).
    pad_rows: rows after the batch's (a padded plan): one-token sequences with no past on the pad block; the
    device tensors hold B + pad_rows rows (T + pad_rows tokens), the host facts the batch's only.
    """

    plan_id: int
    seq_ids: tuple
    query_lens: tuple[int, ...]
    past_lens: tuple[int, ...]
    draft_lens: tuple[int, ...]
    block_tables: dict[str, torch.Tensor | None]
    slot_mappings: dict[str, torch.Tensor | None]
    cumulative_sequence_length: torch.Tensor | None
    past_seqlens: torch.Tensor | None
    query_positions: torch.Tensor | None
    attention_metadata: torch.Tensor
    host_slots: dict[str, list[int]]
    table_names: dict[str, str] = field(default_factory=dict)  # group -> model input name
    slot_names: dict[str, str] = field(default_factory=dict)
    pad_rows: int = 0

    @property
    def batch_size(self) -> int:
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def hint(self) -> str | None:
        """The step's plan kind for `InferenceSession.run_torch(plan=...)` (kernels/variant.py PLANS), from host
        facts only: "prefill" (no sequence has a cached prefix), "decode" (every sequence adds at most
        DECODE_TOKENS tokens over a cached context: decode, speculative drafts), "chunked_prefill" (every
        sequence has a cached prefix, some add more), None (a mix: any variant)."""
        if not self.query_lens:
            return None
        if all(p == 0 for p in self.past_lens):
            return "prefill"
        if any(p == 0 for p in self.past_lens):
            return None
        return "decode" if max(self.query_lens) <= DECODE_TOKENS else "chunked_prefill"

    def feeds(self, names=None, slot_mapping: bool = True, query_positions: bool = False) -> dict[str, torch.Tensor]:
        """Model inputs by name. `names` (e.g. a session's input names) keeps only those the model has."""
        out = {CU_SEQLENS: self.cumulative_sequence_length, PAST_SEQLENS: self.past_seqlens,
               METADATA: self.attention_metadata}
        for g, t in self.block_tables.items():
            out[self.table_names[g]] = t
        if slot_mapping:
            for g, t in self.slot_mappings.items():
                out[self.slot_names[g]] = t
        if query_positions:
            out[QUERY_POSITIONS] = self.query_positions
        if names is not None:
            keep = set(names)
            out = {k: v for k, v in out.items() if k in keep}
        missing = sorted(k for k, v in out.items() if v is None)
        if missing and names is not None:
            raise ValueError(f"StepPlan.feeds: {missing} were not copied to the device (PlanBuffers.fed leaves "
                             "them out): the manager was told the model does not read them")
        return {k: v for k, v in out.items() if v is not None}


DECODE_TOKENS = 8  # a step whose sequences each add at most this many tokens over a cached context is "decode"


def step_metadata(query_lens, kv_lens, bounds) -> list[int]:
    """attention_metadata: the replay-wide bounds when given (checked against this step), else exact."""
    exact = [max(query_lens), max(kv_lens), max(kv_lens)]
    if bounds is None:
        return exact
    q_hi, kv_hi, kv_lo = (int(x) for x in bounds)
    if (q_hi and exact[0] > q_hi) or (kv_hi and exact[1] > kv_hi) or (kv_lo and exact[1] < kv_lo):
        raise ValueError(
            f"attention_metadata bounds {tuple(bounds)} do not hold for this step: max_query_len {exact[0]}, "
            f"max_kv_len {exact[1]} (need max_query_len <= bounds[0] and bounds[2] <= max_kv_len <= bounds[1]; "
            "0 = unknown)")
    return [q_hi, kv_hi, kv_lo]


MERGE_GAP = 4096  # elements: used rows of two segments this close go in one host-to-device copy (16 KB extra
# bytes cost well under a copy's own latency of a few microseconds)


def copy_ranges(spans: list[tuple[int, int]], gap: int = MERGE_GAP) -> list[tuple[int, int]]:
    """(offset, length) spans -> the fewest (offset, length) copies covering them, merging spans whose gap is
    <= `gap` elements (empty spans dropped)."""
    out: list[list[int]] = []
    for off, n in sorted(sp for sp in spans if sp[1] > 0):
        if out and off - (out[-1][0] + out[-1][1]) <= gap:
            out[-1][1] = max(out[-1][1], off + n - out[-1][0])
        else:
            out.append([off, n])
    return [(o, n) for o, n in out]


def _padded_slots(dst: np.ndarray, table: np.ndarray, real: list[int], query_lens, past_lens, L: int,
                  pad_block: int, block_size: int, row_lens: list[int]) -> None:
    """dst [B * L] <- each sequence's real slots, then its pad tokens' (the table's slot of each later
    position); the table rows' entries past each sequence's blocks, up to its last padded position, become the
    pad block (table: [B, width] host view, written in place)."""
    start = 0
    for b, (n, past) in enumerate(zip(query_lens, past_lens)):
        out = dst[b * L : (b + 1) * L]
        out[:n] = real[start : start + n]
        start += n
        last = -(-(past + L) // block_size)  # blocks the padded sequence covers
        table[b, row_lens[b] : last] = pad_block
        pos = np.arange(past + n, past + L)
        out[n:] = table[b, pos // block_size] * block_size + pos % block_size


class PlanBuffers:
    """The flat persistent int32 buffer and its segments, batch-indexed first: "cu", "past", ("table", g), then
    "qpos", ("slots", g). `fed`: the segments the model reads (None: all); only those are copied."""

    def __init__(self, config: KVCacheConfig, staging_depth: int = 3):
        self.config = config
        self.device = torch.device(config.device)
        max_b, max_t = config.max_batch_size, config.max_num_tokens
        shapes: dict[object, tuple[int, ...]] = {"cu": (max_b + 1,), "past": (max_b,)}
        for g in config.groups:
            shapes[("table", g.name)] = (max_b, config.max_blocks_per_seq(g))
        shapes["qpos"] = (max_t,)
        for g in config.groups:
            shapes[("slots", g.name)] = (max_t,)
        self.shapes = shapes
        self.fed: frozenset | None = None  # segments the model reads (None: all): the others are never copied
        self.copies = 0  # host-to-device copies issued (tests)
        self.offsets: dict[object, int] = {}
        total = 0
        for key, shape in shapes.items():
            self.offsets[key] = total
            total += math.prod(shape)
        self.total = total
        self.on_cuda = self.device.type == "cuda"
        self.dev = torch.full((total,), -1, dtype=torch.int32, device=self.device)
        # host staging: a pinned ring on CUDA; on the CPU the device buffer itself (no copy)
        self.ring = (PinnedRing.of(total, torch.int32, True, staging_depth, fill=-1) if self.on_cuda
                     else PinnedRing([self.dev], False))
        self.metadata = torch.zeros(3, dtype=torch.int32)  # CPU-resident by contract
        self._metadata_np = self.metadata.numpy()  # written through numpy: no torch op per step
        self._slices: dict[tuple, torch.Tensor] = {}  # (segment, rows) -> the device view (made once: same memory)
        self._table_names = {g.name: g.block_table_name for g in config.groups}
        self._slot_names = {g.name: g.slot_name for g in config.groups}
        # the views never change: made once (numpy views of each staging buffer, device views by segment)
        self._host_views = [{key: self._view(flat, key).numpy() for key in shapes} for flat in self.ring.bufs]
        self._dev_views = {key: self._view(self.dev, key) for key in shapes}

    def _view(self, flat: torch.Tensor, key) -> torch.Tensor:
        off, shape = self.offsets[key], self.shapes[key]
        return flat[off : off + math.prod(shape)].view(shape)

    def begin(self) -> dict[object, np.ndarray]:
        """Host views (numpy, writable) of the next staging buffer, once its previous copy is done."""
        self.ring.take()  # waits for the copy that last read this staging buffer
        return self._host_views[self.ring.current]

    def finish(self, used_rows: dict[object, int]) -> dict[object, torch.Tensor | None]:
        """Copy the used leading rows of the fed segments to the device (merged copies, `copy_ranges`); return
        device views sliced to them (None for a segment not fed)."""
        out: dict[object, torch.Tensor | None] = {}
        spans = []
        for key, rows in used_rows.items():
            if self.fed is not None and key not in self.fed:
                out[key] = None
                continue
            shape = self.shapes[key]
            spans.append((self.offsets[key], rows * (math.prod(shape[1:]) if len(shape) > 1 else 1)))
            view = self._slices.get((key, rows))
            if view is None:
                view = self._slices[(key, rows)] = self._dev_views[key][:rows]
            out[key] = view
        if self.on_cuda:
            src = self.ring.bufs[self.ring.current]
            for off, n in copy_ranges(spans):
                self.dev[off : off + n].copy_(src[off : off + n], non_blocking=True)
                self.copies += 1
        self.ring.done()
        return out

    def write(self, plan_id: int, seq_ids, query_lens, past_lens, draft_lens, tables, slots, bounds,
              pad: tuple[int, dict[str, int]] | None = None,
              pad_len: tuple[int, dict[str, int]] | None = None) -> StepPlan:
        """Fill the buffers for one step. tables[group] = one block-table row (list) per sequence,
        slots[group] = the flat slot mapping [T]. pad = (rows, pad block per group): that many one-token pad
        rows after the batch (no past; position 0 of the pad block, written and read by the pad row only).
        pad_len = (L, pad block per group): every sequence's tokens padded to L on the device (KVCacheManager.plan):
        the table's entries past a sequence's blocks up to its last padded position are the pad block, and a
        pad token's slot is the table's slot of its position."""
        cfg = self.config
        host = self.begin()
        n_pad, pad_blocks = pad if pad else (0, {})
        if pad_len:
            L, pad_blocks = pad_len
            lens = [L] * len(seq_ids)
        else:
            lens = list(query_lens) + [1] * n_pad
        B, T = len(lens), sum(lens)  # the device rows and tokens
        host["cu"][0] = 0
        if B == 1:
            host["cu"][1] = lens[0]
        else:
            host["cu"][1 : B + 1] = np.cumsum(lens)
        nb = len(seq_ids)
        host["past"][:nb] = past_lens
        host["past"][nb:B] = 0
        if nb == 1:
            host["qpos"][: lens[0]] = np.arange(past_lens[0], past_lens[0] + lens[0])
        else:
            host["qpos"][: T - n_pad] = np.concatenate([np.arange(p, p + q) for p, q in zip(past_lens, lens)])
        host["qpos"][T - n_pad : T] = 0
        for g in cfg.groups:
            table, dst = host[("table", g.name)], host[("slots", g.name)]
            table[:B] = -1
            for b, row in enumerate(tables[g.name]):
                table[b, : len(row)] = row
            if pad_len:
                _padded_slots(dst, table, slots[g.name], query_lens, past_lens, L, pad_blocks[g.name],
                              g.block_size, [len(r) for r in tables[g.name]])
            else:
                dst[: T - n_pad] = slots[g.name]
            if n_pad:
                table[nb:B, 0] = pad_blocks[g.name]
                dst[T - n_pad : T] = pad_blocks[g.name] * g.block_size
        meta = step_metadata(query_lens, [p + q for p, q in zip(past_lens, query_lens)], bounds)
        self._metadata_np[:] = meta
        used = {("table", g.name): B for g in cfg.groups} | {("slots", g.name): T for g in cfg.groups}
        dev = self.finish(used | {"cu": B + 1, "past": B, "qpos": T})
        return StepPlan(
            plan_id=plan_id,
            seq_ids=tuple(seq_ids),
            query_lens=tuple(query_lens),
            past_lens=tuple(past_lens),
            draft_lens=tuple(draft_lens),
            block_tables={g.name: dev[("table", g.name)] for g in cfg.groups},
            slot_mappings={g.name: dev[("slots", g.name)] for g in cfg.groups},
            cumulative_sequence_length=dev["cu"],
            past_seqlens=dev["past"],
            query_positions=dev["qpos"],
            attention_metadata=self.metadata,
            host_slots={g.name: list(slots[g.name]) for g in cfg.groups},
            table_names=self._table_names,
            slot_names=self._slot_names,
            pad_rows=n_pad,
        )
