"""Edges of the KV block manager the main tests leave implicit (issue 36: mutation survivors of runtime/kv):
padded plans (pad_to / pad_block), set_tokens, the invariant checks catching corruption in every group, the
config checks' messages, ring sizes, copy-on-write / fresh / recycle in a ring, copy_ranges merging, the plan
buffer layout and the prefix-cache hash."""

from __future__ import annotations

import hashlib
import re
import struct

import pytest
import torch

from pagedkit.runtime.kv.cache import KVCacheManager
from pagedkit.runtime.kv.config import DEFAULT_NAMES, PRESENT_NAMES, GroupConfig, KVCacheConfig, LayerCacheSpec
from pagedkit.runtime.kv.plan import copy_ranges
from pagedkit.runtime.kv.pool import BlockPool, block_hash


def layer(i, **kw):
    return LayerCacheSpec(i, kw.pop("kv_num_heads", 2), kw.pop("head_size", 8), **kw)


def config(num_blocks=16, bs=16, window=None, chunk=1, layers=None, **kw):
    groups = [GroupConfig("full", num_blocks, bs, tuple(layers or (layer(0), layer(1))))]
    if window is not None:
        groups.append(GroupConfig("win", num_blocks, bs, (layer(2),), window=window, chunk_tokens=chunk))
    kw.setdefault("max_batch_size", 4)
    kw.setdefault("max_num_tokens", 256)
    kw.setdefault("max_seq_len", 256)
    return KVCacheConfig(tuple(groups), **kw)


def manager(**kw):
    return KVCacheManager(config(**kw))


# ---- padded plans (CUDA-graph batch buckets) ---------------------------------------------------------------

def test_padded_plan_rows_are_one_token_no_past_on_the_pad_block():
    nb, bs = 8, 16
    m = manager(num_blocks=nb, bs=bs, pad_block=True, max_seq_len=64)  # 4 blocks per table row
    assert m.caches[0]["key"].shape[0] == nb + 1  # the pad block: index nb, never in the pool
    for s, n in (("a", 20), ("b", 5), ("c", 3)):
        m.add_sequence(s, n)
    m.commit(m.plan([("a", 20), ("b", 5), ("c", 3)]))
    m.commit(m.plan([("a", 1), ("b", 1), ("c", 1)]))  # every row of the buffers now holds a non-zero past
    ra = m.block_table_row("a", "full")
    p = m.plan([("a", 2)], pad_to=3)  # one sequence, two pad rows after it
    assert p.seq_ids == ("a",) and p.query_lens == (2,) and p.past_lens == (21,) and p.pad_rows == 2
    assert p.cumulative_sequence_length.tolist() == [0, 2, 3, 4]  # pad rows: one token each
    assert p.past_seqlens.tolist() == [21, 0, 0]  # pad rows: no past (the last plan's rows overwritten)
    assert p.query_positions.tolist() == [21, 22, 0, 0]
    assert p.block_tables["full"].tolist() == [ra + [-1] * (4 - len(ra)), [nb, -1, -1, -1], [nb, -1, -1, -1]]
    assert p.slot_mappings["full"].tolist() == [ra[1] * bs + 5, ra[1] * bs + 6, nb * bs, nb * bs]
    assert p.host_slots["full"] == [ra[1] * bs + 5, ra[1] * bs + 6]  # host facts: the batch's only
    assert p.attention_metadata.tolist() == [2, 23, 23]
    free = m.num_free_blocks("full")
    m.commit(p)
    assert m.length("a") == 23 and m.num_free_blocks("full") == free and m.check_invariants() == []
    # a bucket as wide as max_batch_size is allowed
    p = m.plan([("b", 1), ("c", 1)], pad_to=4)
    assert p.cumulative_sequence_length.tolist() == [0, 1, 2, 3, 4] and p.past_seqlens.tolist() == [6, 4, 0, 0]
    assert p.block_tables["full"].shape == (4, 4) and p.pad_rows == 2
    m.commit(p)
    m.commit(m.plan([("c", 1), ("b", 1), ("a", 1)]))  # row 2 holds a's two-block row, cu / past non-zero
    rb, ra = m.block_table_row("b", "full"), m.block_table_row("a", "full")
    p = m.plan([("a", 2), ("b", 3)], pad_to=3)  # two sequences, one pad row where a's row was
    assert p.cumulative_sequence_length.tolist() == [0, 2, 5, 6] and p.past_seqlens.tolist() == [24, 8, 0]
    assert p.block_tables["full"].tolist() == [ra + [-1] * (4 - len(ra)), rb + [-1] * (4 - len(rb)),
                                               [nb, -1, -1, -1]]
    assert p.slot_mappings["full"].tolist()[5:] == [nb * bs] and p.query_positions.tolist()[5:] == [0]
    m.commit(p)
    p = m.plan([("a", 1), ("b", 1)], pad_to=2)  # a full bucket: no pad rows
    assert p.pad_rows == 0 and p.cumulative_sequence_length.tolist() == [0, 1, 2]
    assert p.block_tables["full"].shape == (2, 4) and nb not in p.block_tables["full"].tolist()[1]
    m.commit(p)
    assert m.check_invariants() == []


