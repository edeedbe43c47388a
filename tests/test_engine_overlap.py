"""Overlapped decode (engine/overlap.py) on the CPU: greedy decode steps launched one step ahead of the host,
their input ids taken on the device from the previous step's choices. The oracle is the same engine without
overlap (the same padded plans and kernels: outputs must be identical), and each request run alone through
the single-sequence Generator (test_engine.assert_same_greedy: near-ties reported). Teeth: feeding the chained
step the wrong ids, or leaving the placeholders in the prefix cache, fails these tests.
"""

from __future__ import annotations

import pytest
import torch

from pagedkit.engine import Engine, SamplingParams
from pagedkit.engine import engine as engine_mod
from pagedkit.runtime.kv.cache import KVCacheManager

from pagedkit.runtime.generate import Generator
from test_engine import assert_pool_free, assert_same_greedy, check_stream, prompts_of, run_all


@pytest.fixture(scope="module")
def oracle(tiny_llama) -> Generator:
    return Generator(tiny_llama)


def _engine(model, overlap, **kw):
    kw.setdefault("max_batch_size", 8)
    kw.setdefault("max_num_tokens", 128)
    return Engine(model, cuda_graphs="padded", overlap=overlap, **kw)


def _finals(outs):
    return {rid: check_stream(o) for rid, o in outs.items()}


def _requests(n=5, seed=3):
    prompts = prompts_of([7, 19, 4, 30, 12, 9, 25][:n], seed=seed)
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in (9, 14, 5, 11, 20, 8, 16)[:n]]
    return prompts, params


def test_overlap_gives_the_synchronous_tokens_and_runs_ahead(tiny_llama, oracle):
    prompts, params = _requests()
    got = {}
    for overlap in (False, True):
        eng = _engine(tiny_llama, overlap)
        rids = [eng.add_request(p, sp, request_id=f"r{i}") for i, (p, sp) in enumerate(zip(prompts, params))]
        outs = run_all(eng)
        got[overlap] = [_finals(outs)[r] for r in rids]
        assert_pool_free(eng)
        if overlap:
            assert eng.overlap and eng.stats.overlapped_steps >= 10, eng.stats
        else:
            assert eng.stats.overlapped_steps == 0
    assert got[True] == got[False]
    for toks, p, sp in zip(got[True], prompts, params):
        assert len(toks) == sp.max_new_tokens
        assert_same_greedy(toks, oracle, p, sp.max_new_tokens, "overlap", ignore_eos=True)


def test_tokens_come_one_step_later_and_stream_in_order(tiny_llama):
    eng = _engine(tiny_llama, True)
    rid = eng.add_request(prompts_of([6])[0], SamplingParams(max_new_tokens=6, ignore_eos=True))
    seen = [len(o.new_token_ids) for o in eng.step() if o.request_id == rid]  # prefill: first token now
    assert seen == [1]
    assert eng.step() == [] and eng._inflight is not None  # the first decode step is launched, not read
    counts = []
    while eng.has_unfinished():
        counts += [len(o.new_token_ids) for o in eng.step() if o.request_id == rid]
    assert counts == [1] * 5 and eng.stats.overlapped_steps >= 3
    assert_pool_free(eng)


def test_stop_tokens_and_sequences_end_in_flight_requests(tiny_llama, oracle):
    prompts, params = _requests(4, seed=11)
    plain = _engine(tiny_llama, False)
    ref = [plain.generate([p], SamplingParams(max_new_tokens=12, ignore_eos=True))[0].token_ids for p in prompts]
    # stop on a token each request emits mid-way, and on a 2-token sequence of another
    stops = [SamplingParams(max_new_tokens=12, stop_token_ids=(ref[0][4],)),
             SamplingParams(max_new_tokens=12, stop_sequences=(tuple(ref[1][3:5]),)),
             SamplingParams(max_new_tokens=12, stop_token_ids=(ref[2][1],)),
             SamplingParams(max_new_tokens=12, ignore_eos=True)]
    res = {}
    for overlap in (False, True):
        eng = _engine(tiny_llama, overlap)
        rids = [eng.add_request(p, sp) for p, sp in zip(prompts, stops)]
        outs = run_all(eng)
        res[overlap] = [(outs[r][-1].token_ids, outs[r][-1].finish_reason) for r in rids]
        for r in rids:
            check_stream(outs[r])
        assert_pool_free(eng)
    assert res[True] == res[False]
    assert [f for _, f in res[True]] == ["stop", "stop", "stop", "length"]
    assert res[True][1][0] == ref[1][:3]  # the matched sequence is not part of the output


