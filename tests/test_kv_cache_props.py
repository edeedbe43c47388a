"""Property tests of the KV block manager: random admit / step / fork / speculate+accept / abort / free
sequences (hypothesis draws each operation and its arguments) against a content model.

Every step "runs the kernel": each token's K/V is a code of its whole token prefix (what a real model's
K/V depends on), written at its slot in every group's caches (key, value and a PER_TOKEN scale cache).
After each write every live sequence must read back, through its block-table row, the code of its own
prefix at every position a query can still see. That catches writes into shared blocks, lost or wrong
copy-on-write copies, wrong prefix-cache hits, ring overruns and leaks; the pool bookkeeping is checked
against the references the sequences hold, and the pools are entirely free at the end.
"""

from __future__ import annotations

import zlib

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings

from pagedkit.runtime.kv.cache import KVCacheExhausted, KVCacheManager
from pagedkit.runtime.kv.config import GroupConfig, KVCacheConfig, LayerCacheSpec

BS, MAX_LEN, VOCAB = 16, 128, 3  # the smallest block size the contract allows


def code(prefix: list[int]) -> tuple[float, float, float]:
    """fp16/fp32-exact code of a token prefix: (low 11 bits, next 11 bits, low 24 bits) of its CRC."""
    c = zlib.crc32(bytes(prefix)) if prefix else 0
    return float(c & 2047), float((c >> 11) & 2047), float(c & 0xFFFFFF)


def layer(i):
    return LayerCacheSpec(i, 1, 8, cache_dtype="float16", key_scale_dtype="float32")