def test_padded_plan_errors_name_the_problem():
    m = manager(pad_block=False)
    m.add_sequence("a", 4)
    with pytest.raises(ValueError, match=r"pad_to needs KVCacheConfig.pad_block=True"):
        m.plan([("a", 4)], pad_to=2)
    m = manager(pad_block=True, max_batch_size=4, max_num_tokens=8)
    for s in "abc":
        m.add_sequence(s, 8)
    with pytest.raises(ValueError, match=r"pad_to should be in \[2, 4\] .* got 5"):
        m.plan([("a", 1), ("b", 1)], pad_to=5)
    with pytest.raises(ValueError, match=r"pad_to should be in \[2, 4\] .* got 1"):
        m.plan([("a", 1), ("b", 1)], pad_to=1)
    with pytest.raises(ValueError, match=r"plan: 9 tokens in the step \(pad rows included\), beyond max_num_tokens 8"):
        m.plan([("a", 6)], pad_to=4)  # 6 + 3 pad rows
    m.abort(m.plan([("a", 6)], pad_to=3))  # 6 + 2 pad rows: exactly max_num_tokens
    with pytest.raises(ValueError, match=r"plan: 9 tokens in the step, beyond max_num_tokens 8"):
        m.plan([("a", 5), ("b", 4)])
    with pytest.raises(ValueError, match=r"plan: batch size should be in \[1, 4\], got 0"):
        m.plan([])
    assert m.check_invariants() == []


# ---- set_tokens ---------------------------------------------------------------------------------------------

def test_set_tokens_replaces_placeholder_ids_and_the_prefix_cache_sees_them():
    bs = 16
    ids = list(range(100, 115))  # 15 tokens: the next one completes block 0
    m = manager(bs=bs, prefix_caching=True)
    m.add_sequence("a", ids)
    m.commit(m.plan([("a", ids)]))
    p = m.plan([("a", [0])])  # planned with a placeholder id (the overlapped decode)
    with pytest.raises(ValueError, match=r"set_tokens: positions \[15, 17\) of sequence 'a' .* \(\[0, 16\)\)"):
        m.set_tokens("a", 15, [7, 8])  # one beyond the recorded ids
    with pytest.raises(ValueError, match=r"positions \[16, 17\)"):
        m.set_tokens("a", 16, [7])
    m.set_tokens("a", 15, [42])
    m.commit(p)
    assert m.add_sequence("b", ids + [0, 5]) == 0  # the placeholder never entered the cache
    assert m.add_sequence("c", ids + [42, 5]) == 16  # block 0 was hashed with the id set
    with pytest.raises(ValueError, match=r"positions \[3, 4\) .* \(\[16, 16\)\)"):
        m.set_tokens("a", 3, [1])  # block 0 is hashed: its ids are fixed
    m.set_tokens("a", 16, [])  # empty range at the end: nothing to do
    m2 = manager(bs=bs)  # ids unknown (counts only): a no-op
    m2.add_sequence("a", 3)
    m2.set_tokens("a", 0, [1, 2, 3, 4, 5])


