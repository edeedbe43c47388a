"""First-prompt prefills as CUDA-graph replays on the GPU (engine/prefill_graphs.py), `pytest -m gpu`:

- a replayed prefill gives bit-identical logits to the same padded step run eagerly (`cuda_graphs="padded"`),
  and the plain eager step's (no padding, exact metadata) within fp16 noise; so do the decode steps after it;
- the fp16 tiny Llama's uniform padded prompts take sdpa_prefill's fused route (cuDNN or FlashAttention-2)
  inside the graph;
- the engine's greedy tokens with prefill graphs equal the padded-eager engine's.
Teeth: replays whose logit-rows buffer is not refreshed (the captured step's rows) give other logits.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedkit.engine import Engine, SamplingParams
from pagedkit.kernels.triton import sdpa_prefill

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

REL = 1e-2  # graphs vs plain eager: max |diff| <= REL x max |ref| (fp16 GEMMs over another row count)


def _models(model_dir):
    kw = dict(max_batch_size=8, max_num_tokens=1024, enable_prefix_caching=False)
    return (Engine(model_dir, "cuda", cuda_graphs=True, **kw).model,
            Engine(model_dir, "cuda", cuda_graphs="padded", **kw).model,
            Engine(model_dir, "cuda", cuda_graphs=False, **kw).model)


def _run(model, batches, seed, vocab=144, steps=3):
    """Each batch of prompt lengths: one prefill step of fresh random prompts (the last row of each read), then
    `steps` teacher-forced decode steps; the logits (float32) of every step, in order."""
    mgr, rng = model.mgr, random.Random(seed)
    out = []
    for lengths in batches:
        prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
        sids = [f"s{i}" for i in range(len(prompts))]
        for s, p in zip(sids, prompts):
            mgr.add_sequence(s, p)
        plan = model.plan(list(zip(sids, prompts)))
        ends = [sum(lengths[: i + 1]) - 1 for i in range(len(lengths))]
        out.append(model.run(plan, [t for p in prompts for t in p], ends).float().clone())
        mgr.commit(plan)
        for _ in range(steps):
            ids = [rng.randrange(3, vocab) for _ in sids]
            plan = model.plan([(s, [t]) for s, t in zip(sids, ids)])
            out.append(model.run(plan, ids).float().clone())
            mgr.commit(plan)
        for s in sids:
            mgr.free(s)
    torch.cuda.synchronize()
    return out


BATCHES = [[100], [97], [120], [200, 160], [190, 201], [20]]  # keys (1, 128) x3, (2, 256) x2, (1, 32)


def test_prefill_replays_equal_the_padded_eager_steps(tiny_llama):
    graphs, padded, plain = _models(tiny_llama)
    got = _run(graphs, BATCHES, 5)
    same = _run(padded, BATCHES, 5)
    ref = _run(plain, BATCHES, 5)
    st = graphs.prefill_graphs.stats
    assert st.capture_error is None, st.capture_error
    assert st.captured == 3 and st.replays == 3, st
    for i, (g, s, r) in enumerate(zip(got, same, ref)):
        assert torch.equal(g, s), f"step {i}: the replay differs from the same padded step run eagerly"
        rel = float((g - r).abs().max() / r.abs().max())
        assert rel <= REL, f"step {i}: graphs vs plain eager max |diff| {rel:.3g} x max |ref|"
    assert sdpa_prefill.LAST_ROUTE in ("cudnn", "flash"), sdpa_prefill.LAST_ROUTE


def test_engine_tokens_with_prefill_graphs(tiny_llama):
    """One request alone (a batch-1 key), then ten at once: the first step's prompts (4 x 128 <= 1024 tokens) are
    one graph step; later admissions share steps with running sequences (eager)."""
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 144) for _ in range(rng.randrange(5, 100))] for _ in range(10)]
    sp = SamplingParams(max_new_tokens=16, ignore_eos=True)
    kw = dict(max_batch_size=4, max_num_tokens=1024)
    eng = Engine(tiny_llama, "cuda", **kw)
    ref = Engine(tiny_llama, "cuda", cuda_graphs="padded", **kw)
    for e in (eng, ref):
        e.out = [o.token_ids for o in e.generate(prompts[:1], sp)] + [o.token_ids for o in e.generate(prompts, sp)]
    assert eng.out == ref.out
    st = eng.model.prefill_graphs.stats
    assert eng.stats.prefill_graph_steps >= 2 and st.captured >= 2 and st.capture_error is None, (eng.stats, st)
    assert eng.check_invariants() == []
    assert all(eng.num_free_blocks()[g] == n for g, n in eng.num_blocks().items())


def test_teeth_stale_rows_change_the_logits(tiny_llama, monkeypatch):
    """Replays that keep the captured step's logit rows (a longer prompt of the same bucket reads an earlier
    row) must differ from the padded eager steps: the bit-for-bit comparison above has teeth."""
    graphs, padded, _ = _models(tiny_llama)
    pg = graphs.prefill_graphs
    real = pg._write

    def stale(query_lens, token_ids, L, rows, B):
        ids, feed = real(query_lens, token_ids, L, rows if not pg.stats.captured else None, B)
        return ids, (feed if feed is not None else pg.rows[:B])

    monkeypatch.setattr(pg, "_write", stale)
    got = _run(graphs, [[100], [120]], 5, steps=0)
    same = _run(padded, [[100], [120]], 5, steps=0)
    assert pg.stats.replays == 1
    assert not torch.equal(got[1], same[1]), "stale logit rows went unnoticed"
