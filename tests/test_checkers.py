"""The invariant checkers have teeth: KVCacheManager.check_invariants / BlockPool.check / Engine.check_invariants
report each corruption of a healthy state (a refcount off by one either way, a block twice in the free list, an
in-use block in the free list, a lost block, a block-table entry pointing at another sequence's block or at a
free block, an evictable cached block without its hash, a ring table entry outside the ring, the engine's
running list and the cache disagreeing), and say nothing on the healthy state itself.

The states are built through the manager's own API (prefix sharing, fork, evictable cached blocks, a windowed
ring), then one field is corrupted by hand. Teeth: BlockPool.check returning [] (or checking refcounts only), and
KVCacheManager.check_invariants returning [], make these tests fail.
"""

from __future__ import annotations

import pytest

from pagedkit.engine import SamplingParams
from pagedkit.runtime.kv import cache as cache_mod
from pagedkit.runtime.kv import pool as pool_mod
from pagedkit.runtime.kv.cache import KVCacheManager
from pagedkit.runtime.kv.config import GroupConfig, KVCacheConfig, LayerCacheSpec
from scripted_engine import ScriptedModel, continuation_script, scripted_engine

BS = 16


def healthy() -> KVCacheManager:
    """Three sequences: a and b share a's first 2 prompt blocks (prefix hit), c is a fork of a (every block
    shared); d was freed, so its full blocks are evictable in the prefix cache; blocks 10+ are free."""
    g = GroupConfig("full", 16, BS, (LayerCacheSpec(0, 2, 8),))
    m = KVCacheManager(KVCacheConfig((g,), max_batch_size=4, max_num_tokens=256, max_seq_len=256, prefix_caching=True))
    a = list(range(3, 3 + 40))
    m.add_sequence("a", a)
    m.commit(m.plan([("a", a)]))
    b = a[:32] + [90, 91, 92]
    assert m.add_sequence("b", b) == 32
    m.commit(m.plan([("b", b[32:])]))
    m.fork("a", "c")
    d = list(range(100, 100 + 33))
    m.add_sequence("d", d)
    m.commit(m.plan([("d", d)]))
    m.free("d")
    assert m.check_invariants() == []
    pool = m.pools["full"]
    assert max(pool.refcount) >= 3 and len(pool.evictable) == 2 and pool.free
    return m


def _used(m, refs):
    return next(b for b in range(m.pools["full"].num_blocks) if m.pools["full"].refcount[b] == refs)


def _refcount_up(m):
    m.pools["full"].refcount[_used(m, 1)] += 1


def _refcount_down(m):
    m.pools["full"].refcount[_used(m, 3)] -= 1


def _twice_free(m):
    m.pools["full"].free.append(m.pools["full"].free[0])


def _used_in_free_list(m):
    m.pools["full"].free.append(_used(m, 1))


def _lost_block(m):
    m.pools["full"].free.popleft()


def _table_to_other_sequence(m):
    m.seqs["b"].groups["full"].table[2] = m.seqs["a"].groups["full"].table[2]  # b's private block -> a's


def _table_to_free_block(m):
    m.seqs["b"].groups["full"].table[2] = m.pools["full"].free[0]


def _evictable_without_hash(m):
    pool = m.pools["full"]
    b = next(iter(pool.evictable))
    del pool.cached[pool.hash_of.pop(b)]


def _hash_maps_disagree(m):
    pool = m.pools["full"]
    h = next(iter(pool.cached))
    pool.cached[h] = pool.free[0]


CORRUPTIONS = {  # name: (corrupt, a phrase the report must hold)
    "refcount one too many": (_refcount_up, "refcount 2, sequences hold 1"),
    "refcount one too few": (_refcount_down, "refcount 2, sequences hold 3"),
    "block twice in the free list": (_twice_free, "twice in the free list"),
    "in-use block in the free list": (_used_in_free_list, "is in 2 states"),
    "lost block": (_lost_block, "is in 0 states"),
    "table entry -> another sequence's block": (_table_to_other_sequence, "sequences hold"),
    "table entry -> a free block": (_table_to_free_block, "refcount 0, sequences hold 1"),
    "evictable block without its hash": (_evictable_without_hash, "evictable block"),
    "hash map and block map disagree": (_hash_maps_disagree, "disagree"),
}


def check_corruptions(names=tuple(CORRUPTIONS)):
    for name in names:
        corrupt, phrase = CORRUPTIONS[name]
        m = healthy()
        corrupt(m)
        errs = m.check_invariants()
        assert errs, f"{name}: check_invariants() reported nothing"
        assert any(phrase in e for e in errs), f"{name}: {errs} does not say {phrase!r}"


def test_manager_checker_reports_each_corruption():
    check_corruptions()