def test_a_step_may_be_all_drafts_but_not_fewer_tokens_than_declared():
    m = manager()
    m.add_sequence("a", 4)
    m.commit(m.plan([("a", 4)]))
    m.speculate("a", 3)
    with pytest.raises(ValueError, match=r"plan: sequence 'a' declared 3 drafts but the step has 2 tokens"):
        m.plan([("a", 2)])
    p = m.plan([("a", 3)])
    assert p.draft_lens == (3,)
    m.commit(p)
    m.accept("a", 1)
    assert m.length("a") == 5 and m.check_invariants() == []


# ---- invariant checks --------------------------------------------------------------------------------------

@pytest.mark.parametrize("group", ["full", "win"])
def test_check_invariants_catches_a_refcount_corruption_in_every_group(group):
    m = manager(window=32, bs=16)
    m.add_sequence("a", 40)
    m.commit(m.plan([("a", 40)]))
    assert m.check_invariants() == []
    b = m.block_table_row("a", group)[0]
    m.pools[group].refcount[b] += 1
    errs = m.check_invariants()
    assert errs == [f"group {group!r}: block {b} refcount 2, sequences hold 1"]


def test_check_invariants_catches_a_table_entry_outside_the_ring():
    m = manager(window=32, bs=16)
    for s in ("x", "a"):
        m.add_sequence(s, 20)
    m.commit(m.plan([("x", 20), ("a", 20)]))
    assert m.block_table_row("x", "win") == [0, 1] and m.check_invariants() == []
    m.seqs["a"].groups["win"].table[0] = 0  # x's block 0: outside a's ring
    assert m.check_invariants() == ["group 'win': sequence 'a' maps a block outside its ring"]


def test_block_pool_check_names_each_corruption():
    pool = BlockPool("g", 4)
    assert pool.check({}) == []
    b = pool.allocate()
    assert b == 0 and pool.check({0: 1}) == []
    assert pool.check({}) == ["group 'g': block 0 refcount 1, sequences hold 0"]
    pool.free.append(0)  # in use and free
    assert pool.check({0: 1}) == ["group 'g': block 0 is in 2 states (free/evictable/used)"]
    pool.free.pop()
    pool.free.append(1)  # twice in the free list
    assert pool.check({0: 1}) == ["group 'g': a block is twice in the free list"]
    pool.free.pop()
    pool.free.remove(1)  # in no state at all
    assert pool.check({0: 1}) == ["group 'g': block 1 is in 0 states (free/evictable/used)"]
    pool.free.appendleft(1)
    pool.register(0, b"h0")
    pool.decref(0)  # cached: evictable, not free
    assert list(pool.evictable) == [0] and 0 not in pool.free and pool.check({}) == []
    pool.hash_of[0] = b"other"  # the two maps disagree
    assert pool.check({}) == ["group 'g': hash map and block map disagree on block 0"]
    del pool.hash_of[0]
    assert "group 'g': evictable block 0 has no hash" in pool.check({})


def test_block_pool_refuses_double_release_and_incref_of_a_free_block():
    pool = BlockPool("g", 2)
    b = pool.allocate()
    pool.incref(b)
    pool.decref(b)
    pool.decref(b)
    assert pool.refcount[b] == 0 and list(pool.free) == [1, b]
    with pytest.raises(AssertionError, match=f"group 'g': block {b} released more often than referenced"):
        pool.decref(b)
    with pytest.raises(AssertionError, match=f"incref of block {b} that is neither used nor cached"):
        pool.incref(b)
    assert pool.refcount == [0, 0] and pool.check({}) == []


# ---- configuration checks ------------------------------------------------------------------------------------

