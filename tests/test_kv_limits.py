"""Limits at their edge: a request that exactly fits the KV pool, and one token more.

Accounting (engine.py `_never_fits`, request.py, params.py): a request of prompt P and max_new_tokens M
caches at most min(P + M - 1, max_seq_len) tokens (the last generated token is never fed back), which take
ceil(that / block_size) blocks of the full-attention pool. A request that needs more blocks than the pool
has is finished at once with "abort" and a reason naming num_blocks (no step runs for it); one that needs
exactly the pool runs to the end. Two requests whose needs sum to exactly the pool run together without a
preemption; one token more and the engine preempts (recompute) and still finishes both with the same tokens.
KVCacheManager: a step that takes the last free block succeeds; one more token is KVCacheExhausted and
changes nothing.

The engine tests run examples/tiny-paged (block 16, context 128) for real: the tokens at the edge equal
the same request's in a roomy pool (a wrong slot at the pool's last block changes them).
Teeth: the off-by-ones (no "- 1", `>=` for `>`, the context cap dropped, a block allocated one token early,
`require` refusing an exact fit) are monkeypatched in and fail.
"""

from __future__ import annotations

import math

import pytest

from pagedkit.engine import Engine, SamplingParams
from pagedkit.engine import engine as engine_mod
from pagedkit.runtime.kv import blocks as blocks_mod
from pagedkit.runtime.kv import pool as pool_mod
from pagedkit.runtime.kv.cache import KVCacheExhausted, KVCacheManager
from pagedkit.runtime.kv.config import GroupConfig, KVCacheConfig, LayerCacheSpec
from scripted_engine import TINY_PAGED

BS = 16


# ---- the KV manager ------------------------------------------------------------------------------------------

def manager(num_blocks: int, max_seq_len: int = 256) -> KVCacheManager:
    g = GroupConfig("full", num_blocks, BS, (LayerCacheSpec(0, 2, 8), LayerCacheSpec(1, 2, 8)))
    return KVCacheManager(KVCacheConfig((g,), max_batch_size=4, max_num_tokens=256, max_seq_len=max_seq_len))


def check_manager_exact_fit():
    for n_blocks in (1, 3, 5):
        m = manager(n_blocks)
        m.add_sequence("a", 1)
        done = 0
        for chunk in (1, BS - 1, BS * (n_blocks - 1)):  # the last step ends exactly at the pool's end
            if chunk:
                m.commit(m.plan([("a", chunk)]))
                done += chunk
        assert m.length("a") == n_blocks * BS == done
        assert m.num_free_blocks("full") == 0 and m.check_invariants() == []
        table = m.block_table_row("a", "full")
        assert sorted(table) == list(range(n_blocks))
        with pytest.raises(KVCacheExhausted, match="needs 1 blocks, 0 are free"):
            m.plan([("a", 1)])
        assert m.length("a") == n_blocks * BS and m.block_table_row("a", "full") == table
        assert m.check_invariants() == []
    # two sequences filling a pool of 4 in one step: 48 + 16 tokens = 3 + 1 blocks; one token more is refused
    m = manager(4)
    m.add_sequence("a", 48)
    m.add_sequence("b", 17)
    with pytest.raises(KVCacheExhausted, match="needs 5 blocks, 4 are free"):
        m.plan([("a", 48), ("b", 17)])
    assert m.num_free_blocks("full") == 4 and m.check_invariants() == []
    m.commit(m.plan([("a", 48), ("b", 16)]))  # 3 + 1 blocks, the pool exactly
    assert m.num_free_blocks("full") == 0 and m.check_invariants() == []
    with pytest.raises(KVCacheExhausted):
        m.plan([("b", 1)])


def test_manager_exact_fit_and_one_token_more():
    check_manager_exact_fit()


def test_manager_max_seq_len_edge():
    m = manager(8, max_seq_len=40)
    m.add_sequence("a", 40)  # exactly max_seq_len
    m.commit(m.plan([("a", 40)]))
    with pytest.raises(ValueError, match="would reach 41 tokens, beyond max_seq_len 40"):
        m.plan([("a", 1)])
    assert m.max_step_tokens("a") == 0 and m.check_invariants() == []
    with pytest.raises(ValueError, match="would reach 41 tokens"):
        m.add_sequence("b", 41)


