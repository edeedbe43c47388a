"""Soak check of the continuous-batching engine: many requests of mixed lengths arriving over time
through a KV pool too small for them, so that the engine preempts (recompute) again and again.

Every request must complete ("length", or "stop" on an eos token) with the greedy tokens it gets when
run alone (the single-sequence Generator on the CPU: test_engine's oracle); batch composition may flip
a choice only at a reported near-tie (test_engine.assert_same_greedy). After every step the KV
manager's invariants hold and the cache holds what the engine counts; at the end no block leaks (every
block of every group free or evictable) and the manager holds no sequence.

Cases: "cpu" (CI: 60 requests), "cpu-500" (slow: the issue's 500 requests), "cuda" (gpu: 500 requests,
the engine's default CUDA graphs on; at least one decode step must be replayed as a graph).
"""

from __future__ import annotations

import random
import time

import pytest
import torch

import test_engine
from pagedkit.engine import Engine, SamplingParams
from test_engine import ENGINE_NEAR_TIES, assert_pool_free, assert_same_greedy, check_stream

oracle = test_engine.oracle  # the session fixture: Generator(tiny_llama) on the CPU (conftest.py)

VOCAB = 144  # tests/export_utils.TINY
BLOCK = 16  # the tiny export's block size
# Pool: 8 running requests of up to 96 + 32 tokens would need up to 8 x 8 blocks; 16 blocks hold the
# longest request alone (127 cached tokens = 8 blocks) but not the batch at its full lengths.
ENGINE_KW = dict(max_batch_size=8, max_num_tokens=64, num_blocks=16)
MAX_PROMPT, MAX_NEW = 96, 32


def soak_workload(n: int, seed: int) -> dict[int, list[tuple[list[int], SamplingParams]]]:
    """A seeded arrival schedule {step: [(prompt, params), ...]}: bursts and gaps between steps, mixed
    prompt lengths (1 .. MAX_PROMPT, every fifth one starting with a shared prefix so prefix-cache hits
    mix with preemption), max_new_tokens 1 .. MAX_NEW, one request in five stopping at eos."""
    rng = random.Random(seed)
    base = [rng.randrange(3, VOCAB) for _ in range(MAX_PROMPT)]
    schedule: dict[int, list] = {}
    step = 0
    for i in range(n):
        step += rng.choice((0, 0, 0, 1, 1, 2, 3, 6))
        length = rng.choice((rng.randint(1, 8), rng.randint(9, 40), rng.randint(41, MAX_PROMPT)))
        head = base[:rng.randint(BLOCK, 3 * BLOCK)] if i % 5 == 0 else []
        prompt = (head + [rng.randrange(3, VOCAB) for _ in range(length)])[:MAX_PROMPT]
        sp = SamplingParams(max_new_tokens=rng.randint(1, MAX_NEW), ignore_eos=rng.random() < 0.8)
        schedule.setdefault(step, []).append((prompt, sp))
    return schedule


def run_soak(engine: Engine, schedule: dict) -> tuple[dict, dict]:
    """Step the engine to completion, adding each step's arrivals before it runs; checks the invariants
    after every step. Returns ({request id: (prompt, params)}, {request id: [RequestOutput, ...]})."""
    schedule = dict(schedule)
    requests, outs, step = {}, {}, 0
    limit = 40 * sum(len(v) for v in schedule.values()) + 100
    while engine.has_unfinished() or schedule:
        for prompt, sp in schedule.pop(step, []):
            rid = engine.add_request(prompt, sp)
            requests[rid], outs[rid] = (prompt, sp), []
        for o in engine.step():
            outs[o.request_id].append(o)
        errs = engine.check_invariants()
        assert errs == [], f"step {step}: {errs}"
        ahead = {id(e.req) for e in engine._inflight.entries} if engine._inflight is not None else set()
        for r in engine.running:  # a step in flight (overlap) has cached one more token than the engine read
            assert engine.kv.length(r.request_id) == r.num_computed + (id(r) in ahead), f"step {step}: {r.request_id}"
        step += 1
        assert step < limit, f"no completion after {step} steps ({len(engine.running)} running, {len(engine.waiting)} waiting)"
    return requests, outs