@pytest.mark.parametrize("make, needle", [
    (lambda: config(num_blocks=0), r"group 'full': num_blocks should be >= 1, got 0"),
    (lambda: config(layers=(layer(0, value_scale_dtype="float64"),)),
     r"layer 0: value_scale_dtype should be one of \['float16', 'float32'\] \(T_SCALE_CACHE\), got 'float64'"),
    (lambda: config(layers=(layer(0, key_scale_dtype="float16", value_scale_dtype="int8"),)),
     r"layer 0: value_scale_dtype should be one of"),
    (lambda: config(layers=(layer(0, kv_num_heads=0),)), r"layer 0: kv_num_heads and head_size should be >= 1, got 0, 8"),
    (lambda: config(layers=(layer(0, head_size=0),)), r"kv_num_heads and head_size should be >= 1, got 2, 0"),
    (lambda: config(layers=(LayerCacheSpec(0, 1, 8, latent=True, value_scale_dtype="float16"),)),
     r"a LATENT layer has no value cache, so value_scale_dtype should be None"),
    (lambda: config(window=0), r"group 'win': window should be >= 1 \(local_window_size\), got 0"),
    (lambda: config(window=16, chunk=0), r"group 'win': chunk_tokens should be >= 1, got 0"),
    (lambda: KVCacheConfig((GroupConfig("g", 4, 16, ()),), 1, 1, 1), r"group 'g': has no layers"),
    (lambda: KVCacheConfig((), 1, 1, 1), r"KVCacheConfig has no groups"),
    (lambda: config(max_batch_size=0), r"KVCacheConfig.max_batch_size should be >= 1, got 0"),
    (lambda: config(max_num_tokens=0), r"KVCacheConfig.max_num_tokens should be >= 1, got 0"),
    (lambda: config(max_seq_len=0), r"KVCacheConfig.max_seq_len should be >= 1, got 0"),
    (lambda: KVCacheConfig((GroupConfig("g", 4, 16, (layer(0),)), GroupConfig("g", 4, 16, (layer(1),),
                                                                               table_name="t2")), 1, 1, 16),
     r"group name 'g' is used twice"),
    (lambda: KVCacheConfig((GroupConfig("g", 4, 16, (layer(0),)), GroupConfig("h", 4, 16, (layer(1),))), 1, 1, 16),
     r"group 'h': block table name 'block_table' is used by another group"),
    (lambda: KVCacheConfig((GroupConfig("g", 4, 16, (layer(0),)),
                            GroupConfig("h", 4, 32, (layer(1),), table_name="t2", slot_mapping_name="s2")),
                           1, 1, 64, prefix_caching=True),
     r"prefix_caching needs one block_size across groups .* \{'g': 16, 'h': 32\}"),
])
def test_more_config_errors_name_the_problem(make, needle):
    cfg = make()
    errs = cfg.check()
    assert any(re.search(needle, e) for e in errs), errs
    with pytest.raises(ValueError, match=needle):
        KVCacheManager(cfg)


def test_smallest_valid_configuration_values_pass_the_checks():
    assert LayerCacheSpec(0, 1, 1).check() == []
    assert GroupConfig("g", 1, 16, (layer(0),)).check() == []  # one block
    assert GroupConfig("w", 2, 16, (layer(0),), window=1).check() == []  # window 1: a ring of exactly 2 blocks
    assert GroupConfig("w", 4, 16, (layer(0),), window=32, chunk_tokens=16).check() == []  # ring of exactly 4
    assert KVCacheConfig((GroupConfig("g", 1, 16, (layer(0),)),), max_batch_size=1, max_num_tokens=1,
                         max_seq_len=1).check() == []
    assert LayerCacheSpec(0, 2, 8, key_scale_dtype="float16", value_scale_dtype="float16").check() == []


def test_windowed_group_with_fewer_blocks_than_its_ring_is_refused():
    assert GroupConfig("w", 3, 16, (layer(0),), window=32, chunk_tokens=16).check() == [
        "group 'w': num_blocks 3 cannot hold one sequence's ring of 4 blocks (window 32, chunk_tokens 16)"]
    assert GroupConfig("w", 1, 16, (layer(0),), window=1).check() == [
        "group 'w': num_blocks 1 cannot hold one sequence's ring of 2 blocks (window 1, chunk_tokens 1)"]
    assert GroupConfig("w", 0, 16, (layer(0),), window=1).check() == [
        "group 'w': num_blocks should be >= 1, got 0"]  # said once


def test_scale_dtypes_must_be_spelled_as_the_docs_say():
    """ONNX spellings of an allowed type ('float', 'tensor(float16)') are refused: the cache tensors are built from
    the numpy / torch names float16 / float32."""
    for sd in ("float", "tensor(float16)", "half"):
        errs = LayerCacheSpec(0, 2, 8, key_scale_dtype=sd, value_scale_dtype=sd).check()
        assert errs[:2] == [f"layer 0: {side} should be one of ['float16', 'float32'] (T_SCALE_CACHE), got {sd!r}"
                            for side in ("key_scale_dtype", "value_scale_dtype")], (sd, errs)