def test_arrivals_sampling_and_aborts_fall_back_and_match(tiny_llama, oracle):
    prompts, params = _requests(5, seed=5)
    params[3] = SamplingParams(max_new_tokens=7, temperature=0.8, top_p=0.9, seed=4)
    arrive = {0: [0, 1], 3: [2], 6: [3], 9: [4]}  # step index -> requests added before it
    res = {}
    for overlap in (False, True):
        eng = _engine(tiny_llama, overlap, max_batch_size=4)
        outs, step = {}, 0
        while eng.has_unfinished() or step <= max(arrive):
            for i in arrive.get(step, []):
                outs[eng.add_request(prompts[i], params[i], request_id=f"r{i}")] = []
            for o in eng.step():
                outs[o.request_id].append(o)
            step += 1
        res[overlap] = [check_stream(outs[f"r{i}"]) for i in range(5)]
        assert_pool_free(eng)
        if overlap:
            assert eng.stats.overlapped_steps >= 5, eng.stats
    assert res[True][3] == res[False][3] and len(res[True][3]) == 7  # the seeded sampled request
    for i in (0, 1, 2, 4):
        assert_same_greedy(res[True][i], oracle, prompts[i], params[i].max_new_tokens, f"arrivals r{i}",
                           ignore_eos=True)
    # abort a request while its step is in flight: the others finish, nothing leaks
    eng = _engine(tiny_llama, True)
    a = eng.add_request(prompts[0], SamplingParams(max_new_tokens=30, ignore_eos=True))
    b = eng.add_request(prompts[1], params[1])
    for _ in range(5):
        eng.step()
    assert eng._inflight is not None
    eng.abort(a)
    outs = run_all(eng)
    assert outs[a][-1].finish_reason == "abort"
    assert_same_greedy(outs[b][-1].token_ids, oracle, prompts[1], params[1].max_new_tokens, "after abort",
                       ignore_eos=True)
    assert_pool_free(eng)


def test_prefix_cache_sees_the_real_ids_of_overlapped_steps(tiny_llama):
    """A request's generated tokens are hashed into the prefix cache with their real ids: a follow-up prompt
    of prompt + output hits its full blocks (placeholders there would hash differently: no hit)."""
    prompt = prompts_of([20], seed=9)[0]
    hits = {}
    for overlap in (False, True):
        eng = _engine(tiny_llama, overlap, enable_prefix_caching=True)
        first = eng.generate([prompt], SamplingParams(max_new_tokens=40, ignore_eos=True))[0].token_ids
        assert eng.stats.overlapped_steps >= (30 if overlap else 0)
        before = eng.stats.prefix_hit_tokens
        eng.generate([prompt + first + [5]], SamplingParams(max_new_tokens=2, ignore_eos=True))
        hits[overlap] = eng.stats.prefix_hit_tokens - before
        assert_pool_free(eng)
    bs = _engine(tiny_llama, False).model.block_size
    assert hits[True] == hits[False] == (len(prompt) + 40) // bs * bs > len(prompt)


def test_set_tokens_refuses_hashed_positions(tiny_llama):
    mgr: KVCacheManager = _engine(tiny_llama, False, enable_prefix_caching=True).kv
    bs = mgr.config.groups[0].block_size
    mgr.add_sequence("s", list(range(3, 3 + bs + 2)))
    plan = mgr.plan([("s", list(range(3, 3 + bs + 2)))])
    mgr.commit(plan)
    with pytest.raises(ValueError, match="set_tokens: positions"):
        mgr.set_tokens("s", 0, [7])
    mgr.set_tokens("s", bs, [7])  # not hashed yet
    assert mgr.seqs["s"].token_ids[bs] == 7


def test_overlap_needs_graphs(tiny_llama):
    with pytest.raises(ValueError, match="overlap=True needs cuda_graphs"):
        Engine(tiny_llama, cuda_graphs=False, overlap=True)
    with pytest.raises(ValueError, match="overlap must be"):
        Engine(tiny_llama, cuda_graphs="padded", overlap="yes")
    assert Engine(tiny_llama, cuda_graphs="padded").overlap is False  # None: on with real CUDA graphs only


def test_teeth_wrong_device_ids_or_placeholders_are_caught(tiny_llama, monkeypatch):
    prompts, params = _requests(3)
    plain = _engine(tiny_llama, False)
    ref = [o.token_ids for o in plain.generate(prompts, params)]
    # (1) the chained step fed zeros instead of the previous step's choices
    launch = engine_mod.Engine._launch

    def wrong(self, entries, plan, device_ids):
        return launch(self, entries, plan, None if device_ids is None else torch.zeros_like(device_ids))

    monkeypatch.setattr(engine_mod.Engine, "_launch", wrong)
    got = [o.token_ids for o in _engine(tiny_llama, True).generate(prompts, params)]
    assert got != ref
    monkeypatch.undo()
    # (2) placeholders left in the manager: the prefix cache misses the generated blocks
    monkeypatch.setattr(KVCacheManager, "set_tokens", lambda self, *a: None)
    eng = _engine(tiny_llama, True, enable_prefix_caching=True)
    p = prompts_of([20], seed=9)[0]
    first = eng.generate([p], SamplingParams(max_new_tokens=40, ignore_eos=True))[0].token_ids
    before = eng.stats.prefix_hit_tokens
    eng.generate([p + first + [5]], SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert eng.stats.prefix_hit_tokens - before < (len(p) + 40) // eng.model.block_size * eng.model.block_size


def test_a_step_graphs_stop_serving_is_not_chained(tiny_llama):
    """When the graphs stop serving decode steps (a failed capture), the planned next step is aborted, not
    chained: the engine runs synchronous steps from then on with the same tokens and no leaked slots."""
    prompts, params = _requests(3)
    ref = [o.token_ids for o in _engine(tiny_llama, False).generate(prompts, params)]
    eng = _engine(tiny_llama, True)
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    outs = {r: [] for r in rids}
    for step in range(200):
        if step == 4:
            assert eng._inflight is not None
            eng.model.graphs.stats.capture_error = "test: capture failed"
            chained = eng.stats.overlapped_steps
        for o in eng.step():
            outs[o.request_id].append(o)
        if not eng.has_unfinished():
            break
    assert eng.stats.overlapped_steps == chained  # nothing chained after the graphs stopped serving
    assert [check_stream(outs[r]) for r in rids] == ref
    assert_pool_free(eng)