def _actions_one_early(self, st, length, n, who):
    """Off-by-one: a step ending exactly at a block boundary allocates the next block too."""
    acts = real_actions(self, st, length, n, who)
    last = (length + n) // self.g.block_size
    if not self.g.windowed and last > acts[-1][0]:
        acts.append((last, "new"))
    return acts


real_actions = blocks_mod.GroupBlocks.actions


def test_teeth_manager_block_allocated_one_token_early(monkeypatch):
    monkeypatch.setattr(blocks_mod.GroupBlocks, "actions", _actions_one_early)
    with pytest.raises(KVCacheExhausted):
        check_manager_exact_fit()


def test_teeth_manager_require_refuses_an_exact_fit(monkeypatch):
    def require(self, needed, what):
        if needed >= self.available and needed:
            raise KVCacheExhausted(f"group {self.group!r} is exhausted: {what} needs {needed} blocks, "
                                   f"{self.available} are free")

    monkeypatch.setattr(pool_mod.BlockPool, "require", require)
    with pytest.raises(KVCacheExhausted):
        check_manager_exact_fit()


# ---- the engine: one request -----------------------------------------------------------------------------------

def generate(num_blocks: int | None, prompts, max_new: int, **kw):
    """Greedy, ignore_eos; returns (engine, outputs, most full-attention blocks in use after any step)."""
    engine = Engine(TINY_PAGED, max_batch_size=kw.pop("max_batch_size", 4), max_num_tokens=kw.pop("max_num_tokens", 64),
                    num_blocks=num_blocks)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=max_new, ignore_eos=True)) for p in prompts]
    final, peak = {}, 0
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
        peak = max(peak, engine.num_blocks()["full"] - engine.num_free_blocks()["full"])
        assert engine.check_invariants() == []
    assert engine.num_free_blocks() == engine.num_blocks()
    return engine, [final[i] for i in ids], peak


PROMPT = [1, 7, 30, 12, 99, 5, 64, 17, 3, 41, 88, 23, 9, 70, 14, 55, 2, 61, 33, 8]  # 20 tokens
N_BLOCKS = 3
EXACT = N_BLOCKS * BS - len(PROMPT) + 1  # 29 new tokens: 20 + 29 - 1 = 48 cached = 3 blocks exactly


def check_engine_exact_fit():
    _, (roomy,), _ = generate(None, [PROMPT], EXACT)
    engine, (out,), peak = generate(N_BLOCKS, [PROMPT], EXACT)
    assert out.finish_reason == "length", f"the exact fit ended {out.finish_reason!r}: {out.reason}"
    assert len(out.token_ids) == EXACT and out.token_ids == roomy.token_ids
    assert peak == N_BLOCKS and engine.stats.preemptions == 0
    engine, (over,), _ = generate(N_BLOCKS, [PROMPT], EXACT + 1)  # 49 tokens: a 4th block
    assert over.finish_reason == "abort" and over.token_ids == [] and engine.stats.steps == 0, \
        f"one token more: {over.finish_reason!r} after {engine.stats.steps} steps, {len(over.token_ids)} tokens"
    assert "never hold" in over.reason and "need 4 blocks" in over.reason and "the pool has 3" in over.reason


def check_engine_context_cap():
    """The context caps what is cached: prompt 100 + any max_new_tokens caches at most 128 tokens (8 blocks);
    the request ends with "length" at prompt + generated = max_seq_len + 1."""
    prompt = (PROMPT * 5)[:100]
    engine, (out,), peak = generate(8, [prompt], 1000)
    assert out.finish_reason == "length", f"the capped request ended {out.finish_reason!r}: {out.reason}"
    assert len(out.token_ids) == 128 + 1 - 100 and peak == 8
    engine, (over,), _ = generate(7, [prompt], 1000)
    assert over.finish_reason == "abort" and "need 8 blocks" in over.reason


def test_engine_request_exactly_filling_the_pool():
    check_engine_exact_fit()


def test_engine_context_caps_the_blocks_needed():
    check_engine_context_cap()


def _never_fits_variant(bug):
    def never_fits(self, req):
        longest = len(req.prompt) + req.params.max_new_tokens - (0 if bug == "no_minus_one" else 1)
        if bug != "no_context_cap":
            longest = min(longest, self.max_seq_len)
        for group, need in self.model.blocks_needed(longest).items():
            have = self.kv.config.group(group).num_blocks
            if need >= have if bug == "ge" else need > have:
                return f"the KV cache can never hold this request: {longest} tokens need {need} blocks, the pool has {have}"
        return None

    return never_fits


