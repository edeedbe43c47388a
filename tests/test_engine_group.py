"""Engine.add_group (OpenAI's n): n requests of one prompt whose prompt is prefilled ONCE; each then gets the
prompt's blocks (KVCacheManager.fork) and its own tokens.

- greedy: the n outputs equal each other and the same request run alone (the real tiny model), and the engine
  fed the prompt once: tokens fed = prompt - prefix hit + each choice's decode steps (counted by the engine and
  by a wrapper of the model's run that sums the plans' query lengths);
- seeded sampling (a scripted model: fixed distributions): the n outputs differ, and choice i equals a lone
  request with choice i's seed; two groups and a plain request share the steps (rows not mixed up);
- aborting a sibling or the parent before the fork, a group that must wait for batch room, preemption of the
  forked children on a small pool, the cached prompt tokens reported, the pool whole at the end.
Teeth: add_group as n separate requests (prefill n times), the siblings drawing with one seed, the siblings'
first token from another row, a fork that forgets the cache all fail the checks.
"""

from __future__ import annotations

import pytest
import torch

from pagedkit.engine import Engine, SamplingParams
from pagedkit.engine import group as group_mod
from scripted_engine import VOCAB, ScriptedModel, drive, scripted_engine

PROMPT = [1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61, 65, 69, 73, 77, 3]  # 21 tokens: 2 blocks


def tokens_of(outs, rid):
    return [t for o in outs[rid] for t in o.new_token_ids]


def fed_tokens(engine):
    """Wrap the model's run: a list that sums each step's query lengths (tokens the model computed)."""
    fed, real = [0], engine.model.run

    def run(plan, token_ids, rows=None, device_ids=None):
        fed[0] += sum(plan.query_lens)
        return real(plan, token_ids, rows, device_ids)

    engine.model.run = run
    return fed


def check_greedy_group(engine: Engine, n: int = 4, new: int = 12):
    alone = engine.generate([PROMPT], SamplingParams(max_new_tokens=new, ignore_eos=True))[0].token_ids
    engine.kv.clear_prefix_cache()
    fed, tokens0, hits0 = fed_tokens(engine), engine.stats.tokens, engine.stats.prefix_hit_tokens
    ids = engine.add_group(PROMPT, [SamplingParams(max_new_tokens=new, ignore_eos=True)] * n)
    outs = drive(engine)
    got = [tokens_of(outs, rid) for rid in ids]
    assert got == [alone] * n, f"the group's greedy outputs {got}, alone {alone}"
    hits = engine.stats.prefix_hit_tokens - hits0
    once = len(PROMPT) - hits + n * (new - 1)
    assert engine.stats.tokens - tokens0 == once == fed[0], \
        f"prefill: the engine fed {engine.stats.tokens - tokens0} tokens ({fed[0]} through the model), " \
        f"prompt once = {once}"
    assert all(outs[rid][-1].num_cached_tokens == hits for rid in ids)
    assert engine.num_free_blocks() == engine.num_blocks() and engine.check_invariants() == []


def test_greedy_group_prefills_once_and_equals_alone():
    check_greedy_group(scripted_engine(max_batch_size=8, max_num_tokens=64))


def test_teeth_group_as_separate_requests(monkeypatch):
    def separate(self, prompt, params, request_ids=None):
        return [self.add_request(prompt, p) for p in params]

    monkeypatch.setattr(Engine, "add_group", separate)
    with pytest.raises(AssertionError, match="prompt once"):
        check_greedy_group(scripted_engine(max_batch_size=8, max_num_tokens=64))


def test_teeth_fork_without_the_cache(monkeypatch):
    """A sibling given a fresh sequence instead of the parent's blocks (its cache empty) is caught."""
    def no_fork(self, parent, child):
        self.add_sequence(child, self.length(parent))
        self.seqs[child].length = self.length(parent)

    import pagedkit.runtime.kv.cache as cache_mod
    monkeypatch.setattr(cache_mod.KVCacheManager, "fork", no_fork)
    with pytest.raises(AssertionError, match="greedy outputs"):
        check_greedy_group(scripted_engine(max_batch_size=8, max_num_tokens=64))


# ---- seeded sampling over a scripted model ------------------------------------------------------------------

def flat_logits(req, context) -> torch.Tensor:
    g = torch.Generator().manual_seed(len(context))
    return torch.randn(VOCAB, generator=g)  # a wide distribution: 4 draws almost surely differ


def sampled(seed):
    return SamplingParams(max_new_tokens=10, temperature=1.0, seed=seed, ignore_eos=True)


def check_seeded_groups():
    engine = scripted_engine(max_batch_size=12, max_num_tokens=64)
    ScriptedModel(engine, flat_logits)
    lone = {s: engine.generate([PROMPT], sampled(s))[0].token_ids for s in range(10, 14)}
    lone.update({s: engine.generate([PROMPT[:7]], sampled(s))[0].token_ids for s in range(20, 23)})
    a = engine.add_group(PROMPT, [sampled(s) for s in range(10, 14)])
    plain = engine.add_request([1, 2, 3], sampled(99))
    b = engine.add_group(PROMPT[:7], [sampled(s) for s in range(20, 23)])
    outs = drive(engine)
    got_a, got_b = [tokens_of(outs, r) for r in a], [tokens_of(outs, r) for r in b]
    assert len({tuple(t) for t in got_a}) == 4 and len({tuple(t) for t in got_b}) == 3, (got_a, got_b)
    assert got_a == [lone[s] for s in range(10, 14)], "choice i differs from a lone request with its seed"
    assert got_b == [lone[s] for s in range(20, 23)], "choice i differs from a lone request with its seed"
    assert len(tokens_of(outs, plain)) == 10 and engine.stats.max_batch == 8
    assert engine.num_free_blocks() == engine.num_blocks() and engine.check_invariants() == []


