"""Speculative decoding in the engine (n-gram prompt lookup and request drafters) on the CPU: greedy output
equals the single-sequence Generator alone (non-speculative), seeded sampling equals non-speculative
seeded sampling, and the cache holds exactly the accepted tokens after every step."""

from __future__ import annotations

import math

import pytest

from pagedkit.engine import Engine, SamplingParams, ngram_draft
from pagedkit.engine import engine as engine_mod
from pagedkit.runtime.kv.cache import KVCacheManager
import test_engine
from test_engine import assert_pool_free, assert_same_greedy, check_stream, greedy_alone, prompts_of

oracle = test_engine.oracle  # the session fixture (tiny_llama: conftest.py)


def test_ngram_draft():
    assert ngram_draft([1, 2, 3, 4, 9, 1, 2, 3], 3) == [4, 9, 1]  # 3-gram [1, 2, 3] seen at 0
    assert ngram_draft([5, 1, 2, 7, 7, 1, 2, 6, 8, 2], 2) == [6, 8]  # 1-gram [2], its latest earlier occurrence
    assert ngram_draft([4, 8, 4, 8, 4, 8], 4) == [4, 8]  # latest occurrence of [8, 4, 8]: what follows it
    assert ngram_draft([1, 2, 3], 2) == [] and ngram_draft([7], 3) == [] and ngram_draft([1, 1], 0) == []
    assert ngram_draft([3, 9, 3], 5) == [9, 3]


def _step_checking_cache(engine: Engine, max_steps=500):
    """Step to completion; after every step each running request's cache holds all its tokens but the
    last sampled one (no rejected draft left) and no block beyond them."""
    outs = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        for r in engine.running:
            n = engine.kv.length(r.request_id)
            if r.decoding:
                assert n == len(r.tokens) - 1, (r.request_id, n, len(r.tokens))
            assert len(engine.kv.block_table_row(r.request_id, "full")) == math.ceil(n / engine.model.block_size)
    assert not engine.has_unfinished()
    return outs


def _repetitive_prompts():
    a, b, c = prompts_of((6, 5, 9), seed=20)
    return [a * 4 + b, b * 3, c + a + c + a[:3], prompts_of((13,), seed=21)[0]]


def test_ngram_speculation_equals_greedy(tiny_llama, oracle):
    prompts = _repetitive_prompts()
    engine = Engine(tiny_llama, max_batch_size=4, max_num_tokens=64)
    for i, p in enumerate(prompts):  # one request without speculation in the same batches
        engine.add_request(p, SamplingParams(max_new_tokens=16, num_draft_tokens=0 if i == 3 else 4, ignore_eos=True))
    outs = _step_checking_cache(engine)
    for o, p in zip(outs.values(), prompts):
        assert_same_greedy(check_stream(o), oracle, p, 16, "n-gram speculation", ignore_eos=True)
    assert engine.stats.draft_tokens > 0 and engine.stats.accepted_draft_tokens > 0
    assert engine.stats.accepted_draft_tokens < engine.stats.draft_tokens  # some drafts were rolled back
    assert_pool_free(engine)


def test_oracle_and_wrong_drafters(tiny_llama, oracle):
    prompt = prompts_of((11,), seed=22)[0]
    ref, _ = greedy_alone(oracle, prompt, 18, ignore_eos=True)
    n0 = len(prompt)

    def right(tokens):  # the true continuation: every draft is accepted
        return ref[len(tokens) - n0:]

    def wrong(tokens):  # never the greedy choice
        return [(t + 1) % 144 for t in ref[len(tokens) - n0:]]

    engine = Engine(tiny_llama, max_batch_size=2)
    sp = SamplingParams(max_new_tokens=18, num_draft_tokens=5, ignore_eos=True)
    good = engine.add_request(prompt, sp, drafter=right)
    outs = _step_checking_cache(engine)
    assert check_stream(outs[good]) == ref
    # prefill (token 1), then 6 + 6 + 5 tokens: 5, 5 and 4 drafts (no draft beyond max_new_tokens)
    assert engine.stats.steps == 4 and engine.stats.accepted_draft_tokens == engine.stats.draft_tokens == 14
    bad = engine.add_request(prompt, sp, drafter=wrong)
    outs = _step_checking_cache(engine)
    assert check_stream(outs[bad]) == ref and engine.stats.accepted_draft_tokens == 14  # none of the wrong ones
    # drafts never run past max_new_tokens or an eos
    assert engine.generate([prompt], SamplingParams(max_new_tokens=4, num_draft_tokens=8, ignore_eos=True))[0] \
        .token_ids == ref[:4]
    engine.eos_token_ids = [ref[5]]
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=18, num_draft_tokens=8), drafter=right)
    out = _step_checking_cache(engine)[rid]
    assert out[-1].finish_reason == "stop" and check_stream(out) == ref[:ref.index(ref[5]) + 1]
    assert_pool_free(engine)