def test_value_scale_dtype_is_checked_when_the_key_has_no_scale():
    assert LayerCacheSpec(0, 2, 8, value_scale_dtype="float32").check() == []
    assert LayerCacheSpec(0, 2, 8, value_scale_dtype="float64").check() == [
        "layer 0: value_scale_dtype should be one of ['float16', 'float32'] (T_SCALE_CACHE), got 'float64'"]
    assert LayerCacheSpec(0, 2, 8, key_scale_dtype="int8", value_scale_dtype="bfloat16").check() == [
        "layer 0: key_scale_dtype should be one of ['float16', 'float32'] (T_SCALE_CACHE), got 'int8'",
        "layer 0: value_scale_dtype should be one of ['float16', 'float32'] (T_SCALE_CACHE), got 'bfloat16'",
        "layer 0: key_scale_dtype and value_scale_dtype should be equal (one T_SCALE_CACHE type), got 'int8' and "
        "'bfloat16'"]


@pytest.mark.parametrize("label", ["names", "present_names"])
@pytest.mark.parametrize("kind", sorted(DEFAULT_NAMES))
@pytest.mark.parametrize("bad", ["cache.key", "cache.%d.%d", None])
def test_cache_name_templates_are_checked_for_every_kind(label, kind, bad):
    table = dict(DEFAULT_NAMES if label == "names" else PRESENT_NAMES)
    if bad is None:
        del table[kind]
    else:
        table[kind] = bad
    cfg = config(**{label: table})
    want = f"KVCacheConfig.{label}[{kind!r}] should be a name template with exactly one '%d' for the layer index, " \
           f"got {bad!r}"
    assert cfg.check() == [want]
    with pytest.raises(ValueError, match=re.escape(want)):
        KVCacheManager(cfg)


# ---- rings ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("window, chunk, bs, n", [
    (16, 1, 16, 2),  # W = BS: ceil(16 / 16) + 1
    (17, 1, 16, 3),
    (1, 1, 16, 2),
    (24, 1, 16, 3),
    (32, 16, 16, 4),  # ceil(47 / 16) + 1
    (16, 17, 16, 3),  # ceil(32 / 16) + 1: W + chunk - 1 a multiple of BS
    (64, 1, 32, 3),
])
def test_ring_blocks_is_the_design_formula(window, chunk, bs, n):
    g = GroupConfig("win", 64, bs, (layer(0),), window=window, chunk_tokens=chunk)
    assert g.ring_blocks == n  # N = ceil((W + chunk - 1) / BS) + 1, by hand


