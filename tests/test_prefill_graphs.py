"""First-prompt prefills as the prefill graphs plan them (engine/prefill_graphs.py), checked on the CPU: a step of
whole first prompts padded to its token bucket (`KVCacheManager.plan(pad_len=L)`) gives the rows read the logits
of the plain step (the oracle: the same model run unpadded with exact metadata), later decode steps see an
unchanged cache, the engine's tokens are the plain engine's, and the padded plan's device tensors are the ones
worked out by hand here. Teeth: pad tokens aimed at a live sequence's slots, or a row one off, fail the checks.
Capture and replay run on the GPU (test_engine_graphs_gpu.py).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engine_steps import decode_steps
from pagedkit.engine import Engine, SamplingParams
from pagedkit.engine import prefill_graphs as pgm
from pagedkit.engine.prefill_graphs import TOKEN_BUCKETS, token_bucket
from pagedkit.runtime.kv import plan as kv_plan
from pagedkit.runtime.kv.cache import KVCacheManager
from pagedkit.runtime.kv.config import GroupConfig, KVCacheConfig, LayerCacheSpec

TOL = 1e-3  # max |diff| <= TOL x max |ref|: the same kernels, only the row count differs


def _engine(model_dir, graphs, **kw):
    return Engine(model_dir, max_batch_size=8, max_num_tokens=256, cuda_graphs=graphs,
                  enable_prefix_caching=kw.pop("enable_prefix_caching", False), **kw)


def _prompts(lengths, seed, vocab=144):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _prefill_then_decode(model, prompts, rows, steps, seed):
    """One step of every prompt (rows: the flat rows read, None = all), then `steps` teacher-forced decode
    steps of the batch; (prefill logits, [decode logits]) as float32 CPU tensors."""
    mgr, rng = model.mgr, random.Random(seed)
    sids = [f"s{i}" for i in range(len(prompts))]
    for s, p in zip(sids, prompts):
        mgr.add_sequence(s, p)
    plan = model.plan(list(zip(sids, prompts)))
    first = model.run(plan, [t for p in prompts for t in p], rows).float().cpu().clone()
    mgr.commit(plan)
    return first, decode_steps(model, sids, steps, rng)


def _rel(got, ref):
    return float((got - ref).abs().max() / ref.abs().max())


def _last_rows(lengths):
    return list(np.cumsum(lengths) - 1)


def test_token_buckets():
    assert token_bucket(1) == 16 and token_bucket(16) == 16 and token_bucket(17) == 32
    assert token_bucket(991) == 1024 and token_bucket(1025) == 1536 and token_bucket(4063) == 4096
    assert token_bucket(TOKEN_BUCKETS[-1]) == TOKEN_BUCKETS[-1] and token_bucket(TOKEN_BUCKETS[-1] + 1) is None
    assert all(b / a <= 1.5 for a, b in zip(TOKEN_BUCKETS[3:], TOKEN_BUCKETS[4:]))


@pytest.mark.parametrize("lengths", [[23], [5, 37, 18], [16, 16]])
def test_padded_prefill_gives_the_plain_logits(tiny_llama, lengths):
    plain = _engine(tiny_llama, False).model
    padded = _engine(tiny_llama, "padded").model
    pg = padded.prefill_graphs
    assert pg is not None and plain.prefill_graphs is None
    prompts = _prompts(lengths, seed=len(lengths))
    rows = _last_rows(lengths)
    ref_first, ref = _prefill_then_decode(plain, prompts, rows, 5, seed=3)
    got_first, got = _prefill_then_decode(padded, prompts, rows, 5, seed=3)
    assert pg.stats.eager_padded == 1 and pg.stats.replays == 0
    assert got_first.shape == ref_first.shape == (len(lengths), 144)
    assert _rel(got_first, ref_first) <= TOL
    for i, (g, r) in enumerate(zip(got, ref)):  # the cache the pad tokens wrote beside is the plain one
        assert _rel(g, r) <= TOL, f"decode step {i}"


def test_every_row_and_no_row(tiny_llama):
    """More rows than sequences (every row: the padded step eagerly) and none (a middle chunk) both serve."""
    plain = _engine(tiny_llama, False).model
    padded = _engine(tiny_llama, "padded").model
    lengths = [9, 30]
    prompts = _prompts(lengths, seed=11)
    st = padded.prefill_graphs.stats
    for k, rows in enumerate((None, [0, 8, 9, 38], [3, 20])):
        ref, _ = _prefill_then_decode(plain, prompts, rows, 0, seed=0)
        got, _ = _prefill_then_decode(padded, prompts, rows, 0, seed=0)
        assert got.shape == ref.shape and _rel(got, ref) <= TOL, rows
        assert st.eager_padded == k + 1 and st.captured == st.replays == 0  # one padded eager step each
    got, _ = _prefill_then_decode(padded, prompts, [], 0, seed=0)
    assert got.shape[0] == 0


def test_engine_tokens_equal_the_plain_engine(tiny_llama):
    prompts = _prompts([7, 40, 19, 3], seed=5)
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    ref = _engine(tiny_llama, False).generate(prompts, params)
    eng = _engine(tiny_llama, "padded")
    got = eng.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert eng.stats.prefill_graph_steps >= 1 and eng.model.prefill_graphs.stats.eager_padded >= 1


def test_teeth_pad_tokens_on_a_live_block_change_later_logits(tiny_llama, monkeypatch):
    """If the table entries past the sequence's blocks named its own first block instead of the pad block,
    the pad tokens would write over its first positions (the model derives each token's slot from the table)
    and its decode steps would read wrong keys."""
    plain = _engine(tiny_llama, False).model
    padded = _engine(tiny_llama, "padded").model
    real = kv_plan._padded_slots

    def onto_live(dst, table, real_slots, query_lens, past_lens, L, pad_block, bs, row_lens):
        real(dst, table, real_slots, query_lens, past_lens, L, int(table[0, 0]), bs, row_lens)

    monkeypatch.setattr(kv_plan, "_padded_slots", onto_live)
    prompts = _prompts([33], seed=2)  # block size 16, bucket 64: blocks 0-2 real, block 3 the pad block
    _, ref = _prefill_then_decode(plain, prompts, [32], 3, seed=1)
    _, got = _prefill_then_decode(padded, prompts, [32], 3, seed=1)
    assert max(_rel(g, r) for g, r in zip(got, ref)) > TOL


def test_teeth_a_row_one_off_changes_the_logits(tiny_llama, monkeypatch):
    plain = _engine(tiny_llama, False).model
    padded = _engine(tiny_llama, "padded").model
    real_write = pgm.PrefillGraphs._write

    def off_by_one(self, query_lens, token_ids, L, padded_rows, B):
        return real_write(self, query_lens, token_ids, L, None if padded_rows is None else padded_rows - 1, B)

    monkeypatch.setattr(pgm.PrefillGraphs, "_write", off_by_one)
    prompts = _prompts([12, 25], seed=4)
    ref, _ = _prefill_then_decode(plain, prompts, _last_rows([12, 25]), 0, seed=0)
    got, _ = _prefill_then_decode(padded, prompts, _last_rows([12, 25]), 0, seed=0)
    assert _rel(got, ref) > TOL


def test_which_steps_are_served(tiny_llama):
    model = _engine(tiny_llama, "padded").model
    pg, mgr = model.prefill_graphs, model.mgr
    mgr.add_sequence("a", list(range(3, 40)))
    mgr.add_sequence("b", list(range(3, 200)))
    assert pg.key([("a", list(range(3, 40)))]) == (1, 64)
    assert pg.key([("a", 37)]) is None  # ids unknown at plan time
    assert pg.key([("b", list(range(3, 200)))]) == (1, 256)  # 256 tokens: the step budget exactly
    assert pg.key([("a", list(range(3, 40))), ("b", list(range(3, 200)))]) is None  # 2 x 256 > 256
    pg.capture = True  # the capture limit (as on CUDA): a new key beyond max_graphs is not served, a known one is
    pg.graphs = {(2, k): None for k in range(pg.max_graphs - 1)}
    assert pg.key([("a", list(range(3, 40)))]) == (1, 64)  # the 32nd key
    pg.graphs[(3, 16)] = None
    assert pg.key([("a", list(range(3, 40)))]) is None
    pg.graphs[(1, 64)] = None
    assert pg.key([("a", list(range(3, 40)))]) == (1, 64)
    pg.capture, pg.graphs = False, {}
    pg.stats.capture_error = "RuntimeError: no capture"  # a failed capture turns the graphs off
    assert pg.key([("a", list(range(3, 40)))]) is None
    pg.stats.capture_error = None
    plan = model.plan([("a", list(range(3, 40)))])
    assert pg.serves(plan) and plan.attention_metadata.tolist() == [64, 64, 0]  # the bucket's bounds
    mgr.commit(plan)
    pg.abort(plan)
    assert pg.key([("a", [5])]) is None  # a cached prefix: not a first prompt
    assert _engine(tiny_llama, "padded", prefill_graph_tokens=0).model.prefill_graphs_off_reason == \
        "prefill_graph_tokens=0"
    with pytest.raises(ValueError, match="prefill_graph_tokens must be an integer >= 0"):
        _engine(tiny_llama, "padded", prefill_graph_tokens=-1)


def _tiny_moe(tmp_path):
    from export_utils import export_tiny, tiny_model

    export_tiny(tiny_model("MixtralConfig", num_local_experts=4, num_experts_per_tok=2, intermediate_size=48),
                tmp_path)
    return tmp_path


def test_moe_off_the_fused_kernel_prefills_eagerly(tmp_path, monkeypatch):
    """A MoE node that takes its grouped path (per-expert counts read on the host; here the torch CPU backend, where
    the fused kernel does not serve CPU tensors) cannot be captured: the first padded step's eager run shows it,
    prefill graphs turn off naming the node, the path and why the fused kernel did not serve it, and the later
    steps run unpadded; the tokens are the plain engine's."""
    monkeypatch.setenv("PAGEDKIT_CPU_BACKEND", "torch")
    model_dir = _tiny_moe(tmp_path)
    eng = _engine(model_dir, "padded")
    pg = eng.model.prefill_graphs
    assert pg is not None and eng.model.prefill_graphs_off_reason is None and len(eng.model.moe_nodes) == 2
    prompts = _prompts([23, 9], seed=2)
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    ref = _engine(model_dir, False).generate(prompts, params)
    got = eng.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    why = pg.stats.capture_error
    assert why is not None and "took its grouped path" in why and "not a CUDA tensor" in why, why
    assert pg.stats.eager_padded == 1 and pg.key([("x", [1, 2, 3])]) is None


def test_moe_on_the_fused_kernel_prefills_padded(tmp_path, monkeypatch):
    """Where the fused MoE kernel serves every MoE node (no host read at any batch: on CUDA; here its interpreted
    form on CPU tensors), prefill graphs stay on: the padded steps (pad tokens routed too) give the plain step's
    logits and the same later decode logits."""
    from pagedkit.runtime.ops import moe
    from pagedkit.runtime.ops.util import triton_kernels

    monkeypatch.setenv("PAGEDKIT_CPU_BACKEND", "torch")
    monkeypatch.setattr(moe, "triton_moe_refusal", lambda xs, w, a: triton_kernels("moe").serves(xs, w, a))
    model_dir = _tiny_moe(tmp_path)
    plain = _engine(model_dir, False).model
    padded = _engine(model_dir, "padded").model
    lengths = [21, 6]
    prompts = _prompts(lengths, seed=4)
    rows = _last_rows(lengths)
    ref_first, ref = _prefill_then_decode(plain, prompts, rows, 2, seed=1)
    got_first, got = _prefill_then_decode(padded, prompts, rows, 2, seed=1)
    st = padded.prefill_graphs.stats
    assert st.capture_error is None and st.eager_padded == 1
    assert all(moe.ROUTES[n] == "triton" for n in padded.moe_nodes)
    assert _rel(got_first, ref_first) <= TOL
    for i, (g, r) in enumerate(zip(got, ref)):
        assert _rel(g, r) <= TOL, f"decode step {i}"


# ---- the padded plan itself, by hand ------------------------------------------------------------------------

def _manager(pad_block=True, max_num_tokens=128, windowed=False):
    layer = LayerCacheSpec(layer_id=0, kv_num_heads=1, head_size=4)
    groups = [GroupConfig("full", 8, 16, (layer,))]
    if windowed:
        groups.append(GroupConfig("windowed", 8, 16, (LayerCacheSpec(layer_id=1, kv_num_heads=1, head_size=4),),
                                  window=16, chunk_tokens=16))
    return KVCacheManager(KVCacheConfig(tuple(groups), max_batch_size=4, max_num_tokens=max_num_tokens,
                                        max_seq_len=128, device="cpu", pad_block=pad_block, prefix_caching=False))


def test_padded_plan_tensors_by_hand():
    mgr = _manager()
    mgr.add_sequence("x", list(range(10, 30)))  # 20 tokens, block size 16: blocks for positions 0-15, 16-31
    mgr.add_sequence("y", list(range(40, 45)))  # 5 tokens: one block
    plan = mgr.plan([("x", list(range(10, 30))), ("y", list(range(40, 45)))], bounds=(32, 32, 0), pad_len=32)
    tx, ty = mgr.block_table_row("x", "full"), mgr.block_table_row("y", "full")
    assert len(tx) == 2 and len(ty) == 1
    pad = 8  # the pad block: the pool's num_blocks
    assert plan.query_lens == (20, 5) and plan.past_lens == (0, 0)
    assert plan.cumulative_sequence_length.tolist() == [0, 32, 64]
    assert plan.past_seqlens.tolist() == [0, 0]
    assert plan.query_positions.tolist() == list(range(32)) * 2
    table = plan.block_tables["full"]
    assert table[0, :2].tolist() == tx and table[1, :2].tolist() == [ty[0], pad]
    assert (table[:, 2:] == -1).all()
    slots = plan.slot_mappings["full"].tolist()
    x_expect = [tx[0] * 16 + i for i in range(16)] + [tx[1] * 16 + i for i in range(16)]  # the pad tail: x's
    y_expect = [ty[0] * 16 + i for i in range(16)] + [pad * 16 + i for i in range(16)]
    assert slots == x_expect + y_expect
    assert plan.attention_metadata.tolist() == [32, 32, 0]
    assert plan.host_slots["full"] == x_expect[:20] + y_expect[:5]  # the host facts stay the real tokens'
    mgr.commit(plan)
    assert mgr.length("x") == 20 and mgr.length("y") == 5


def test_padded_plan_refusals():
    mgr = _manager()
    mgr.add_sequence("x", list(range(10, 15)))
    with pytest.raises(ValueError, match=r"pad_len should be an integer >= the step's longest sequence \(5"):
        mgr.plan([("x", 5)], pad_len=4)
    with pytest.raises(ValueError, match="pad_to and pad_len exclude each other"):
        mgr.plan([("x", 5)], pad_to=2, pad_len=8)
    with pytest.raises(ValueError, match="beyond max_seq_len 128"):
        mgr.plan([("x", 5)], pad_len=129)
    small = _manager(max_num_tokens=48)
    small.add_sequence("x", 5)
    small.add_sequence("y", 3)
    with pytest.raises(ValueError, match="2 sequences x pad_len 32 tokens in the step, beyond max_num_tokens 48"):
        small.plan([("x", 5), ("y", 3)], pad_len=32)
    with pytest.raises(ValueError, match=r"pad_len needs KVCacheConfig.pad_block=True"):
        m = _manager(pad_block=False)
        m.add_sequence("x", 5)
        m.plan([("x", 5)], pad_len=8)
    with pytest.raises(ValueError, match="pad_len needs full-attention groups only"):
        m = _manager(windowed=True)
        m.add_sequence("x", 5)
        m.plan([("x", 5)], pad_len=8)
    plan = mgr.plan([("x", 5)], pad_len=8)  # nothing was reserved by the refused plans
    mgr.abort(plan)