def test_seeded_sampling_with_speculation_equals_without(tiny_llama):
    prompts = _repetitive_prompts()[:3]
    engine = Engine(tiny_llama, max_batch_size=6)
    plain = engine.generate(prompts, [SamplingParams(max_new_tokens=14, temperature=0.7, seed=s, ignore_eos=True)
                                      for s in range(3)])
    spec = engine.generate(prompts, [SamplingParams(max_new_tokens=14, temperature=0.7, seed=s, ignore_eos=True,
                                                    num_draft_tokens=3) for s in range(3)])
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert engine.stats.draft_tokens > 0


def test_teeth_accepting_every_draft_fails(tiny_llama, oracle, monkeypatch):
    """Verification that keeps every (wrong) draft, without comparing with the target, gives wrong tokens."""
    prompt = prompts_of((11,), seed=22)[0]
    ref, _ = greedy_alone(oracle, prompt, 12, ignore_eos=True)

    def accept_all(e, rows, start):
        return e.ids[1:] + [rows.token(start + e.drafts, e.req.generator)]

    monkeypatch.setattr(engine_mod, "verify", accept_all)
    engine = Engine(tiny_llama, max_batch_size=2)
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=12, num_draft_tokens=3, ignore_eos=True),
                             drafter=lambda toks: [(t + 1) % 144 for t in toks[-3:]])
    assert _step_checking_cache(engine)[rid][-1].token_ids != ref


def test_teeth_cache_keeping_rejected_drafts_is_caught(tiny_llama, monkeypatch):
    original = KVCacheManager.accept
    monkeypatch.setattr(KVCacheManager, "accept", lambda self, sid, n: original(self, sid, self.seqs[sid].draft))
    engine = Engine(tiny_llama, max_batch_size=2)
    engine.add_request(prompts_of((9,), seed=23)[0], SamplingParams(max_new_tokens=8, num_draft_tokens=3,
                                                                     ignore_eos=True),
                       drafter=lambda toks: [(toks[-1] + 1) % 144] * 3)
    with pytest.raises(RuntimeError, match="the cache holds .* tokens, the engine counts"):
        _step_checking_cache(engine)


def test_drafter_errors_abort_only_that_request(tiny_llama):
    engine = Engine(tiny_llama, max_batch_size=2)
    with pytest.raises(TypeError, match="drafter must be a callable"):
        engine.add_request([1, 2], SamplingParams(num_draft_tokens=2), drafter=[1, 2])
    bad = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=4, num_draft_tokens=2), drafter=lambda t: [999])
    raises = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=4, num_draft_tokens=2),
                                drafter=lambda t: 1 / 0)
    fine = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=4))
    outs = _step_checking_cache(engine)
    assert outs[bad][-1].finish_reason == "abort"
    assert "draft token ids must be in [0, 144), got [999]" in outs[bad][-1].reason
    assert outs[raises][-1].finish_reason == "abort" and "ZeroDivisionError" in outs[raises][-1].reason
    assert outs[fine][-1].finish_reason == "length" and len(outs[fine][-1].token_ids) == 4  # the batch went on
    assert_pool_free(engine)