def test_a_ring_of_two_blocks_serves_a_window_of_one_block():
    bs = 16
    m = manager(window=bs, bs=bs, max_seq_len=256)
    assert m.config.group("win").ring_blocks == 2
    m.add_sequence("a", 200)
    m.commit(m.plan([("a", 1)]))
    while m.length("a") < 200:
        m.commit(m.plan([("a", 1)]))
        assert m.num_free_blocks("win") == 16 - min(2, -(-m.length("a") // bs)) and m.check_invariants() == []
    with pytest.raises(ValueError, match="is not windowed; it has no ring"):
        m.config.group("full").ring_blocks


def test_ring_fork_copies_a_shared_live_block_and_replaces_a_shared_dead_one():
    """GroupBlocks.apply in a ring: "cow" (shared live block: new block, content copied), "fresh" (shared dead
    block: new block, the shared one dropped), "recycle" (private dead block: overwritten in place)."""
    bs, W = 16, 32  # ring of ceil(32 / 16) + 1 = 3 blocks
    m = manager(window=W, bs=bs, num_blocks=8)
    pool = m.pools["win"]
    m.add_sequence("a", 100)
    m.commit(m.plan([("a", 40)]))  # blocks 0, 1, 2 in ring slots 0, 1, 2
    a0, a1, a2 = m.block_table_row("a", "win")
    gen = torch.Generator().manual_seed(1)
    for t in m.caches[2].values():
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    before = {k: t.clone() for k, t in m.caches[2].items()}
    m.fork("a", "b")
    assert [pool.refcount[x] for x in (a0, a1, a2)] == [2, 2, 2]
    p = m.plan([("b", 1)])  # position 40: block 2, shared and live: copy on write
    b2 = m.block_table_row("b", "win")[2]
    assert b2 not in (a0, a1, a2) and p.slot_mappings["win"].tolist() == [b2 * bs + 8]
    for k, t in m.caches[2].items():
        assert torch.equal(t[b2], before[k][a2]) and torch.equal(t[a2], before[k][a2]), k
    m.commit(p)
    assert pool.refcount[a2] == 1 and m.block_table_row("b", "win") == [a0, a1, b2]
    m.commit(m.plan([("b", 7)]))  # to 48: block 0 leaves the window of the next query
    assert m.block_table_row("b", "win") == [-1, a1, b2]
    p = m.plan([("b", 1)])  # block 3 -> slot 0, which holds block 0: dead and shared with a: fresh
    b3 = m.block_table_row("b", "win")[3]
    assert b3 not in (a0, a1, a2, b2) and pool.refcount[a0] == 1
    assert p.slot_mappings["win"].tolist() == [b3 * bs]
    m.commit(p)
    assert m.check_invariants() == []
    m.commit(m.plan([("a", 8)]))  # a to 48
    p = m.plan([("a", 1)])  # block 3 -> slot 0 holding a's private dead block 0: recycled in place
    assert m.block_table_row("a", "win") == [-1, a1, a2, a0] and p.slot_mappings["win"].tolist() == [a0 * bs]
    m.commit(p)
    m.free("a")
    m.free("b")
    assert m.num_free_blocks("win") == 8 and m.check_invariants() == []


# ---- plan buffers and copies -----------------------------------------------------------------------------------

def test_copy_ranges_measures_the_gap_from_the_last_range():
    assert copy_ranges([(0, 1), (10000, 1), (10002, 1)]) == [(0, 1), (10000, 3)]  # MERGE_GAP 4096
    assert copy_ranges([(103, 1), (0, 2), (100, 2)], gap=10) == [(0, 2), (100, 4)]
    assert copy_ranges([(0, 2), (100, 2), (200, 2)], gap=97) == [(0, 2), (100, 2), (200, 2)]
    assert copy_ranges([(0, 2), (100, 2), (200, 2)], gap=98) == [(0, 202)]
    assert copy_ranges([(0, 10), (2, 3)], gap=0) == [(0, 10)]  # a span inside the previous one


def test_plan_buffer_segments_are_sized_to_capacity_and_contiguous():
    cfg = config(window=32, bs=16, max_batch_size=3, max_num_tokens=40, max_seq_len=100)  # 7 blocks per row
    buf = KVCacheManager(cfg).buffers
    want = [("cu", (4,)), ("past", (3,)), (("table", "full"), (3, 7)), (("table", "win"), (3, 7)), ("qpos", (40,)),
            (("slots", "full"), (40,)), (("slots", "win"), (40,))]
    assert list(buf.shapes.items()) == want
    off = 0
    for key, shape in want:
        assert buf.offsets[key] == off, key
        off += shape[0] * (shape[1] if len(shape) > 1 else 1)
    assert buf.total == off == 4 + 3 + 21 + 21 + 40 * 3 and buf.dev.shape == (off,)
    assert not buf.on_cuda


# ---- prefix-cache key ----------------------------------------------------------------------------------------

def test_block_hash_is_blake2b_128_over_the_parent_key_and_int64_ids():
    """The prefix-cache key must stay stable (caches outlive code changes in a long-running server; two managers
    must agree): BLAKE2b, 16-byte digest, over the parent's key (b"root" for block 0) and little-endian int64 ids."""
    ids0, ids1 = list(range(16)), list(range(16, 32))
    h0 = block_hash(None, ids0)
    want0 = hashlib.blake2b(b"root" + struct.pack("<16q", *ids0), digest_size=16).digest()
    assert h0 == want0 and len(h0) == 16
    assert h0.hex() == "8a9ef9c3f41c4f8122b59026a261af91"
    h1 = block_hash(h0, ids1)
    assert h1 == hashlib.blake2b(h0 + struct.pack("<16q", *ids1), digest_size=16).digest()
    assert h1.hex() == "20a5a51262a63ba3dd2edf39353c4cee"
    assert block_hash(None, ids1) != h1  # the parent is part of the key
