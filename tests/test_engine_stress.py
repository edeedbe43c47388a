"""A seeded random workload through a small pool: random arrival steps, prompt lengths (some sharing a
prefix), sampling modes, stop sequences, speculation and aborts. After every step the KV manager's
invariants hold and the cache holds exactly what the engine counts; at the end the pool is fully free;
every greedy request that was not aborted equals the Generator alone."""

from __future__ import annotations

import random

import test_engine
from pagedkit.engine import Engine, SamplingParams
from test_engine import assert_pool_free, check_stream, greedy_alone

oracle = test_engine.oracle  # the session fixture (tiny_llama: conftest.py)


def test_random_workload(tiny_llama, oracle):
    rng = random.Random(7)
    engine = Engine(tiny_llama, max_batch_size=5, max_num_tokens=40, num_blocks=6)
    base = [rng.randrange(3, 144) for _ in range(48)]
    plan = {}  # step -> [(prompt, params)]
    for i in range(24):
        n = rng.choice((1, 4, 13, 30, 47))
        prompt = base[:n] if i % 3 == 0 else [rng.randrange(3, 144) for _ in range(n)]
        kind = rng.choice(("greedy", "greedy", "spec", "sample", "stopseq"))
        sp = SamplingParams(max_new_tokens=rng.choice((1, 6, 14)), ignore_eos=True,
                            temperature=0.9 if kind == "sample" else 0.0, top_k=20 if kind == "sample" else 0,
                            seed=i, num_draft_tokens=3 if kind == "spec" else 0,
                            stop_sequences=((rng.randrange(3, 144), rng.randrange(3, 144)),) if kind == "stopseq" else ())
        plan.setdefault(rng.randrange(0, 30), []).append((prompt, sp))
    requests, outs, step = {}, {}, 0
    while engine.has_unfinished() or plan:
        for prompt, sp in plan.pop(step, []):
            requests[engine.add_request(prompt, sp)] = (prompt, sp)
        if step % 7 == 3 and engine.running:  # abort someone running now and then
            engine.abort(rng.choice(engine.running).request_id)
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        assert engine.check_invariants() == []
        for r in engine.running:
            assert engine.kv.length(r.request_id) == r.num_computed
        step += 1
        assert step < 1000
    assert engine.stats.preemptions > 0 and engine.stats.prefix_hit_tokens > 0 and engine.stats.draft_tokens > 0
    reasons = {}
    for rid, (prompt, sp) in requests.items():
        final = check_stream(outs[rid])
        reason = outs[rid][-1].finish_reason
        reasons[reason] = reasons.get(reason, 0) + 1
        if reason == "abort":
            continue
        if sp.temperature == 0:
            ref, _ = greedy_alone(oracle, prompt, sp.max_new_tokens, ignore_eos=True)
            if sp.stop_sequences:  # the reference cut at the first match of the stop sequence
                seq = list(sp.stop_sequences[0])
                cut = next((i for i in range(len(ref) - 1) if ref[i:i + 2] == seq), None)
                ref = ref if cut is None else ref[:cut]
                assert reason == ("length" if cut is None else "stop")
            assert final == ref, (rid, prompt, sp)
    print(engine.stats, reasons)
    assert reasons.get("abort", 0) > 0 and reasons.get("length", 0) > 0
    assert_pool_free(engine)