def check_soak(engine: Engine, requests: dict, outs: dict, gen) -> None:
    """Every request finished normally with its tokens alone (near-ties reported); the pool is free."""
    eos = set(engine.eos_token_ids)
    for rid, (prompt, sp) in requests.items():
        tokens = check_stream(outs[rid])  # streamed pieces == final token_ids, one final output
        final = outs[rid][-1]
        what = f"{rid} (prompt {len(prompt)}, max_new_tokens {sp.max_new_tokens}, ignore_eos {sp.ignore_eos})"
        assert final.finish_reason in ("length", "stop"), f"{what}: {final.finish_reason} {final.reason}"
        if final.finish_reason == "length":
            assert len(tokens) == sp.max_new_tokens, what
        else:
            assert not sp.ignore_eos and tokens and tokens[-1] in eos, what
        assert_same_greedy(tokens, gen, prompt, sp.max_new_tokens, what, ignore_eos=sp.ignore_eos)
    assert_pool_free(engine)  # invariants, num_free_blocks == num_blocks, nothing running / waiting
    assert engine.kv.seqs == {}, f"the cache still holds sequences {list(engine.kv.seqs)}"


CASES = [
    pytest.param("cpu", 60, id="cpu"),
    pytest.param("cpu-overlap", 60, id="cpu-overlap"),
    pytest.param("cpu-overlap", 500, id="cpu-overlap-500", marks=pytest.mark.slow),
    pytest.param("cpu", 500, id="cpu-500", marks=pytest.mark.slow),
    pytest.param("cuda", 500, id="cuda", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("device,n", CASES)
def test_soak_preempting_pool(tiny_llama, oracle, device, n):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA (the engine on the GPU, CUDA graphs on by default)")
    if device == "cpu-overlap":  # overlapped decode (engine/overlap.py) over the graphs' padded plans
        device, kw = "cpu", dict(ENGINE_KW, cuda_graphs="padded", overlap=True)
    else:
        kw = ENGINE_KW
    engine = Engine(tiny_llama, device, **kw)
    t0 = time.perf_counter()
    requests, outs = run_soak(engine, soak_workload(n, seed=n))
    t_engine = time.perf_counter() - t0
    assert len(requests) == n
    ties_before = len(ENGINE_NEAR_TIES)
    check_soak(engine, requests, outs, oracle)
    st = engine.stats
    assert st.preemptions > 0, f"the pool never forced a preemption: {st}"
    if kw is not ENGINE_KW or device == "cuda":
        assert engine.overlap and st.overlapped_steps > 0, f"no decode step ran ahead of the host: {st}"
    if device == "cuda":
        graph_steps = getattr(st, "graph_steps", None)
        assert graph_steps is not None, "EngineStats has no graph_steps"
        assert graph_steps > 0, f"no decode step was served by CUDA graphs: {st}"
    print(f"soak {device} x {n}: {st.steps} steps, {st.preemptions} preemptions, {st.unadmitted} unadmitted, "
          f"max batch {st.max_batch}, prefix hits {st.prefix_hit_tokens}, "
          f"{len(ENGINE_NEAR_TIES) - ties_before} near-ties; engine {t_engine:.1f} s, "
          f"with the oracle {time.perf_counter() - t0:.1f} s")


def test_soak_teeth_one_wrong_token_is_caught(tiny_llama, oracle, monkeypatch):
    """A run where one request is fed a wrong token fails the soak comparison as "not a near-tie": once the
    pool has preempted, the first sampled row of a step whose choice is clearly decided (top-2 gap > 0.2 x
    max|logit|) gets its least likely token lifted to the top, so that request emits (and then feeds) it."""
    engine = Engine(tiny_llama, **ENGINE_KW)
    real = engine.model.run
    hit: list[int] = []

    def corrupt_once(plan, token_ids, rows=None):
        logits = real(plan, token_ids, rows)  # [len(rows), V] on the run device, the model's logits dtype
        if hit or engine.stats.preemptions == 0 or logits.shape[0] == 0:
            return logits
        row = logits[0].float()
        top = torch.topk(row, 2).values
        if float(top[0] - top[1]) <= 0.2 * float(row.abs().max()):
            return logits
        logits = logits.clone()
        worst = int(torch.argmin(row))
        logits[0, worst] = top[0] + 1.0
        hit.append(worst)
        return logits

    monkeypatch.setattr(engine.model, "run", corrupt_once)
    requests, outs = run_soak(engine, soak_workload(16, seed=3))
    assert hit, "the corruption never fired"
    with pytest.raises(AssertionError, match="not a near-tie"):
        check_soak(engine, requests, outs, oracle)
