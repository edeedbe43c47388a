"""Unit tests of the KV block manager (pagedkit.runtime.kv.cache): allocation, plans, prefix cache,
copy-on-write, rings, speculation, errors."""

from __future__ import annotations

import math

import pytest
import torch

from pagedkit.runtime.kv.cache import KVCacheExhausted, KVCacheManager
from pagedkit.runtime.kv.config import GroupConfig, KVCacheConfig, LayerCacheSpec


def layer(i, **kw):
    return LayerCacheSpec(i, kw.pop("kv_num_heads", 2), kw.pop("head_size", 8), **kw)


def manager(num_blocks=16, bs=16, window=None, prefix=False, layers=None, **kw):
    groups = [GroupConfig("full", num_blocks, bs, tuple(layers or (layer(0), layer(1))))]
    if window is not None:
        groups.append(GroupConfig("win", num_blocks, bs, (layer(2),), window=window, chunk_tokens=kw.pop("chunk", 1)))
    cfg = KVCacheConfig(tuple(groups), max_batch_size=kw.pop("max_batch", 4), max_num_tokens=kw.pop("max_tokens", 256),
                        max_seq_len=kw.pop("max_seq_len", 256), prefix_caching=prefix, **kw)
    return KVCacheManager(cfg)


def derived_slots(plan, group, bs):
    """The derived write path: block_table[b][p // bs] * bs + p % bs for each token of the plan."""
    table = plan.block_tables[group].tolist()
    out = []
    for b, (past, n) in enumerate(zip(plan.past_lens, plan.query_lens)):
        for p in range(past, past + n):
            blk = table[b][p // bs]
            out.append(blk * bs + p % bs if blk >= 0 else -1)
    return out


# ---- configuration and tensors ----------------------------------------------------------------------

def test_cache_tensors_shapes_dtypes_and_names():
    layers = (
        layer(0, cache_dtype="float16"),
        layer(1, cache_dtype="int4", head_size=10, key_scale_dtype="float32", value_scale_dtype="float32"),
        layer(2, cache_dtype="float8e4m3fn", kv_num_heads=3),
        LayerCacheSpec(3, 1, 24, cache_dtype="bfloat16", latent=True, key_scale_dtype="float32"),
    )
    m = manager(num_blocks=5, bs=16, layers=layers)
    feeds = m.cache_feeds()
    assert feeds["past_key_values.0.key"].shape == (5, 16, 2, 8) and feeds["past_key_values.0.key"].dtype == torch.float16
    assert feeds["past_key_values.1.value"].shape == (5, 16, 2, 5) and feeds["past_key_values.1.value"].dtype == torch.uint8
    assert feeds["past_key_values.1.key_scale"].shape == (5, 16, 2)
    assert feeds["past_key_values.1.key_scale"].dtype == torch.float32
    assert feeds["past_key_values.1.value_scale"].dtype == torch.float32
    assert feeds["past_key_values.2.key"].dtype == torch.float8_e4m3fn and feeds["past_key_values.2.key"].shape[2] == 3
    assert "past_key_values.3.value" not in feeds and feeds["past_key_values.3.key"].shape == (5, 16, 1, 24)
    assert "past_key_values.3.key_scale" in feeds
    present = m.cache_feeds(present=True)
    assert present["present.1.key_scale"] is feeds["past_key_values.1.key_scale"]  # outputs alias inputs
    assert len(present) == len(feeds) == 2 + 4 + 2 + 2


@pytest.mark.parametrize("kw, needle", [
    (dict(layers=(layer(0, cache_dtype="int16"),)), "cache_dtype"),
    (dict(layers=(layer(0, key_scale_dtype="float64"),)), "key_scale_dtype"),
    (dict(layers=(layer(0, key_scale_dtype="float16", value_scale_dtype="float32"),)), "should be equal"),
    (dict(layers=(LayerCacheSpec(0, 2, 8, latent=True),)), "LATENT layer should have kv_num_heads == 1"),
    (dict(layers=(layer(0), layer(0))), "layer 0 is in groups"),
    (dict(bs=12), r"block_size must be a power of two >= 16, got 12"),
    (dict(bs=8), r"group 'full': block_size must be a power of two >= 16, got 8"),
    (dict(bs=0), r"block_size must be a power of two >= 16, got 0"),
    (dict(window=64, num_blocks=4), "cannot hold one sequence's ring"),
    (dict(window=8, prefix=True), "prefix_caching needs every group to be full-attention"),
    (dict(bounds=(1, -2, 0)), "bounds should be 3 non-negative ints"),
])
def test_config_errors_name_the_problem(kw, needle):
    with pytest.raises(ValueError, match=needle):
        manager(**kw)


# ---- plans ---------------------------------------------------------------------------------------------

def test_plan_writes_every_step_input_into_persistent_buffers():
    m = manager(num_blocks=16, bs=16, max_seq_len=128)  # 8 blocks per row
    m.add_sequence("a", 24)
    m.add_sequence("b", 12)
    p = m.plan([("a", 24), ("b", 12)])
    assert p.cumulative_sequence_length.tolist() == [0, 24, 36]
    assert p.past_seqlens.tolist() == [0, 0]
    assert p.query_positions.tolist() == list(range(24)) + list(range(12))
    assert p.attention_metadata.tolist() == [24, 24, 24] and p.attention_metadata.device.type == "cpu"
    assert p.block_tables["full"].shape == (2, 8) and p.block_tables["full"].dtype == torch.int32
    rows = p.block_tables["full"].tolist()
    assert rows[0][:2] != rows[1][:1] and rows[0][2:] == [-1] * 6 and rows[1][1:] == [-1] * 7
    assert p.slot_mappings["full"].tolist() == derived_slots(p, "full", 16) == p.host_slots["full"]
    ptrs = {k: t.data_ptr() for k, t in p.feeds().items()}
    m.commit(p)
    p2 = m.plan([("b", 2), ("a", 1)])
    assert p2.past_seqlens.tolist() == [12, 24] and p2.cumulative_sequence_length.tolist() == [0, 2, 3]
    assert p2.query_positions.tolist() == [12, 13, 24]
    assert p2.attention_metadata.tolist() == [2, 25, 25]
    assert {k: t.data_ptr() for k, t in p2.feeds().items()} == ptrs  # same addresses every step
    assert p2.slot_mappings["full"].tolist() == derived_slots(p2, "full", 16)
    assert set(p2.feeds()) == {"cumulative_sequence_lengths", "past_sequence_lengths", "attention_metadata",
                               "block_table", "slot_mapping"}
    assert set(p2.feeds(names=["block_table", "input_ids"], query_positions=True)) == {"block_table"}
    assert p.hint == "prefill" and p2.hint == "decode"  # the plan kind run_torch(plan=...) takes
    m.commit(p2)
    m.add_sequence("c", 4)
    p3 = m.plan([("a", 9), ("b", 1)])
    assert p3.hint == "chunked_prefill"  # more than DECODE_TOKENS over a prefix
    m.abort(p3)
    assert m.plan([("a", 1), ("c", 4)]).hint is None  # a decode and a first prompt in one step: mixed


def test_fixed_bounds_are_written_and_checked():
    m = manager(bounds=(4, 40, 0))
    m.add_sequence("a", 4)
    p = m.plan([("a", 4)])
    assert p.attention_metadata.tolist() == [4, 40, 0]
    m.commit(p)
    with pytest.raises(ValueError, match="attention_metadata bounds"):
        m.plan([("a", 5)])
    m.commit(m.plan([("a", 1)], bounds=(1, 5, 5)))  # per-plan override; lower bound 5 <= max kv 5
    with pytest.raises(ValueError, match="bounds"):
        m.plan([("a", 1)], bounds=(1, 64, 7))  # lower bound above the step's max kv length 6


def test_plan_errors():
    m = manager(max_batch=2, max_tokens=32, max_seq_len=64)
    m.add_sequence("a", 4)
    m.add_sequence("b", 4)
    m.add_sequence("c", 4)
    with pytest.raises(ValueError, match="batch size"):
        m.plan([("a", 1), ("b", 1), ("c", 1)])
    with pytest.raises(ValueError, match="max_num_tokens 32"):
        m.plan([("a", 17), ("b", 16)])
    with pytest.raises(ValueError, match="appears twice"):
        m.plan([("a", 1), ("a", 1)])
    with pytest.raises(KeyError, match="no sequence 'z'"):
        m.plan([("z", 1)])
    with pytest.raises(ValueError, match="max_seq_len 64"):
        m.add_sequence("long", 65)
    p = m.plan([("a", 32)])
    with pytest.raises(RuntimeError, match="neither committed nor aborted"):
        m.plan([("b", 1)])
    m.commit(p)
    m.commit(m.plan([("a", 32)]))
    with pytest.raises(ValueError, match=r"beyond max_seq_len 64 \(max_blocks_per_seq \{'full': 4\}\)"):
        m.plan([("a", 1)])
    with pytest.raises(ValueError, match="already exists"):
        m.add_sequence("a", 3)


def test_exhausted_pool_names_group_needed_and_free_and_changes_nothing():
    m = manager(num_blocks=4, bs=16)
    m.add_sequence("a", 48)
    m.commit(m.plan([("a", 48)]))  # 3 blocks
    m.add_sequence("b", 36)
    before = (m.block_table_row("a", "full"), m.num_free_blocks("full"))
    with pytest.raises(KVCacheExhausted, match=r"group 'full' is exhausted: .* needs 3 blocks, 1 are free"):
        m.plan([("b", 36)])
    assert (m.block_table_row("a", "full"), m.num_free_blocks("full")) == before
    assert m.block_table_row("b", "full") == [] and m.check_invariants() == []
    m.commit(m.plan([("b", 16)]))  # fits in the one free block
    assert m.num_free_blocks("full") == 0


def test_abort_releases_the_reservation():
    m = manager()
    m.add_sequence("a", 20)
    m.commit(m.plan([("a", 20)]))
    p = m.plan([("a", 28)])
    assert len(m.block_table_row("a", "full")) == 3
    m.abort(p)
    assert m.length("a") == 20 and len(m.block_table_row("a", "full")) == 2 and m.check_invariants() == []
    assert m.num_free_blocks("full") == 14


# ---- sharing -------------------------------------------------------------------------------------------

def test_fork_shares_blocks_and_copy_on_write_copies_every_cache_of_the_group():
    layers = (layer(0, key_scale_dtype="float16", value_scale_dtype="float16"), layer(1, cache_dtype="int8"),
              LayerCacheSpec(2, 1, 16, cache_dtype="bfloat16", latent=True))
    m = manager(layers=layers, bs=16)
    m.add_sequence("a", 24)
    m.commit(m.plan([("a", 24)]))
    gen = torch.Generator().manual_seed(0)
    for kinds in m.caches.values():  # fill every block of every tensor with distinct content
        for t in kinds.values():
            t.copy_(torch.randint(-100, 100, t.shape, generator=gen).to(t.dtype))
    assert set(m.caches[2]) == {"key"} and len(m.caches[0]) == 4
    m.fork("a", "b")
    ra, rb = m.block_table_row("a", "full"), m.block_table_row("b", "full")
    assert ra == rb and m.pools["full"].refcount[ra[1]] == 2
    snapshot = {(lid, k): t.clone() for lid, kinds in m.caches.items() for k, t in kinds.items()}
    p = m.plan([("b", 1)])  # position 24 lands in the shared, partially filled block 1
    nb = m.block_table_row("b", "full")[1]
    assert nb != ra[1] and m.block_table_row("b", "full")[0] == ra[0]
    assert p.slot_mappings["full"].tolist() == [nb * 16 + 8]
    for (lid, k), before in snapshot.items():  # the new block is a copy in every tensor, scale caches too
        assert torch.equal(m.caches[lid][k][nb].view(torch.uint8), before[ra[1]].view(torch.uint8)), (lid, k)
        assert torch.equal(m.caches[lid][k][ra[1]].view(torch.uint8), before[ra[1]].view(torch.uint8))
    m.commit(p)
    assert m.pools["full"].refcount[ra[1]] == 1 and m.pools["full"].refcount[ra[0]] == 2
    m.commit(m.plan([("a", 1)]))  # the parent's block is private again: written in place
    assert m.block_table_row("a", "full") == ra
    m.free("a")
    m.free("b")
    assert m.num_free_blocks("full") == 16 and m.check_invariants() == []


def test_prefix_cache_hits_full_blocks_and_keeps_one_token_to_compute():
    m = manager(prefix=True, bs=16)
    ids = list(range(100, 140))
    assert m.add_sequence("a", ids) == 0
    m.commit(m.plan([("a", ids)]))
    assert m.add_sequence("b", ids[:36] + [7] * 8) == 32  # blocks 0, 1 hit; block 2 differs
    assert m.block_table_row("b", "full") == m.block_table_row("a", "full")[:2]
    p = m.plan([("b", ids[32:36] + [7] * 8)])  # only the uncached tokens are planned
    assert p.past_lens == (32,) and p.slot_mappings["full"].tolist() == derived_slots(p, "full", 16)
    m.commit(p)
    assert m.add_sequence("c", ids[:32]) == 16  # exact 2-block prompt: the last block is recomputed
    m.free("c")
    m.free("a")
    m.free("b")
    assert m.num_free_blocks("full") == 16
    assert m.add_sequence("d", ids[:36]) == 32  # cached blocks outlive their sequences
    m.free("d")
    m.clear_prefix_cache()
    assert m.add_sequence("e", ids[:36]) == 0 and m.check_invariants() == []


def test_prefix_cache_evicts_least_recently_released_blocks():
    m = manager(prefix=True, bs=16, num_blocks=4)
    m.add_sequence("a", list(range(36)))
    m.commit(m.plan([("a", list(range(36)))]))  # 3 blocks, 2 full and cached
    m.free("a")
    assert m.num_free_blocks("full") == 4 and len(m.pools["full"].cached) == 2
    m.add_sequence("b", list(range(200, 248)))
    m.commit(m.plan([("b", list(range(200, 248)))]))  # needs 3: the 2 unused blocks + 1 evicted
    assert len(m.pools["full"].cached) == 4 and m.check_invariants() == []  # b's 3 + a's first
    m.free("b")
    assert m.add_sequence("c", list(range(36))) == 16  # a's tail block went first; its head survived
    assert m.add_sequence("d", list(range(200, 252))) == 48
    assert m.num_free_blocks("full") == 0
    with pytest.raises(KVCacheExhausted, match="needs 2 blocks, 0 are free"):
        m.plan([("c", 20)])


def test_plan_rejects_token_ids_that_contradict_the_prompt():
    m = manager(prefix=True)
    m.add_sequence("a", [1, 2, 3])
    with pytest.raises(ValueError, match="differ from its known tokens"):
        m.plan([("a", [1, 2, 4])])


# ---- rings -------------------------------------------------------------------------------------------

def test_ring_recycles_n_blocks_and_unmaps_below_the_window():
    W, bs = 24, 16
    m = manager(window=W, bs=bs, max_seq_len=256)
    ring = m.config.group("win").ring_blocks
    assert ring == math.ceil(W / bs) + 1
    m.add_sequence("a", 160)
    m.commit(m.plan([("a", 12)]))
    seen = set()
    for _ in range(148):
        past = m.length("a")
        p = m.plan([("a", 1)])
        row = p.block_tables["win"][0].tolist()
        live = max(0, past - W + 1) // bs
        assert all(b == -1 for b in row[:live]), (past, row)
        assert all(b >= 0 for b in row[live : past // bs + 1]) and all(b == -1 for b in row[past // bs + 1 :])
        assert p.slot_mappings["win"].tolist() == derived_slots(p, "win", bs)
        seen |= {b for b in row if b >= 0}
        m.commit(p)
    assert len(seen) == ring and m.num_free_blocks("win") == 16 - ring
    assert m.num_free_blocks("full") == 16 - 10


def test_ring_refuses_a_step_that_would_overwrite_live_blocks():
    m = manager(window=32, bs=16, chunk=16)  # ring of ceil(47 / 16) + 1 = 4 blocks
    m.add_sequence("a", 120)
    assert m.max_step_tokens("a") == 64
    with pytest.raises(ValueError, match=r"group 'win': sequence 'a': a step of 65 tokens .* at most 64 tokens"):
        m.plan([("a", 65)])
    m.commit(m.plan([("a", 64)]))
    assert m.max_step_tokens("a") == 4 * 16 - 64 + (64 - 32 + 1) // 16 * 16  # live range starts at block 2
    m.commit(m.plan([("a", m.max_step_tokens("a"))]))
    assert m.check_invariants() == []


# ---- speculation ---------------------------------------------------------------------------------------

def test_speculate_accept_rolls_back_rejected_drafts():
    m = manager(prefix=True, bs=16)
    m.add_sequence("a", list(range(1, 25)))
    m.commit(m.plan([("a", list(range(1, 25)))]))
    m.speculate("a", 23)
    p = m.plan([("a", list(range(25, 49)))])  # the real next token + 23 drafts
    assert p.draft_lens == (23,)
    m.commit(p)
    assert m.length("a") == 48 and len(m.block_table_row("a", "full")) == 3
    assert len(m.pools["full"].cached) == 1  # blocks holding drafts are not cached
    with pytest.raises(ValueError, match="unaccepted drafts"):
        m.plan([("a", 1)])
    with pytest.raises(ValueError, match=r"n_accepted should be in \[0, 23\]"):
        m.accept("a", 24)
    m.accept("a", 7)  # keeps 25 .. 32
    assert m.length("a") == 32 and len(m.block_table_row("a", "full")) == 2
    assert m.num_free_blocks("full") == 14 and len(m.pools["full"].cached) == 2
    p = m.plan([("a", [100])])
    assert p.past_lens == (32,) and p.slot_mappings["full"].tolist() == derived_slots(p, "full", 16)
    m.commit(p)
    assert m.add_sequence("b", list(range(1, 33)) + [100]) == 32  # accepted tokens are cached


def test_speculation_with_a_ring_keeps_the_window_of_accepted_tokens():
    W, bs = 20, 16
    m = manager(window=W, bs=bs, chunk=16)
    m.add_sequence("a", 80)
    m.commit(m.plan([("a", 36)]))
    m.speculate("a", 15)
    m.commit(m.plan([("a", 16)]))  # positions 36..51, 15 drafts
    row = m.block_table_row("a", "win")
    assert row[(36 - W + 1) // bs] >= 0  # eviction used the accepted length 37, not 52
    m.accept("a", 0)
    assert m.length("a") == 37
    p = m.plan([("a", 1)])
    assert p.past_lens == (37,) and p.slot_mappings["win"].tolist() == derived_slots(p, "win", bs)
    m.commit(p)
    assert m.check_invariants() == []


# ---- CUDA: persistent device buffers under graph replay ----------------------------------------------

@pytest.mark.gpu
def test_cuda_step_buffers_replay_in_a_cuda_graph_and_match_cpu():
    cpu, gpu = manager(num_blocks=32, bs=16, max_seq_len=256), manager(num_blocks=32, bs=16, max_seq_len=256,
                                                                        device="cuda")
    for m in (cpu, gpu):
        m.add_sequence("a", 40)
        m.add_sequence("b", 17)
        m.commit(m.plan([("a", 40), ("b", 17)]))
    gen = torch.Generator().manual_seed(0)
    for t in gpu.caches[0].values():
        t.copy_(torch.randn(t.shape, generator=gen).half())
    for m in (cpu, gpu):
        m.fork("b", "c")  # c's first write copies b's partial block on the device

    def flat(plan):
        f = plan.feeds()
        return torch.cat([f[k].flatten() for k in sorted(f) if k != "attention_metadata"])

    static = gpu.plan([("a", 1), ("b", 1), ("c", 1)])
    assert all(t.device.type == "cuda" for k, t in static.feeds().items() if k != "attention_metadata")
    src_block = gpu.block_table_row("b", "full")[1]
    assert torch.equal(gpu.caches[0]["key"][gpu.block_table_row("c", "full")[1]], gpu.caches[0]["key"][src_block])
    gpu.commit(static)
    cpu.commit(cpu.plan([("a", 1), ("b", 1), ("c", 1)]))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out = flat(static) * 1  # warm-up
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flat(static) * 1  # reads the persistent buffers at fixed addresses
    for _ in range(20):
        p_gpu, p_cpu = gpu.plan([("a", 1), ("b", 1), ("c", 1)]), cpu.plan([("a", 1), ("b", 1), ("c", 1)])
        assert {k: t.data_ptr() for k, t in p_gpu.feeds().items()} == {k: t.data_ptr() for k, t in static.feeds().items()}
        graph.replay()
        assert torch.equal(out.cpu(), flat(p_cpu)), "graph replay did not see this step's values"
        assert p_gpu.attention_metadata.tolist() == p_cpu.attention_metadata.tolist()
        gpu.commit(p_gpu)
        cpu.commit(p_cpu)


def test_docs_example_runs_and_prints_what_it_says(capsys):
    import pathlib
    import re

    text = (pathlib.Path(__file__).parents[1] / "docs" / "kv-cache.md").read_text(encoding="utf-8")
    (code,) = re.findall(r"```python\n(.*?)```", text, re.S)
    exec(compile(code, "docs/kv-cache.md", "exec"), {})
    promised = [m.strip() for m in re.findall(r"print\(.*?\)\s+# (.*)", code)]
    assert capsys.readouterr().out.split("\n")[: len(promised)] == promised


def test_pinned_ring_round_robin_without_cuda():
    from pagedkit.runtime.kv.staging import PinnedRing

    ring = PinnedRing.of(4, torch.int64, cuda=False, depth=2, fill=-1)
    a, b, c = ring.take(), ring.take(), ring.take()
    assert a is c and a is not b and ring.current == 0 and ring.done() is None
    assert a.tolist() == [-1] * 4 and not a.is_pinned()


def test_copy_ranges_merge_close_spans_only():
    from pagedkit.runtime.kv.plan import copy_ranges

    assert copy_ranges([(0, 3), (10, 2), (100, 5), (5000, 4), (20, 0)], gap=50) == [(0, 12), (100, 5), (5000, 4)]
    assert copy_ranges([(40, 4), (0, 8)], gap=0) == [(0, 8), (40, 4)]
    assert copy_ranges([(0, 8), (8, 4)], gap=0) == [(0, 12)]  # adjacent
    assert copy_ranges([]) == []


def test_feed_only_leaves_the_rest_out_of_the_plan():
    """A manager told the model reads cu / past / the block table only: plans hold None for slot_mapping and
    query_positions, feeds() for the model's names works, asking for a segment left out is an error naming it."""
    mgr = manager()
    mgr.feed_only({"cumulative_sequence_lengths", "past_sequence_lengths", "block_table"})
    mgr.add_sequence("a", [1, 2, 3])
    p = mgr.plan([("a", [1, 2, 3])])
    assert p.query_positions is None and all(v is None for v in p.slot_mappings.values())
    assert p.past_seqlens is not None and p.block_tables["full"] is not None
    assert set(p.feeds(names=["cumulative_sequence_lengths", "block_table", "input_ids"])) == {
        "cumulative_sequence_lengths", "block_table"}
    with pytest.raises(ValueError, match="slot_mapping.*not copied"):
        p.feeds(names=["slot_mapping"])
    mgr.abort(p)
    mgr.feed_only(None)
    p = mgr.plan([("a", [1, 2, 3])])
    assert p.query_positions is not None and p.slot_mappings["full"] is not None


@pytest.mark.gpu
def test_a_fed_decode_plan_is_one_host_to_device_copy_on_cuda():
    """Fed cu / past / block table only, a decode plan's inputs are one merged copy, equal to the CPU plan's."""
    cpu, gpu = (manager(num_blocks=32, bs=16, max_seq_len=256, device=d) for d in ("cpu", "cuda"))
    names = {"cumulative_sequence_lengths", "past_sequence_lengths", "block_table"}
    for m in (cpu, gpu):
        m.feed_only(names)
        for s, n in (("a", 40), ("b", 17)):
            m.add_sequence(s, n)
        m.commit(m.plan([("a", 40), ("b", 17)]))
    before = gpu.buffers.copies
    plans = [m.plan([("a", [5]), ("b", [6])]) for m in (cpu, gpu)]
    assert gpu.buffers.copies - before == 1
    want, got = (p.feeds(names=names) for p in plans)
    torch.cuda.synchronize()
    assert set(got) == names and all(torch.equal(got[k].cpu(), want[k]) for k in names)


@pytest.mark.parametrize("fed", [None, {"cumulative_sequence_lengths", "past_sequence_lengths", "block_table"}])
def test_merged_copies_carry_every_used_row(fed):
    """The copy path a CUDA manager takes, on CPU tensors: a separate device buffer fed by the merged copies from
    the staging ring holds exactly the host rows of every fed segment (windowed group too), step after step."""
    from pagedkit.runtime.kv.staging import PinnedRing

    mgr = manager(num_blocks=32, bs=16, window=32, max_batch=4, max_tokens=64)
    buf = mgr.buffers
    buf.on_cuda = True  # the CUDA path: stage on the host, copy into a distinct "device" buffer
    buf.dev = torch.full_like(buf.dev, -7)
    buf.ring = PinnedRing.of(buf.total, torch.int32, False, 3, fill=-1)
    buf._host_views = [{key: buf._view(flat, key).numpy() for key in buf.shapes} for flat in buf.ring.bufs]
    buf._dev_views = {key: buf._view(buf.dev, key) for key in buf.shapes}
    mgr.feed_only(fed)
    cpu = manager(num_blocks=32, bs=16, window=32, max_batch=4, max_tokens=64)  # the plain CPU manager: the truth
    names = None if fed is None else sorted(fed)
    for m in (mgr, cpu):
        m.add_sequence("a", 20)
        m.add_sequence("b", 3)
    steps = [[("a", 20), ("b", 3)], [("a", [1]), ("b", [2])], [("a", [3]), ("b", [4, 5, 6])]]
    for i, batch in enumerate(steps):
        before = buf.copies
        got, want = mgr.plan(batch), cpu.plan(batch)
        if fed is not None and i == 1:  # a decode step fed cu / past / tables: one merged copy
            assert buf.copies - before == 1
        g, w = got.feeds(names, query_positions=True), want.feeds(names, query_positions=True)
        assert set(g) == (set(w) if fed is None else (fed | {"attention_metadata"}) & set(w))
        for k in g:
            assert torch.equal(g[k], w[k]), k
        mgr.commit(got)
        cpu.commit(want)
    assert buf.copies >= len(steps)
