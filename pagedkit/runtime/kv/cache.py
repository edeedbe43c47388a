"""The paged KV block manager the runtime owns (the operator never frees anything).

Protocol (one plan in flight at a time):

    mgr = KVCacheManager(config)               # allocates every cache tensor once
    hit = mgr.add_sequence(7, prompt_ids)      # prefix-cache hit: `hit` tokens are already cached
    plan = mgr.plan([(7, prompt_ids[hit:])])   # reserve slots, write block_table / slot_mapping / ...
    session.run(..., {**plan.feeds(names), **mgr.cache_feeds(), "input_ids": ...})
    mgr.commit(plan)                           # lengths advance; full blocks enter the prefix cache;
                                               # windowed rings evict what fell out of the window
    mgr.speculate(7, k); plan = mgr.plan([(7, [last] + drafts)]); run; mgr.commit(plan)
    mgr.accept(7, n_accepted)                  # roll back the k - n rejected drafts
    mgr.free(7)

`plan` only reserves: a sequence's length (past_seqlens of the next step) changes in `commit`, and
`abort(plan)` undoes a plan that was not run. Allocation is checked for the whole batch before any
state changes, so a KVCacheExhausted error leaves the manager as it was.

Full-attention groups map logical block i (positions [i*BS, (i+1)*BS)) to a block of the group's
pool; blocks are shared by `fork` and by prefix-cache hits (reference counts), and a write into a
shared block first copies it (copy-on-write, in every layer's caches, scale caches included).

Windowed groups (design §9.3, policy 1) give every sequence a ring of N = ceil((W + chunk - 1) / BS)
+ 1 blocks; logical block i lives in ring[i % N], so steady-state memory is N blocks whatever the
length. The block table stays indexed by absolute position: entries of the live range point into the
ring, entries below it are -1 (evicted after each step: blocks i < floor(max(0, L - W + 1) / BS) with L
the next step's past length, committed tokens only), entries beyond the extent are -1. A step of q
tokens at past length P must fit the ring: its blocks floor(max(0, P-W+1)/BS) .. floor((P+q-1)/BS)
may span at most N blocks, else the step is refused with the largest chunk that fits
(`max_step_tokens`). The derived slot path (no slot_mapping input) writes the same slots, because the
live entries of the table are exactly the ring blocks the slot mapping uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from .blocks import ALLOCATING, GroupBlocks, GroupState
from ...interface.names import layer_name
from .config import GroupConfig, KVCacheConfig
from .plan import CU_SEQLENS, PAST_SEQLENS, QUERY_POSITIONS, PlanBuffers, StepPlan, step_metadata
from .pool import BlockPool, KVCacheExhausted, block_hash

__all__ = ["KVCacheManager", "KVCacheExhausted"]


@dataclass
class _Seq:
    seq_id: object
    length: int = 0  # tokens whose K/V are in the cache (drafts included until accept)
    draft: int = 0  # trailing tokens of `length` that are unaccepted drafts
    pending_draft: int = 0  # declared by speculate(), applied by the next plan
    inflight: int = 0  # tokens reserved by the open plan
    token_ids: list[int] | None = None  # known ids (prompt and appended), None = not hashable
    ids_mark: int = 0  # len(token_ids) before the open plan extended it
    hashes: list[bytes] = field(default_factory=list)  # prefix-cache key of full blocks 0..len-1
    groups: dict[str, GroupState] = field(default_factory=dict)


class KVCacheManager:
    def __init__(self, config: KVCacheConfig):
        errs = config.check()
        if errs:
            raise ValueError("invalid KVCacheConfig:\n  " + "\n  ".join(errs))
        self.config = config
        self.device = torch.device(config.device)
        self.pools = {g.name: BlockPool(g.name, g.num_blocks) for g in config.groups}
        self.caches: dict[int, dict[str, torch.Tensor]] = {}  # layer id -> kind -> tensor
        for g in config.groups:
            for layer in g.layers:
                self.caches[layer.layer_id] = {
                    kind: torch.zeros(shape, dtype=dt, device=self.device)
                    for kind, (shape, dt) in layer.shapes(config.cache_blocks(g), g.block_size).items()
                }
        self.blocks = {g.name: GroupBlocks(g, self.pools[g.name], self._copier(g)) for g in config.groups}
        self.buffers = PlanBuffers(config)
        self._feed_names: dict[bool, list[tuple[str, torch.Tensor]]] = {}
        self.seqs: dict[object, _Seq] = {}
        self._open_plan: StepPlan | None = None
        self._plan_count = 0

    def feed_only(self, names) -> None:
        """Copy to the device only the step inputs named (model input names as StepPlan.feeds gives them:
        cumulative_sequence_lengths, past_sequence_lengths, each group's block table / slot mapping,
        query_positions); plans hold None for the others. For a caller that feeds a model with those inputs only
        (the engine: an exported model reads no slot_mapping or query_positions). None: copy everything."""
        if names is None:
            self.buffers.fed = None
            return
        names = set(names)
        self.buffers.fed = frozenset(k for k, name in self._segment_names().items() if name in names)

    def step_input_names(self) -> set[str]:
        """Every step input name a plan can give (StepPlan.feeds, before a model's renames)."""
        return set(self._segment_names().values())

    def _segment_names(self) -> dict:
        """Plan buffer segment (kv/plan.py) -> its step input name."""
        keys = {"cu": CU_SEQLENS, "past": PAST_SEQLENS, "qpos": QUERY_POSITIONS}
        for g in self.config.groups:
            keys[("table", g.name)] = g.block_table_name
            keys[("slots", g.name)] = g.slot_name
        return keys

    # ---- cache tensors -----------------------------------------------------------------------------
    def cache_feeds(self, present: bool = False) -> dict[str, torch.Tensor]:
        """Persistent cache tensors by model input name (`past_key_values.%d.key` ...); with
        present=True by output name (`present.%d.key` ...), the same tensors (outputs alias inputs)."""
        names = self._feed_names.get(present)
        if names is None:  # the caches never change: their names are worked out once
            tmpl = self.config.present_names if present else self.config.names
            names = self._feed_names[present] = [(layer_name(tmpl[kind], lid), t)
                                                 for lid, kinds in sorted(self.caches.items())
                                                 for kind, t in kinds.items()]
        return dict(names)

    def _copier(self, g: GroupConfig):
        tensors = [t for layer in g.layers for t in self.caches[layer.layer_id].values()]

        def copy_block(src: int, dst: int) -> None:
            for t in tensors:
                t[dst].copy_(t[src])  # device-side, asynchronous

        return copy_block

    # ---- sequences ---------------------------------------------------------------------------------
    def add_sequence(self, seq_id, prompt: int | Sequence[int]) -> int:
        """Register a sequence; returns how many leading prompt tokens are already cached (prefix hit,
        always < prompt length so at least one token is computed). Those tokens need no recompute: plan
        the remaining ones."""
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} already exists")
        n = prompt if isinstance(prompt, int) else len(prompt)
        if n < 1:
            raise ValueError(f"sequence {seq_id!r}: prompt should have >= 1 token, got {n}")
        self._check_len(seq_id, n)
        seq = _Seq(seq_id, token_ids=None if isinstance(prompt, int) else [int(t) for t in prompt])
        seq.groups = {name: blk.new_state() for name, blk in self.blocks.items()}
        if self.config.prefix_caching and seq.token_ids is not None:
            self._prefix_hit(seq)
        self.seqs[seq_id] = seq
        return seq.length

    def _prefix_hit(self, seq: _Seq) -> None:
        bs = self.config.groups[0].block_size
        groups = self.config.groups
        self._extend_hashes(seq, upto=len(seq.token_ids) - 1)  # keep >= 1 token to compute
        hits = []
        for h in seq.hashes:
            found = [self.pools[g.name].lookup(h) for g in groups]
            if any(b is None for b in found):
                break
            hits.append(found)
        for found in hits:
            for g, b in zip(groups, found):
                self.pools[g.name].incref(b)
                seq.groups[g.name].table.append(b)
        seq.length = len(hits) * bs

    def _extend_hashes(self, seq: _Seq, upto: int) -> None:
        """Compute hashes of the full blocks within the first `upto` known tokens."""
        if seq.token_ids is None:
            return
        bs = self.config.groups[0].block_size
        upto = min(upto, len(seq.token_ids))
        while (len(seq.hashes) + 1) * bs <= upto:
            i = len(seq.hashes)
            parent = seq.hashes[i - 1] if i else None
            seq.hashes.append(block_hash(parent, seq.token_ids[i * bs : (i + 1) * bs]))

    def fork(self, parent, child) -> None:
        """`child` shares every block of `parent` (reference counts); later writes copy on write."""
        p = self._seq(parent)
        if child in self.seqs:
            raise ValueError(f"fork: sequence {child!r} already exists")
        if p.inflight or p.draft or p.pending_draft:
            raise ValueError(f"fork: sequence {parent!r} has an open plan or unaccepted drafts; commit/accept first")
        c = _Seq(child, length=p.length, token_ids=None if p.token_ids is None else list(p.token_ids),
                 hashes=list(p.hashes))
        c.groups = {name: blk.fork(p.groups[name]) for name, blk in self.blocks.items()}
        self.seqs[child] = c

    def free(self, seq_id) -> None:
        """Release every block of the sequence (cached full blocks stay evictable in the prefix cache)."""
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            raise KeyError(f"free: no sequence {seq_id!r}")
        for name, blk in self.blocks.items():
            blk.release(seq.groups[name])

    def clear_prefix_cache(self) -> None:
        for pool in self.pools.values():
            pool.clear_cache()

    def speculate(self, seq_id, k: int) -> None:
        """Declare that the last k tokens of this sequence's next step are draft tokens. After the step,
        `accept(seq_id, n)` keeps n of them and rolls back the rest."""
        seq = self._seq(seq_id)
        if k < 1:
            raise ValueError(f"speculate: k should be >= 1, got {k}")
        if seq.draft or seq.inflight:
            raise ValueError(f"speculate: sequence {seq_id!r} has unaccepted drafts or an open plan")
        seq.pending_draft = k

    def accept(self, seq_id, n_accepted: int) -> None:
        """Keep the first n_accepted drafts; the rest are rolled back: the length (next past_seqlens)
        shrinks, so their slots are never read and are overwritten by the next step."""
        seq = self._seq(seq_id)
        if not 0 <= n_accepted <= seq.draft:
            raise ValueError(f"accept: n_accepted should be in [0, {seq.draft}] for sequence {seq_id!r}, "
                             f"got {n_accepted}")
        self._truncate(seq, seq.length - (seq.draft - n_accepted))
        if seq.token_ids is not None:  # rejected draft ids are gone too
            del seq.token_ids[seq.length :]
            del seq.hashes[seq.length // self.config.groups[0].block_size :]
        seq.draft = 0
        self._after_step(seq)

    def _truncate(self, seq: _Seq, length: int) -> None:
        """Drop cached tokens >= length: blocks wholly beyond go back to the pool (rings keep theirs)."""
        seq.length = length
        for name, blk in self.blocks.items():
            blk.truncate(seq.groups[name], length)

    def max_step_tokens(self, seq_id) -> int:
        """Most tokens the sequence may add in its next step (windowed rings and max_seq_len)."""
        seq = self._seq(seq_id)
        return min([self.config.max_seq_len - seq.length] + [b.max_step(seq.length) for b in self.blocks.values()])

    # ---- stepping ----------------------------------------------------------------------------------
    def plan(self, batch: Sequence[tuple], bounds: tuple[int, int, int] | None = None,
             pad_to: int | None = None, pad_len: int | None = None) -> StepPlan:
        """Reserve slots for batch = [(seq_id, n_new_tokens or new token ids), ...] and write the step's
        inputs into the persistent buffers. bounds overrides config.bounds (replay-wide metadata).
        pad_to (needs config.pad_block): the step's tensors get pad_to - len(batch) extra rows after the
        batch, each a one-token sequence with no past that writes and reads only the pad block (a CUDA-graph
        bucket's fixed shapes); the plan's host facts (seq_ids, lengths) stay the batch's.
        pad_len (needs config.pad_block, full-attention groups only): every sequence's new tokens are padded to
        pad_len on the device (a prefill graph's fixed shapes, engine/prefill_graphs.py): the pad tokens follow
        the sequence's own at the next positions, their slots are the block table's (the tail of the
        sequence's last block, then the pad block, which fills the table's entries past the sequence's blocks);
        a causal query never reads a later position, so they change no real token's result."""
        if self._open_plan is not None:
            raise RuntimeError("plan: the previous plan is neither committed nor aborted")
        if pad_to is not None:
            cfg = self.config
            if not cfg.pad_block:
                raise ValueError("plan: pad_to needs KVCacheConfig.pad_block=True (the pad rows' own block)")
            if not len(batch) <= pad_to <= cfg.max_batch_size:
                raise ValueError(f"plan: pad_to should be in [{len(batch)}, {cfg.max_batch_size}] (the batch size .. "
                                 f"max_batch_size), got {pad_to}")
        parsed = self._parse_batch(batch, pad_to)
        entries = [(seq, n) for seq, n, _ in parsed]
        if pad_len is not None:
            self._check_pad_len(parsed, pad_len, pad_to)
        bounds = bounds if bounds is not None else self.config.bounds
        step_metadata([n for _, n in entries], [seq.length + n for seq, n in entries], bounds)  # check first
        slots = self._reserve(entries)  # raises before any change when a pool is exhausted
        self._record_tokens(parsed)
        plan = self._write(entries, slots, bounds, pad_to, pad_len)
        self._open_plan = plan
        return plan

    def commit(self, plan: StepPlan) -> None:
        """The step ran: advance lengths, cache newly full blocks, evict what left the windows."""
        self._close(plan)
        for seq_id, n in zip(plan.seq_ids, plan.query_lens):
            seq = self.seqs.get(seq_id)
            if seq is None:
                continue  # freed while in flight
            seq.length += n
            seq.inflight = 0
            seq.draft, seq.pending_draft = seq.pending_draft, 0
            self._after_step(seq)

    def abort(self, plan: StepPlan) -> None:
        """The step did not run: release what the plan reserved (lengths never moved)."""
        self._close(plan)
        for seq_id in plan.seq_ids:
            seq = self.seqs.get(seq_id)
            if seq is not None:
                seq.inflight = seq.pending_draft = 0
                if seq.token_ids is not None:
                    del seq.token_ids[seq.ids_mark :]
                self._truncate(seq, seq.length)

    def set_tokens(self, seq_id, start: int, ids: Sequence[int]) -> None:
        """Replace the token ids recorded for positions [start, start + len(ids)) of the sequence: a step
        planned before the ids it feeds were known (the engine's overlapped decode plans with placeholders)
        sets them here, before that plan is committed (no prefix-cache hash covers them yet)."""
        seq = self._seq(seq_id)
        if seq.token_ids is None:
            return
        end = start + len(ids)
        hashed = len(seq.hashes) * self.config.groups[0].block_size
        if start < hashed or end > len(seq.token_ids):
            raise ValueError(f"set_tokens: positions [{start}, {end}) of sequence {seq_id!r} must be recorded "
                             f"ids no prefix-cache block covers yet ([{hashed}, {len(seq.token_ids)}))")
        seq.token_ids[start:end] = [int(t) for t in ids]

    def append(self, seq_id, n: int | Sequence[int]) -> dict[str, list[int]]:
        """Host-only step for one sequence (reserve and commit at once); returns the slots per group."""
        plan = self.plan([(seq_id, n)])
        self.commit(plan)
        return plan.host_slots

    def _close(self, plan: StepPlan) -> None:
        if self._open_plan is None or plan.plan_id != self._open_plan.plan_id:
            raise RuntimeError(f"plan {plan.plan_id} is not the open plan")
        self._open_plan = None

    def _after_step(self, seq: _Seq) -> None:
        accepted = seq.length - seq.draft
        if self.config.prefix_caching:
            self._extend_hashes(seq, upto=accepted)
            for g in self.config.groups:
                table = seq.groups[g.name].table
                for i in range(min(len(seq.hashes), accepted // g.block_size)):
                    self.pools[g.name].register(table[i], seq.hashes[i])
        for name, blk in self.blocks.items():
            blk.evict(seq.groups[name], accepted)

    def _seq(self, seq_id) -> _Seq:
        try:
            return self.seqs[seq_id]
        except KeyError:
            raise KeyError(f"no sequence {seq_id!r}") from None

    def _check_len(self, seq_id, total: int) -> None:
        if total > self.config.max_seq_len:
            widths = {g.name: self.config.max_blocks_per_seq(g) for g in self.config.groups}
            raise ValueError(f"sequence {seq_id!r} would reach {total} tokens, beyond max_seq_len "
                             f"{self.config.max_seq_len} (max_blocks_per_seq {widths})")

    def _check_pad_len(self, parsed, pad_len: int, pad_to: int | None) -> None:
        cfg = self.config
        if not cfg.pad_block:
            raise ValueError("plan: pad_len needs KVCacheConfig.pad_block=True (the pad tokens' own block)")
        if pad_to is not None:
            raise ValueError("plan: pad_to and pad_len exclude each other")
        if any(g.windowed for g in cfg.groups):
            raise ValueError("plan: pad_len needs full-attention groups only (a windowed ring has no pad entries)")
        longest = max(n for _, n, _ in parsed)
        if isinstance(pad_len, bool) or not isinstance(pad_len, int) or pad_len < longest:
            raise ValueError(f"plan: pad_len should be an integer >= the step's longest sequence ({longest} new "
                             f"tokens), got {pad_len!r}")
        for seq, _, _ in parsed:
            if seq.length + pad_len > cfg.max_seq_len:
                raise ValueError(f"plan: pad_len {pad_len} takes sequence {seq.seq_id!r} ({seq.length} cached "
                                 f"tokens) beyond max_seq_len {cfg.max_seq_len}")
        if len(parsed) * pad_len > cfg.max_num_tokens:
            raise ValueError(f"plan: {len(parsed)} sequences x pad_len {pad_len} tokens in the step, beyond "
                             f"max_num_tokens {cfg.max_num_tokens}")

    def _parse_batch(self, batch, pad_to: int | None = None) -> list[tuple[_Seq, int, object]]:
        cfg = self.config
        if not 1 <= len(batch) <= cfg.max_batch_size:
            raise ValueError(f"plan: batch size should be in [1, {cfg.max_batch_size}], got {len(batch)}")
        entries, seen = [], set()
        for seq_id, new in batch:
            seq = self._seq(seq_id)
            if seq_id in seen:
                raise ValueError(f"plan: sequence {seq_id!r} appears twice in the batch")
            seen.add(seq_id)
            if seq.draft:
                raise ValueError(f"plan: sequence {seq_id!r} has {seq.draft} unaccepted drafts; call accept first")
            n = new if isinstance(new, int) else len(new)
            if n < 1:
                raise ValueError(f"plan: sequence {seq_id!r} should get >= 1 new token, got {n}")
            if seq.pending_draft > n:
                raise ValueError(f"plan: sequence {seq_id!r} declared {seq.pending_draft} drafts but the step has {n} tokens")
            self._check_len(seq_id, seq.length + n)
            if not isinstance(new, int) and seq.token_ids is not None:
                known = seq.token_ids[seq.length : seq.length + n]
                if known and known != [int(t) for t in new[: len(known)]]:
                    raise ValueError(f"plan: token ids for sequence {seq_id!r} differ from its known tokens")
            entries.append((seq, n, new))
        total = sum(n for _, n, _ in entries) + (pad_to - len(entries) if pad_to else 0)
        if total > cfg.max_num_tokens:
            raise ValueError(f"plan: {total} tokens in the step{' (pad rows included)' if pad_to else ''}, beyond "
                             f"max_num_tokens {cfg.max_num_tokens}")
        return entries

    @staticmethod
    def _record_tokens(entries) -> None:
        for seq, n, new in entries:
            if seq.token_ids is None:
                continue
            seq.ids_mark = len(seq.token_ids)
            if len(seq.token_ids) >= seq.length + n:
                continue  # the step consumes known (prompt) tokens, checked equal in _parse_batch
            if isinstance(new, int):
                seq.token_ids, seq.hashes = None, []  # unknown ids: no prefix caching from here on
            else:
                seq.token_ids += [int(t) for t in new[len(seq.token_ids) - seq.length :]]

    # ---- reservation -----------------------------------------------------------------------------
    def _reserve(self, entries) -> dict[str, list[list[int]]]:
        """Allocate/copy blocks for every entry (after checking every pool); slots per group per entry."""
        acts = {}
        for name, blk in self.blocks.items():
            acts[name] = [blk.actions(seq.groups[name], seq.length, n, f"sequence {seq.seq_id!r}") for seq, n in entries]
            need = sum(a in ALLOCATING for per_seq in acts[name] for _, a in per_seq)
            blk.pool.require(need, f"a step of {len(entries)} sequences ({sum(n for _, n in entries)} tokens)")
        slots = {}
        for name, blk in self.blocks.items():
            slots[name] = []
            for seq, n in entries:  # re-derived: an earlier copy-on-write may have made a block private
                st = seq.groups[name]
                slots[name].append(blk.apply(st, blk.actions(st, seq.length, n, ""), seq.length, n))
        for seq, n in entries:
            seq.inflight = n
        return slots

    # ---- buffers -----------------------------------------------------------------------------------
    def _write(self, entries, slots, bounds, pad_to=None, pad_len=None) -> StepPlan:
        self._plan_count += 1
        pad = {g.name: g.num_blocks for g in self.config.groups} if pad_to or pad_len else None
        return self.buffers.write(
            self._plan_count,
            seq_ids=[seq.seq_id for seq, _ in entries],
            query_lens=[n for _, n in entries],
            past_lens=[seq.length for seq, _ in entries],
            draft_lens=[seq.pending_draft for seq, _ in entries],
            tables={g.name: [seq.groups[g.name].table for seq, _ in entries] for g in self.config.groups},
            slots={g: [s for per_seq in v for s in per_seq] for g, v in slots.items()},
            bounds=bounds,
            pad=(pad_to - len(entries), pad) if pad_to else None,
            pad_len=(pad_len, pad) if pad_len else None,
        )

    # ---- introspection ---------------------------------------------------------------------------
    def length(self, seq_id) -> int:
        return self._seq(seq_id).length

    def block_table_row(self, seq_id, group: str) -> list[int]:
        return list(self._seq(seq_id).groups[group].table)

    def num_free_blocks(self, group: str) -> int:
        return self.pools[group].num_free

    def check_invariants(self) -> list[str]:
        """Reference counts equal the references sequences hold; every block in one state."""
        errs = []
        for g in self.config.groups:
            refs: dict[int, int] = {}
            for seq in self.seqs.values():
                st = seq.groups[g.name]
                for b in st.held():
                    refs[b] = refs.get(b, 0) + 1
                if st.ring is not None and not {b for b in st.table if b >= 0} <= set(st.ring):
                    errs.append(f"group {g.name!r}: sequence {seq.seq_id!r} maps a block outside its ring")
            errs += self.pools[g.name].check(refs)
        return errs