class KVModel:
    def __init__(self, window: int | None, prefix: bool):
        groups = [GroupConfig("full", 12, BS, (layer(0),))]
        if window is not None:
            groups.append(GroupConfig("win", 10, BS, (layer(1),), window=window, chunk_tokens=12))
        self.m = KVCacheManager(KVCacheConfig(tuple(groups), max_batch_size=4, max_num_tokens=96,
                                              max_seq_len=MAX_LEN, prefix_caching=prefix))
        self.tokens: dict[int, list[int]] = {}  # every token of the sequence (prompt included)
        self.known: dict[int, bool] = {}  # the manager was given token ids
        self.next_id = 0
        self.history: list[list[int]] = []  # token lists of freed sequences (prefix donors)

    # ---- the kernel's writes and the readers' view ----------------------------------------------------
    def _write(self, plan):
        t = 0
        writes = {g.name: ([], [], []) for g in self.m.config.groups}  # group -> (blocks, offsets, codes)
        for sid, past, n in zip(plan.seq_ids, plan.past_lens, plan.query_lens):
            for p in range(past, past + n):
                c = code(self.tokens[sid][: p + 1])
                for g in self.m.config.groups:
                    slot = plan.host_slots[g.name][t]
                    assert slot >= 0
                    blk, off = divmod(slot, BS)
                    assert self.m.pools[g.name].refcount[blk] == 1, f"write into shared block {blk} ({g.name})"
                    for lst, v in zip(writes[g.name], (blk, off, c)):
                        lst.append(v)
                t += 1
        for g in self.m.config.groups:  # one indexed write per tensor (slots are distinct: checked by _check_plan)
            blks, offs, codes = writes[g.name]
            if not blks:
                continue
            codes = torch.tensor(codes, dtype=torch.float64)
            for lay in g.layers:
                caches = self.m.caches[lay.layer_id]
                caches["key"][blks, offs, 0, :2] = codes[:, :2].to(caches["key"].dtype)
                caches["value"][blks, offs, 0, :2] = codes[:, [1, 0]].to(caches["value"].dtype)
                caches["key_scale"][blks, offs, 0] = codes[:, 2].to(caches["key_scale"].dtype)

    def _check_reads(self, plan=None):
        steps = {} if plan is None else {s: (p, n) for s, p, n in zip(plan.seq_ids, plan.past_lens, plan.query_lens)}
        views = {}  # group -> (key channels 0-1, key scale, value channel 0) as nested lists: fast reads
        for g in self.m.config.groups:
            caches = self.m.caches[g.layers[0].layer_id]
            views[g.name] = (caches["key"][:, :, 0, :2].float().tolist(), caches["key_scale"][:, :, 0].tolist(),
                             caches["value"][:, :, 0, 0].float().tolist())
        for sid, seq in self.m.seqs.items():
            past, n = steps.get(sid, (seq.length - seq.draft, seq.length - (seq.length - seq.draft)))
            end = past + n if sid in steps else seq.length
            for g in self.m.config.groups:
                row = self.m.block_table_row(sid, g.name)
                first = 0 if g.window is None else max(0, past - g.window + 1)
                keys, scales, values = views[g.name]
                for p in range(first, end):
                    blk = row[p // BS]
                    assert blk >= 0, f"seq {sid} position {p} unmapped in {g.name}"
                    c = code(self.tokens[sid][: p + 1])
                    got = (*keys[blk][p % BS], scales[blk][p % BS])
                    assert got == c, f"seq {sid} position {p} in {g.name}: read {got}, wrote {c}"
                    assert values[blk][p % BS] == c[1]

    def _check_plan(self, plan):
        for g in self.m.config.groups:
            slots = plan.host_slots[g.name]
            assert plan.slot_mappings[g.name].tolist() == slots
            assert len(set(slots)) == len(slots), "two tokens share a slot"
            rows = plan.block_tables[g.name].tolist()
            t = 0
            for b, (sid, past, n) in enumerate(zip(plan.seq_ids, plan.past_lens, plan.query_lens)):
                host_row = self.m.block_table_row(sid, g.name)
                assert rows[b][: len(host_row)] == host_row and set(rows[b][len(host_row) :]) <= {-1}
                for p in range(past, past + n):  # derived path == explicit slot mapping
                    assert slots[t] == rows[b][p // BS] * BS + p % BS
                    t += 1
        assert plan.cumulative_sequence_length.tolist()[-1] == plan.num_tokens

    def _snapshot(self):
        return ({s: (q.length, q.draft, [list(q.groups[g].table) for g in q.groups]) for s, q in self.m.seqs.items()},
                {g: p.available for g, p in self.m.pools.items()})

    def _run_step(self, batch, spec=None):
        before = self._snapshot()
        for sid, _ in batch:
            for g, pool in self.m.pools.items():
                row, past = self.m.block_table_row(sid, g), self.m.length(sid)
                if past // BS < len(row) and row[past // BS] >= 0 and pool.refcount[row[past // BS]] > 1:
                    event(f"copy-on-write ({g})")
                if g == "win" and past >= 3 * BS:
                    event("ring wrapped")
        try:
            plan = self.m.plan(batch)
        except KVCacheExhausted:
            event("pool exhausted")
            if spec is not None:
                self.m.seqs[spec].pending_draft = 0
            assert self._snapshot() == before, "a refused plan changed the manager"
            return None
        self._check_plan(plan)
        self._write(plan)
        self._check_reads(plan)
        self.m.commit(plan)
        return plan

    def _ready(self):
        return [s for s, q in self.m.seqs.items() if not q.draft]

    # ---- operations --------------------------------------------------------------------------------
    def ops(self):
        out = [self.admit] if len(self.m.seqs) < 6 else []
        if self._ready():
            out += [self.step, self.step, self.speculate, self.fork, self.abort]
        if self.m.seqs:
            out.append(self.free)
        return out

    def admit(self, data):
        length, give_ids = data.draw(st.integers(1, 80)), data.draw(st.booleans())
        sid, self.next_id = self.next_id, self.next_id + 1
        donors = self.history + [self.tokens[s] for s in self.tokens if self.known[s]]
        prompt = []
        if donors and data.draw(st.integers(0, 3)):  # mostly: share a prefix with an earlier sequence
            donor = data.draw(st.sampled_from(donors))
            prompt = donor[: data.draw(st.integers(0, len(donor)))]
        prompt = (prompt + data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=length, max_size=length)))[:length]
        hit = self.m.add_sequence(sid, prompt if give_ids else len(prompt))
        assert hit % BS == 0 and hit < len(prompt) and (give_ids or hit == 0)
        if hit:
            event("prefix hit")
        self.tokens[sid], self.known[sid] = prompt, give_ids
        self._check_reads()  # the hit blocks hold this prompt's prefix

    def step(self, data):
        ready = self._ready()
        chosen = data.draw(st.lists(st.sampled_from(ready), min_size=1, max_size=min(4, len(ready)), unique=True))
        batch, new_tokens, used = [], {}, 0
        for sid in chosen:
            seq = self.m.seqs[sid]
            cap = min(self.m.max_step_tokens(sid), 32, self.m.config.max_num_tokens - used)
            if cap < 1:
                continue
            pending = len(self.tokens[sid]) - seq.length
            if pending > 0:  # the rest of the prompt, in chunks
                n = data.draw(st.integers(1, min(pending, cap)))
                ids = self.tokens[sid][seq.length : seq.length + n]
            else:  # decode / append new tokens
                ids = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=min(24, cap)))
                new_tokens[sid] = ids
            used += len(ids)
            as_ids = self.known[sid] and (pending > 0 or data.draw(st.booleans()))
            batch.append((sid, list(ids) if as_ids else len(ids)))
            self.known[sid] = as_ids
        if not batch:
            return
        for sid, ids in new_tokens.items():
            self.tokens[sid] += ids
        if self._run_step(batch) is None:
            for sid, ids in new_tokens.items():
                del self.tokens[sid][-len(ids):]

    def speculate(self, data):
        k = data.draw(st.integers(1, 16))
        cands = [s for s in self._ready() if len(self.tokens[s]) == self.m.seqs[s].length
                 and self.m.max_step_tokens(s) >= k + 1]
        if not cands:
            return
        sid = data.draw(st.sampled_from(cands))
        ids = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=k + 1, max_size=k + 1))
        self.m.speculate(sid, k)
        self.tokens[sid] += ids
        if self._run_step([(sid, ids if self.known[sid] else k + 1)], spec=sid) is None:
            del self.tokens[sid][-(k + 1):]
            return
        accepted = data.draw(st.integers(0, k))
        event("drafts accepted" if accepted == k else "drafts rejected")
        self.m.accept(sid, accepted)
        del self.tokens[sid][len(self.tokens[sid]) - (k - accepted):]
        assert self.m.length(sid) == len(self.tokens[sid])
        self._check_reads()

    def fork(self, data):
        cands = [s for s in self._ready() if len(self.tokens[s]) == self.m.seqs[s].length]
        if not cands or len(self.m.seqs) >= 6:
            return
        parent = data.draw(st.sampled_from(cands))
        child, self.next_id = self.next_id, self.next_id + 1
        self.m.fork(parent, child)
        self.tokens[child], self.known[child] = list(self.tokens[parent]), self.known[parent]

    def abort(self, data):
        ready = [s for s in self._ready() if self.m.max_step_tokens(s) >= 1]
        if not ready:
            return
        sid = data.draw(st.sampled_from(ready))
        before = self._snapshot()
        try:
            plan = self.m.plan([(sid, 1)])
        except KVCacheExhausted:
            return
        self.m.abort(plan)
        (seqs0, avail0), (seqs1, avail1) = before, self._snapshot()
        for s, (length, draft, tables) in seqs0.items():  # a copy-on-write may have replaced a block
            assert seqs1[s][:2] == (length, draft)
            assert [[b < 0 for b in t] for t in seqs1[s][2]] == [[b < 0 for b in t] for t in tables]
        assert all(avail1[g] >= avail0[g] - 1 for g in avail0)

    def free(self, data):
        if not self.m.seqs:
            return
        sid = data.draw(st.sampled_from(sorted(self.m.seqs)))
        if self.m.seqs[sid].draft:
            return
        self.m.free(sid)
        if self.known[sid]:
            self.history.append(self.tokens[sid])
        del self.tokens[sid]

    def teardown(self):
        for sid in list(self.m.seqs):
            self.m.free(sid)
        self.m.clear_prefix_cache()
        for g, pool in self.m.pools.items():
            assert pool.available == pool.num_blocks and not pool.cached, f"group {g} leaked blocks"
        assert self.m.check_invariants() == []


@pytest.mark.parametrize("window, prefix", [(None, True), (20, False), (None, False)],
                         ids=["prefix-cached", "ring", "plain"])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_operations_keep_the_cache_consistent(window, prefix, data):
    model = KVModel(window, prefix)
    for _ in range(40):
        op = data.draw(st.sampled_from(model.ops()), label="op")
        op(data)
        assert model.m.check_invariants() == []
    model.teardown()