@pytest.mark.parametrize("bug, check", [("no_minus_one", check_engine_exact_fit), ("ge", check_engine_exact_fit),
                                        ("no_context_cap", check_engine_context_cap)])
def test_teeth_engine_fit_off_by_one(monkeypatch, bug, check):
    monkeypatch.setattr(engine_mod.Engine, "_never_fits", _never_fits_variant(bug))
    with pytest.raises(AssertionError, match="ended 'abort'|finish_reason"):
        check()


def test_teeth_engine_admits_one_token_more(monkeypatch):
    """A fit check that lets one token too many through: the request runs and is aborted mid-way (with tokens)."""
    def lenient(self, req):
        req.params.max_new_tokens -= 1
        try:
            return real_never_fits(self, req)
        finally:
            req.params.max_new_tokens += 1

    real_never_fits = engine_mod.Engine._never_fits
    monkeypatch.setattr(engine_mod.Engine, "_never_fits", lenient)
    with pytest.raises(AssertionError, match="one token more"):
        check_engine_exact_fit()


def check_exact_fit_with_drafts():
    """Speculative steps write their drafts into the cache too: drafts_for caps them so that the cache never holds
    more than prompt + max_new_tokens - 1 tokens; with a drafter that always proposes 8 tokens the exact fit still
    runs to the end, with the plain request's tokens."""
    _, (plain,), _ = generate(None, [PROMPT], EXACT)
    engine = Engine(TINY_PAGED, max_batch_size=2, max_num_tokens=64, num_blocks=N_BLOCKS)
    rid = engine.add_request(PROMPT, SamplingParams(max_new_tokens=EXACT, ignore_eos=True, num_draft_tokens=4),
                             drafter=lambda tokens: [tokens[-1]] * 8)
    final = None
    while engine.has_unfinished():
        for o in engine.step():
            final = o if o.request_id == rid and o.finished else final
    assert engine.stats.draft_tokens > 0
    assert final.finish_reason == "length", f"the exact fit with drafts ended {final.finish_reason!r}: {final.reason}"
    assert final.token_ids == plain.token_ids


def test_engine_exact_fit_with_speculative_drafts():
    check_exact_fit_with_drafts()


def test_teeth_drafts_one_past_max_new_tokens(monkeypatch):
    from pagedkit.engine import speculative

    real = speculative.drafts_for

    def one_more(r, room, vocab):  # the cap on what the request may still generate without its "- 1"
        r.params.max_new_tokens += 1
        try:
            return real(r, room, vocab)
        finally:
            r.params.max_new_tokens -= 1

    monkeypatch.setattr(engine_mod, "drafts_for", one_more)
    with pytest.raises(AssertionError, match="ended 'abort'"):
        check_exact_fit_with_drafts()


# ---- the engine: two requests sharing the pool exactly ------------------------------------------------------------

def check_two_requests(extra: int):
    """Two prompts of 20 whose caches need 3 + 2 blocks (pool 5) when extra == 0."""
    prompts = [PROMPT, PROMPT[::-1]]
    news = [EXACT, 2 * BS - len(PROMPT) + 1 + extra]  # 48 and 32 (+ extra) cached tokens
    roomy = [generate(None, [p], n)[1][0].token_ids for p, n in zip(prompts, news)]
    engine = Engine(TINY_PAGED, max_batch_size=4, max_num_tokens=64, num_blocks=5)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in zip(prompts, news)]
    final = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
        assert engine.check_invariants() == []
    for rid, want in zip(ids, roomy):
        assert final[rid].finish_reason == "length" and final[rid].token_ids == want
    return engine.stats


def check_two_together():
    stats = check_two_requests(0)
    assert stats.preemptions == 0 and stats.unadmitted == 0 and stats.max_batch == 2, f"exact pair: {stats}"


def test_two_requests_exactly_filling_the_pool_run_together():
    check_two_together()


def test_two_requests_one_token_more_preempt_and_finish():
    stats = check_two_requests(1)
    assert stats.preemptions + stats.unadmitted > 0


def test_teeth_two_requests_block_allocated_one_token_early(monkeypatch):
    monkeypatch.setattr(blocks_mod.GroupBlocks, "actions", _actions_one_early)
    with pytest.raises(AssertionError, match="exact pair"):
        check_two_together()