def test_seeded_group_gives_different_choices_each_its_seeds():
    check_seeded_groups()


def test_teeth_siblings_draw_from_another_row(monkeypatch):
    real = group_mod.fork_siblings
    monkeypatch.setattr(group_mod, "fork_siblings",
                        lambda engine, parent, rows, row, outputs: real(engine, parent, rows,
                                                                        (row + 1) % len(rows.params), outputs))
    with pytest.raises(AssertionError, match="lone request"):
        check_seeded_groups()


def test_teeth_siblings_share_one_seed(monkeypatch):
    real = Engine.add_group
    monkeypatch.setattr(Engine, "add_group", lambda self, prompt, params, request_ids=None:
                        real(self, prompt, [params[0]] * len(params), request_ids))
    with pytest.raises(AssertionError):
        check_seeded_groups()


# ---- aborts, batch room, preemption, cached tokens ----------------------------------------------------------

def test_abort_before_the_fork_and_batch_room():
    engine = scripted_engine(max_batch_size=4, max_num_tokens=8)  # a 21-token prompt takes 3 prefill steps
    greedy = SamplingParams(max_new_tokens=6, ignore_eos=True)
    ref = engine.generate([PROMPT], greedy)[0].token_ids
    engine.kv.clear_prefix_cache()
    busy = [engine.add_request([1, 7 + i], SamplingParams(max_new_tokens=30, ignore_eos=True)) for i in range(2)]
    ids = engine.add_group(PROMPT, [greedy] * 3)  # needs 3 slots: waits until a busy one ends
    engine.step()
    assert engine.waiting and engine.waiting[0].request_id == ids[0] and len(engine.running) == 2
    engine.abort(busy[0])
    engine.step()
    engine.abort(ids[1])  # a sibling, before the fork
    engine.abort(ids[0])  # the parent, mid-prefill: the last sibling goes on alone
    outs = drive(engine)
    assert outs[ids[1]][-1].finish_reason == "abort" and outs[ids[0]][-1].finish_reason == "abort"
    assert tokens_of(outs, ids[2]) == ref and outs[ids[2]][-1].finish_reason == "length"
    assert engine.num_free_blocks() == engine.num_blocks() and engine.check_invariants() == []


def test_group_checks():
    engine = scripted_engine(max_batch_size=4)
    with pytest.raises(ValueError, match="max_batch_size is 4"):
        engine.add_group([1, 2], [SamplingParams()] * 5)
    with pytest.raises(ValueError, match="share their SamplingParams"):
        engine.add_group([1, 2], [SamplingParams(), SamplingParams(temperature=1.0)])
    with pytest.raises(ValueError, match="request ids"):
        engine.add_group([1, 2], [SamplingParams()] * 2, request_ids=["a"])
    # a group that can never fit the pool is refused whole, with the reason
    small = scripted_engine(max_batch_size=4, num_blocks=2)
    ids = small.add_group(PROMPT, [SamplingParams(max_new_tokens=40)] * 3)
    outs = drive(small)
    assert all(outs[r][-1].finish_reason == "abort" and "never hold" in outs[r][-1].reason for r in ids)
    assert not small.has_unfinished() and small.check_invariants() == []


def test_forked_children_preempted_on_a_small_pool_recompute_the_same():
    greedy = SamplingParams(max_new_tokens=40, ignore_eos=True)
    ref = scripted_engine(max_batch_size=4).generate([PROMPT], greedy)[0].token_ids
    engine = scripted_engine(max_batch_size=4, max_num_tokens=64, num_blocks=8)  # 4 x 61 tokens need 16 blocks
    ids = engine.add_group(PROMPT, [greedy] * 4)
    outs = drive(engine)
    assert engine.stats.preemptions > 0
    assert [tokens_of(outs, r) for r in ids] == [ref] * 4
    assert engine.num_free_blocks() == engine.num_blocks() and engine.check_invariants() == []


def test_cached_prompt_tokens_reported():
    engine = scripted_engine(max_batch_size=4)
    p = SamplingParams(max_new_tokens=3, ignore_eos=True)
    first, = engine.generate([PROMPT], p)
    second, = engine.generate([PROMPT + [7]], p)  # 22 tokens: its first 16 (one full block) are cached
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 16
    assert engine.stats.prefix_hit_tokens == 16 and engine.stats.prefix_query_tokens == 21 + 22


def test_a_sibling_aborted_before_the_fork_leaves_the_others():
    """The middle request of a group aborted before the prompt is cached: the parent and the last sibling still
    fork and run (a fork loop that stops at the aborted one leaves the last one waiting forever)."""
    engine = scripted_engine(max_batch_size=4, max_num_tokens=64)
    greedy = SamplingParams(max_new_tokens=5, ignore_eos=True)
    ref = engine.generate([PROMPT], greedy)[0].token_ids
    ids = engine.add_group(PROMPT, [greedy] * 3)
    engine.abort(ids[1])
    outs = drive(engine, max_steps=50)
    assert outs[ids[1]][-1].finish_reason == "abort"
    assert tokens_of(outs, ids[0]) == tokens_of(outs, ids[2]) == ref
    assert engine.num_free_blocks() == engine.num_blocks() and engine.check_invariants() == []
