"""Decode steps as the CUDA graphs plan them (engine/graphs.py), checked on the CPU: a decode step padded to its
batch bucket, with replay-wide attention_metadata bounds, gives the real rows the logits of the plain step
(the oracle: the same model run unpadded with exact metadata), the pad rows only touch the pad block (never
in the pool), and the engine's tokens are the plain engine's. Teeth: pad rows aimed at a live block change a
sequence's later logits. Capture and replay themselves run on the H200 (test_engine_graphs_gpu.py).
"""

from __future__ import annotations

import random

import pytest
import torch

from engine_steps import decode_steps
from pagedkit.engine import Engine, SamplingParams
from pagedkit.engine.graphs import KV_BUCKET_MIN, batch_buckets, kv_bucket

TOL = 1e-3  # max |diff| <= TOL x max |ref|: the same kernels, only the GEMMs' row count differs


def _prompts(n: int, seed: int, vocab: int = 144) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(5, 40))] for _ in range(n)]


def _decode_logits(model, prompts, steps: int, seed: int) -> list[torch.Tensor]:
    """Prefill every prompt (one step each), then `steps` decode steps of the whole batch, teacher-forced on
    seeded tokens; the logits [B, V] (float32, CPU) of each decode step."""
    mgr, rng = model.mgr, random.Random(seed)
    sids = [f"s{i}" for i in range(len(prompts))]
    for s, p in zip(sids, prompts):
        mgr.add_sequence(s, p)
        plan = model.plan([(s, p)])
        model.run(plan, p, [len(p) - 1])
        mgr.commit(plan)
    return decode_steps(model, sids, steps, rng)


@pytest.mark.parametrize("batch", [3, 5])
def test_padded_decode_steps_give_the_plain_logits(tiny_llama, batch):
    plain = Engine(tiny_llama, max_batch_size=8, max_num_tokens=64, cuda_graphs=False).model
    padded = Engine(tiny_llama, max_batch_size=8, max_num_tokens=64, cuda_graphs="padded").model
    prompts = _prompts(batch, seed=batch)
    ref = _decode_logits(plain, prompts, 6, seed=7)
    got = _decode_logits(padded, prompts, 6, seed=7)
    assert padded.graphs.stats.eager_padded == 6 and plain.graphs is None
    for i, (g, r) in enumerate(zip(got, ref)):
        assert g.shape == r.shape == (batch, r.shape[1])
        rel = float((g - r).abs().max() / r.abs().max())
        assert rel <= TOL, f"decode step {i}: max |diff| {rel:.3g} x max |ref|"
    bucket = next(b for b in batch_buckets(8) if b >= batch)
    assert bucket > batch  # the steps really were padded
    for g in padded.mgr.config.groups:  # the pad block is outside the pool, and every block is free again
        assert padded.mgr.pools[g.name].num_blocks == g.num_blocks
        assert padded.mgr.caches[g.layers[0].layer_id]["key"].shape[0] == g.num_blocks + 1
        assert padded.mgr.num_free_blocks(g.name) == g.num_blocks


def test_teeth_pad_rows_on_a_live_block_change_the_logits(tiny_llama, monkeypatch):
    """If the pad rows wrote into block 0 (a live sequence's first block), that sequence's next steps read a
    wrong key / value at position 0: the comparison above must see it."""
    plain = Engine(tiny_llama, max_batch_size=8, max_num_tokens=64, cuda_graphs=False).model
    padded = Engine(tiny_llama, max_batch_size=8, max_num_tokens=64, cuda_graphs="padded").model
    mgr = padded.mgr
    real_write = mgr.buffers.write

    def pad_on_block_0(*args, pad=None, **kw):
        if pad:
            pad = (pad[0], {g: 0 for g in pad[1]})
        return real_write(*args, pad=pad, **kw)

    monkeypatch.setattr(mgr.buffers, "write", pad_on_block_0)
    prompts = _prompts(3, seed=3)
    ref = _decode_logits(plain, prompts, 4, seed=7)
    got = _decode_logits(padded, prompts, 4, seed=7)
    worst = max(float((g - r).abs().max() / r.abs().max()) for g, r in zip(got, ref))
    assert worst > TOL, f"pad rows on a live block went unnoticed (max rel diff {worst:.3g})"


def test_padded_engine_gives_the_plain_engine_tokens(tiny_llama):
    prompts = _prompts(6, seed=11)
    sp = SamplingParams(max_new_tokens=10, ignore_eos=True)
    plain = Engine(tiny_llama, max_batch_size=8, max_num_tokens=64, cuda_graphs=False)
    padded = Engine(tiny_llama, max_batch_size=8, max_num_tokens=64, cuda_graphs="padded")
    ref = [o.token_ids for o in plain.generate(prompts, sp)]
    got = [o.token_ids for o in padded.generate(prompts, sp)]
    assert got == ref
    assert padded.stats.graph_steps > 0 and plain.stats.graph_steps == 0
    assert padded.check_invariants() == []


def test_only_one_token_decode_steps_are_padded(tiny_llama):
    model = Engine(tiny_llama, max_batch_size=8, max_num_tokens=64, cuda_graphs="padded").model
    mgr, g = model.mgr, model.graphs
    mgr.add_sequence("a", [5, 6, 7])
    assert g.key([("a", [5, 6, 7])]) is None  # a prefill (no cached context)
    plan = model.plan([("a", [5, 6, 7])])
    assert plan.pad_rows == 0 and not g.serves(plan)
    model.run(plan, [5, 6, 7])
    mgr.commit(plan)
    assert g.key([("a", [8, 9])]) is None  # two tokens (a chunk, or drafts)
    assert g.key([("a", [8])]) == (1, KV_BUCKET_MIN)
    mgr.speculate("a", 1)
    assert g.key([("a", [8])]) is None  # a draft step
    mgr.free("a")


def test_buckets():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(6) == (1, 2, 4, 6)
    assert batch_buckets(32) == (1, 2, 4, 8, 16, 24, 32)
    assert batch_buckets(36) == (1, 2, 4, 8, 16, 24, 32, 36)
    assert kv_bucket(1, 4096) == KV_BUCKET_MIN
    assert kv_bucket(257, 4096) == 512
    assert kv_bucket(4096, 4096) == 4096
    assert kv_bucket(3000, 3500) == 3500


def test_bad_settings_are_refused(tiny_llama):
    with pytest.raises(ValueError, match="cuda_graphs=True needs device 'cuda'"):
        Engine(tiny_llama, cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs must be"):
        Engine(tiny_llama, cuda_graphs="yes")
    model = Engine(tiny_llama, max_batch_size=4, cuda_graphs=False).model
    model.mgr.add_sequence("a", [5, 6])
    with pytest.raises(ValueError, match="pad_to needs KVCacheConfig.pad_block=True"):
        model.mgr.plan([("a", [5, 6])], pad_to=2)
    padded = Engine(tiny_llama, max_batch_size=4, cuda_graphs="padded").model
    padded.mgr.add_sequence("a", [5, 6])
    with pytest.raises(ValueError, match=r"pad_to should be in \[1, 4\]"):
        padded.mgr.plan([("a", [5, 6])], pad_to=5)