def test_block_pool_check_directly():
    """BlockPool.check against the references the caller counts: a refcount off by one is reported by block."""
    pool = pool_mod.BlockPool("g", 4)
    a, b = pool.allocate(), pool.allocate()
    pool.incref(b)
    assert pool.check({a: 1, b: 2}) == []
    assert pool.check({a: 1, b: 1}) == ["group 'g': block 1 refcount 2, sequences hold 1"]
    assert pool.check({a: 1, b: 2, 2: 1}) == ["group 'g': block 2 refcount 0, sequences hold 1"]


def _windowed_manager():
    full = GroupConfig("full", 16, BS, (LayerCacheSpec(0, 2, 8),))
    win = GroupConfig("win", 16, BS, (LayerCacheSpec(1, 2, 8),), window=32, chunk_tokens=16)
    m = KVCacheManager(KVCacheConfig((full, win), max_batch_size=2, max_num_tokens=256, max_seq_len=256))
    m.add_sequence("a", 100)
    for _ in range(6):
        m.commit(m.plan([("a", 16)]))
    assert m.check_invariants() == []
    return m


def test_ring_table_entry_outside_the_ring_is_reported():
    m = _windowed_manager()
    st = m.seqs["a"].groups["win"]
    live = max(i for i, b in enumerate(st.table) if b >= 0)
    outside = next(b for b in range(16) if b not in st.ring)
    st.table[live] = outside
    errs = m.check_invariants()
    assert any("maps a block outside its ring" in e for e in errs), f"ring: {errs} does not name the ring entry"


def test_engine_checker_reports_running_and_cache_disagreeing():
    engine = scripted_engine(max_batch_size=4, max_num_tokens=64)
    ScriptedModel(engine, continuation_script({(1, 9): [5] * 10}))
    engine.add_request([1, 9], SamplingParams(max_new_tokens=10, ignore_eos=True), request_id="r")
    engine.step()
    assert engine.check_invariants() == []
    kept = engine.running.pop()  # the engine forgets a request the cache still holds
    errs = engine.check_invariants()
    assert any("the engine runs" in e for e in errs), errs
    engine.running.append(kept)
    engine.kv.pools["full"].refcount[engine.kv.block_table_row("r", "full")[0]] += 1
    assert any("refcount 2, sequences hold 1" in e for e in engine.check_invariants())


# ---- teeth ------------------------------------------------------------------------------------------------------

def test_teeth_pool_check_returning_nothing(monkeypatch):
    monkeypatch.setattr(pool_mod.BlockPool, "check", lambda self, refs: [])
    with pytest.raises(AssertionError, match="reported nothing"):
        check_corruptions()
    for name in CORRUPTIONS:  # every one of them is caught by BlockPool.check alone
        with pytest.raises(AssertionError, match="reported nothing"):
            check_corruptions([name])


def test_teeth_pool_check_of_refcounts_only(monkeypatch):
    """A checker that compares refcounts but not the free / evictable / used states misses the list corruptions."""
    def refcounts_only(self, refs):
        return [f"group {self.group!r}: block {b} refcount {self.refcount[b]}, sequences hold {refs.get(b, 0)}"
                for b in range(self.num_blocks) if self.refcount[b] != refs.get(b, 0)]

    monkeypatch.setattr(pool_mod.BlockPool, "check", refcounts_only)
    check_corruptions(["refcount one too many", "refcount one too few"])
    for name in ("block twice in the free list", "in-use block in the free list", "lost block",
                 "evictable block without its hash"):
        with pytest.raises(AssertionError):
            check_corruptions([name])


def test_teeth_manager_checker_returning_nothing(monkeypatch):
    monkeypatch.setattr(cache_mod.KVCacheManager, "check_invariants", lambda self: [])
    with pytest.raises(AssertionError, match="reported nothing"):
        check_corruptions(["refcount one too many"])
    with pytest.raises(AssertionError):
        test_ring_table_entry_outside_the_ring_is_reported()
    with pytest.raises(AssertionError):
        test_engine_checker_reports_running_and_cache_disagreeing()


def test_teeth_ring_check_dropped(monkeypatch):
    """check_invariants without its ring test (BlockPool.check alone) misses a table entry outside the ring."""
    def pools_only(self):
        errs = []
        for g in self.config.groups:
            refs = {}
            for seq in self.seqs.values():
                for b in seq.groups[g.name].held():
                    refs[b] = refs.get(b, 0) + 1
            errs += self.pools[g.name].check(refs)
        return errs

    monkeypatch.setattr(cache_mod.KVCacheManager, "check_invariants", pools_only)
    with pytest.raises(AssertionError, match="does not name the ring entry"):
        test_ring_table_entry_outside_the_ring_is_reported()
