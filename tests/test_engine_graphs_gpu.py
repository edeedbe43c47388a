"""CUDA-graph decode steps on the GPU (engine/graphs.py), `pytest -m gpu` on the H200:

- a replayed decode step gives bit-identical logits to the same padded step run eagerly (the same kernels:
  `cuda_graphs="padded"`), over steps that capture, replay and move to a larger batch / KV bucket;
- the replayed steps' logits match the plain eager step (no padding, exact metadata) within fp16 noise, and
  the engine's greedy tokens with graphs equal the padded-eager engine's;
- the same for an MLA model (DeepSeek-V2-Lite's dimensions, 2 layers, random weights) whose decode runs on
  the fused MLA kernel (triton_mla) inside the graph.
Teeth: a replay whose input ids buffer is not refreshed (the previous step's ids) gives other logits.
"""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from pagedkit.engine import Engine, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

REL = 1e-2  # graphs vs plain eager: max |diff| <= REL x max |ref| (fp16 GEMMs over another row count)


def _prompts(n, seed, vocab, lo=5, hi=100):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _run(model, prompts, steps, seed, vocab, grow_to=None):
    """Prefill the prompts, then `steps` teacher-forced decode steps (seeded ids); the batch grows to
    grow_to sequences halfway (a new bucket). Logits [B, V] float32 of every decode step."""
    mgr, rng = model.mgr, random.Random(seed)
    sids = []

    def add(p):
        s = f"s{len(sids)}"
        mgr.add_sequence(s, p)
        plan = model.plan([(s, p)])
        model.run(plan, p, [len(p) - 1])
        mgr.commit(plan)
        sids.append(s)

    for p in prompts:
        add(p)
    out = []
    for i in range(steps):
        if grow_to and i == steps // 2:
            for p in _prompts(grow_to - len(sids), seed + 1, vocab):
                add(p)
        ids = [rng.randrange(3, vocab) for _ in sids]
        plan = model.plan([(s, [t]) for s, t in zip(sids, ids)])
        out.append(model.run(plan, ids).float().clone())
        mgr.commit(plan)
    for s in sids:
        mgr.free(s)
    torch.cuda.synchronize()
    return out


def _models(model_dir, **kw):
    kw = dict(max_batch_size=16, max_num_tokens=2048) | kw
    return (Engine(model_dir, "cuda", cuda_graphs=True, **kw).model,
            Engine(model_dir, "cuda", cuda_graphs="padded", **kw).model,
            Engine(model_dir, "cuda", cuda_graphs=False, **kw).model)


def _check(model_dir, vocab, variant):
    graphs, padded, plain = _models(model_dir)
    prompts = _prompts(3, 1, vocab)
    got = _run(graphs, prompts, 8, 5, vocab, grow_to=6)
    same = _run(padded, prompts, 8, 5, vocab, grow_to=6)
    ref = _run(plain, prompts, 8, 5, vocab, grow_to=6)
    st = graphs.graphs.stats
    assert st.captured >= 2 and st.replays >= 5, st  # buckets 4 and 8 captured, the other steps replayed
    for i, (g, s, r) in enumerate(zip(got, same, ref)):
        assert torch.equal(g, s), f"step {i}: the replay differs from the same padded step run eagerly"
        rel = float((g - r).abs().max() / r.abs().max())
        assert rel <= REL, f"step {i}: graphs vs plain eager max |diff| {rel:.3g} x max |ref|"
    ran = set(graphs.session.last_run_variants.values())
    assert variant in ran, ran


def test_graphs_llama(tiny_llama):
    _check(tiny_llama, 144, "triton_paged")


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("dsv2lite") / "onnx"
    subprocess.run([sys.executable, "-m", "pagedkit.exporters.cli", "--model", "deepseek-v2-lite", "--num-layers",
                    "2", "--num-experts", "8", "--max-seq-len", "1024", "--block-size", "64", "--output", str(out),
                    "--quiet"], check=True)
    return out


def test_graphs_deepseek_mla(deepseek_dir):
    _check(deepseek_dir, 102400, "triton_mla")


def test_graph_engine_tokens(tiny_llama):
    prompts = _prompts(12, 3, 144, hi=60)
    sp = SamplingParams(max_new_tokens=24, ignore_eos=True)
    eng = Engine(tiny_llama, "cuda", max_batch_size=8, max_num_tokens=256)
    ref = Engine(tiny_llama, "cuda", max_batch_size=8, max_num_tokens=256, cuda_graphs="padded")
    got = [o.token_ids for o in eng.generate(prompts, sp)]
    assert got == [o.token_ids for o in ref.generate(prompts, sp)]
    assert eng.stats.graph_steps > 0 and eng.model.graphs.stats.replays > 0
    assert eng.check_invariants() == []
    assert all(eng.num_free_blocks()[g] == n for g, n in eng.num_blocks().items())


def test_teeth_stale_input_ids_change_the_logits(tiny_llama, monkeypatch):
    """Replays that skip refreshing the persistent input ids (they keep the captured step's ids) must differ
    from the padded eager steps: the bit-for-bit comparison above has teeth."""
    graphs, padded, _ = _models(tiny_llama)
    g = graphs.graphs
    real = g._write_ids

    def stale(bp, token_ids):
        return g.ids[:bp] if g.stats.captured else real(bp, token_ids)

    monkeypatch.setattr(g, "_write_ids", stale)
    prompts = _prompts(3, 1, 144)
    got = _run(graphs, prompts, 6, 5, 144)
    same = _run(padded, prompts, 6, 5, 144)
    assert g.stats.replays >= 4
    assert any(not torch.equal(a, b) for a, b in zip(got, same)), "stale input ids went unnoticed"
