"""The engine's sampling against an independent numpy oracle (float64, loops; no code shared with
pagedkit/engine/sampling.py).

Semantics the engine documents (sampling.py, params.py; OpenAI / vLLM): logits / temperature first, then
top-k (the k largest scaled logits), then top-p (nucleus) on the distribution renormalised over what top-k
kept: the smallest set of most likely tokens whose probability REACHES top_p (a token stays while the mass of
the more likely tokens is < top_p, so the first token always stays), then one draw from the renormalised
probabilities. temperature 0 is greedy. min-p is not a SamplingParams field (nothing to test).

(a) support: the exact set of tokens drawn equals the oracle's support, on logits built so that the
    realistic bugs give another support: the nucleus cut from the logits before temperature, top-k applied
    after top-p (or top-p on the probabilities before top-k's renormalisation), the boundary token dropped
    (inclusive cumsum) or one token too many kept, `>` for `>=` at an exact boundary, temperature ignored;
(b) distribution: seeded draws through `Choices` (the object the engine samples each step with: batched rows,
    each its own params and generator, a greedy row among them) against the oracle's probabilities with a
    Bernstein bound per (row, token);
(c) the same through Engine.step with a scripted model (tests/scripted_engine.py): each request's rows are
    sampled with its own params.
Teeth: each bug above is monkeypatched in (a copy of sample_token with that one change) and the checks fail.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pagedkit.engine import SamplingParams
from pagedkit.engine import sampling as sampling_mod
from pagedkit.engine.sampling import Choices
from scripted_engine import ScriptedModel, VOCAB, drive, scripted_engine


# ---- the oracle --------------------------------------------------------------------------------------------

def oracle_probs(logits, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """float64 probabilities of each token under the documented rules (temperature > 0)."""
    z = [float(v) / temperature for v in logits]
    vocab = len(z)
    allowed = [True] * vocab
    if 0 < top_k < vocab:
        kth = sorted(z, reverse=True)[top_k - 1]
        allowed = [v >= kth for v in z]
    zmax = max(v for v, a in zip(z, allowed) if a)
    w = [math.exp(v - zmax) if a else 0.0 for v, a in zip(z, allowed)]
    total = sum(w)
    w = [x / total for x in w]
    if top_p < 1.0:
        kept = [False] * vocab
        mass = 0.0
        for i in sorted(range(vocab), key=lambda i: -w[i]):
            if mass >= top_p:  # the kept tokens already reach top_p
                break
            kept[i] = True
            mass += w[i]
        total = sum(x for x, k in zip(w, kept) if k)
        w = [x / total if k else 0.0 for x, k in zip(w, kept)]
    return np.array(w)


def support(p) -> set[int]:
    return {int(i) for i in np.flatnonzero(np.asarray(p) > 0)}


# ---- bugs to show the tests' teeth: sample_token with one realistic change each ------------------------------

def _nucleus(x, top_p, mode="ok"):
    order = torch.argsort(x, descending=True)
    probs = torch.softmax(x[order], dim=0)
    before = torch.cumsum(probs, dim=0) - probs
    if mode == "inclusive":  # the token that reaches top_p is dropped
        drop = torch.cumsum(probs, 0) >= top_p
        drop[0] = False
    elif mode == "one_more":  # one token beyond the boundary is kept
        drop = torch.cat([torch.zeros(1, dtype=torch.bool), (before >= top_p)[:-1]])
    elif mode == "strict":  # `>` for `>=`: a set that exactly reaches top_p keeps one token more
        drop = before > top_p
    else:
        drop = before >= top_p
    return order[drop]


def _topk_mask(x, k):
    if 0 < k < x.numel():
        return x.masked_fill(x < torch.topk(x, k).values[-1], float("-inf"))
    return x


def buggy_sampler(bug: str):
    """sample_token as it was before the tiny-temperature fix (logits / temperature, unshifted, float32), with
    `bug`; "none": no bug (passes every test here but the tiny-temperature one)."""
    def sample(logits, params, generator):
        logits = logits.float()
        if params.temperature == 0:
            return int(torch.argmax(logits))
        x = logits if bug == "temperature_ignored" else logits / params.temperature
        if bug == "topk_after_topp":
            if params.top_p < 1.0:
                x = x.clone()
                x[_nucleus(x, params.top_p)] = float("-inf")
            x = _topk_mask(x, params.top_k)
        else:
            x = _topk_mask(x, params.top_k)
            if params.top_p < 1.0:
                if bug == "nucleus_before_temperature":  # the cut computed from the unscaled logits
                    cut = _nucleus(_topk_mask(logits, params.top_k), params.top_p)
                elif bug == "topp_before_renormalising":  # nucleus mass over every token, not top-k's
                    full = torch.softmax(logits / params.temperature, 0)
                    order = torch.argsort(full, descending=True)
                    before = torch.cumsum(full[order], 0) - full[order]
                    cut = order[before >= params.top_p]
                else:
                    cut = _nucleus(x, params.top_p, {"boundary_dropped": "inclusive", "boundary_one_more": "one_more",
                                                     "boundary_strict": "strict"}.get(bug, "ok"))
                x = x.clone()
                x[cut] = float("-inf")
        probs = torch.softmax(x, dim=0)
        return int(torch.multinomial(probs, 1, generator=generator))

    return sample


BUGS = ("nucleus_before_temperature", "topk_after_topp", "topp_before_renormalising", "boundary_dropped",
        "boundary_one_more", "boundary_strict", "temperature_ignored")


# ---- (a) supports --------------------------------------------------------------------------------------------

L8 = [2.0, 1.2, 0.9, 0.3, -0.4, -1.0, -2.0, -3.0]
L8B = [1.6, 1.3, 1.1, 0.4, 0.1, -0.2, -0.8, -0.9]
DYADIC = [0.0, -math.log(2), -2 * math.log(2), -3 * math.log(2), -3 * math.log(2)]  # p = 1/2, 1/4, 1/8, 1/16, 1/16

# (name, logits, params, support the oracle must give: written out so the case design is checked too)
SUPPORT_CASES = [
    # T 0.6 sharpens: probs .79 .21 .. -> {0, 1}; cut before T (.48 .18 .11 ..) keeps 0-2; inclusive keeps {0}
    ("cold temperature + top-p", L8, SamplingParams(temperature=0.6, top_p=0.75), {0, 1}),
    # T 1.8 flattens: the nucleus grows to 4 tokens (cumulative .31 .51 .68 .80); at T 1 it is 3
    ("hot temperature + top-p", L8, SamplingParams(temperature=1.8, top_p=0.75), {0, 1, 2, 3}),
    # top-5 renormalised: .28 .24 .21 .15 .12 -> {0, 1, 2} (cumulative .52 < .6 <= .73); top-p first over all 8
    # tokens (cumulative .23 .42 .59 .70) keeps 4; at T 1 the nucleus is {0, 1}
    ("temperature + top-k + top-p", L8B, SamplingParams(temperature=1.8, top_k=5, top_p=0.6), {0, 1, 2}),
    # exact dyadic probabilities: {0, 1} holds exactly 3/4 = top_p, it reaches it: token 2 is out
    ("exact boundary 0.75", DYADIC, SamplingParams(temperature=1.0, top_p=0.75), {0, 1}),
    ("exact boundary 0.5", DYADIC, SamplingParams(temperature=1.0, top_p=0.5), {0}),
    ("top-k only", L8, SamplingParams(temperature=1.3, top_k=3), {0, 1, 2}),
]
SUPPORT_DRAWS = 400  # smallest supported probability below is >= 0.1: P(a token never drawn) <= .9^400 < 5e-19


def draw(logits_rows, params, n, seed=0):
    """n seeded draws per row through Choices (one batch, one torch.Generator per row): counts [R, V]."""
    width = max(len(r) for r in logits_rows)
    logits = torch.full((len(logits_rows), width), float("-inf"))
    for i, r in enumerate(logits_rows):
        logits[i, :len(r)] = torch.tensor(r, dtype=torch.float32)
    rows = Choices(logits, params)
    gens = [torch.Generator().manual_seed(seed + 1000 * i) for i in range(len(params))]
    counts = np.zeros((len(params), width), dtype=np.int64)
    for _ in range(n):
        for i in range(len(params)):
            counts[i, rows.token(i, gens[i])] += 1
    return counts


def check_supports(cases=SUPPORT_CASES):
    counts = draw([c[1] for c in cases], [c[2] for c in cases], SUPPORT_DRAWS)
    for (name, logits, p, want), row in zip(cases, counts):
        got = {int(i) for i in np.flatnonzero(row)}
        assert got == want, f"{name}: tokens drawn {sorted(got)}, the oracle's support is {sorted(want)}"


def test_oracle_supports_are_the_designed_ones():
    """The case table's supports are the oracle's (so the expectations below are the oracle's, not typed in)."""
    for name, logits, p, want in SUPPORT_CASES:
        probs = oracle_probs(logits, p.temperature, p.top_k, p.top_p)
        assert support(probs) == want, name
        assert probs[probs > 0].min() >= 0.1, name  # SUPPORT_DRAWS' bound


def test_support_equals_the_oracle():
    check_supports()


@pytest.mark.parametrize("bug", BUGS)
def test_teeth_support(monkeypatch, bug):
    monkeypatch.setattr(sampling_mod, "sample_token", buggy_sampler(bug))
    with pytest.raises(AssertionError, match="the oracle's support"):
        check_supports()


def test_teeth_correct_copy_passes(monkeypatch):
    """The bug harness itself (buggy_sampler without a bug) passes: the teeth fail because of the bug."""
    monkeypatch.setattr(sampling_mod, "sample_token", buggy_sampler("none"))
    check_supports()
    check_distributions([r for r in DIST_ROWS if r[1].temperature != 0], 2000)


# ---- a tiny temperature: greedy in the limit, never an error -------------------------------------------------------

TINY = (1e-40, 5e-324)  # below float32's range once a logit is divided by them


def check_tiny_temperatures():
    logits = [0.5, 2.0, 1.0, 2.0 - 1e-6, -3.0]  # argmax 1; token 3 is 1e-6 below it
    cases = [SamplingParams(temperature=t, top_p=p, top_k=k) for t in TINY for p, k in ((1.0, 0), (0.9, 0), (1.0, 3))]
    counts = draw([logits] * len(cases), cases, 50)
    for p, row in zip(cases, counts):
        assert row[1] == 50, f"temperature {p.temperature}: {row.tolist()}, expected only the argmax"


def test_tiny_temperature_is_greedy():
    """temperature 1e-40 (paged-serve accepts any temperature in [0, 2]) is greedy, not a failed step: before the
    fix, logits / 1e-40 overflowed to inf, softmax gave nan and torch.multinomial raised, which failed engine.step()
    and so every request in the batch."""
    check_tiny_temperatures()


def test_teeth_tiny_temperature_unshifted_logits(monkeypatch):
    monkeypatch.setattr(sampling_mod, "sample_token", buggy_sampler("none"))  # logits / temperature, unshifted
    with pytest.raises(RuntimeError, match="inf"):
        check_tiny_temperatures()


# ---- (b) distributions ---------------------------------------------------------------------------------------

def _perm(values, seed):
    order = np.random.default_rng(seed).permutation(len(values))
    out = [0.0] * len(values)
    for src, dst in enumerate(order):
        out[dst] = values[src]
    return out


L12 = L8 + [-6.0, -7.0, -8.0, -9.0]  # a tail a plain draw reaches rarely (p ~ 1e-3 at T 1.4)
DIST_ROWS = [  # every row its own token order, so a row / params mix-up changes the counts
    (_perm(L12, 1), SamplingParams(temperature=0.6, top_p=0.75)),
    (_perm(L8B + [-6.0, -7.0, -8.0, -9.0], 2), SamplingParams(temperature=1.8, top_k=5, top_p=0.6)),
    (_perm(L12, 3), SamplingParams(temperature=1.4)),
    (_perm(L12, 4), SamplingParams()),  # greedy, drawn in the same batch
    (_perm(L12, 5), SamplingParams(temperature=0.7, top_k=3)),
    (_perm(L12, 6), SamplingParams(temperature=1.6, top_k=6, top_p=0.9)),
]
DIST_DRAWS = 5000
DELTA = 1e-9  # false-failure probability of one (row, token) bound; 6 rows x 12 tokens: < 1e-7 in all


def bernstein(n: int, p: float, delta: float = DELTA) -> float:
    """a with P(|count - n p| >= a) <= delta (Bernstein: 2 exp(-a^2 / (2 (n p (1-p) + a / 3))))."""
    log = math.log(2 / delta)
    return log / 3 + math.sqrt(log * log / 9 + 2 * log * n * p * (1 - p))


def oracle_row(logits, p: SamplingParams) -> np.ndarray:
    if p.temperature == 0:
        out = np.zeros(len(logits))
        out[int(np.argmax(logits))] = 1.0
        return out
    return oracle_probs(logits, p.temperature, p.top_k, p.top_p)


def check_distribution(counts: np.ndarray, expected: np.ndarray, n: int, what: str) -> None:
    for t, (c, q) in enumerate(zip(counts, expected)):
        if q == 0:
            assert c == 0, f"{what}: token {t} drawn {c} times, outside the oracle's support"
        else:
            bound = bernstein(n, q)
            assert abs(c - n * q) < bound, (f"{what}: token {t} drawn {c} / {n} times, the oracle expects {n * q:.1f} "
                                            f"(+- {bound:.1f})\n counts {counts.tolist()}\n oracle {np.round(expected, 4)}")


def check_distributions(rows=DIST_ROWS, n=DIST_DRAWS):
    counts = draw([r[0] for r in rows], [r[1] for r in rows], n, seed=7)
    for i, ((logits, p), row) in enumerate(zip(rows, counts)):
        check_distribution(row, oracle_row(logits, p), n, f"row {i} ({p.temperature=}, {p.top_k=}, {p.top_p=})")


def test_distribution_equals_the_oracle():
    check_distributions()


@pytest.mark.parametrize("bug", ["temperature_ignored", "nucleus_before_temperature", "topk_after_topp",
                                 "boundary_dropped", "boundary_one_more"])
def test_teeth_distribution(monkeypatch, bug):
    monkeypatch.setattr(sampling_mod, "sample_token", buggy_sampler(bug))
    rows = [r for r in DIST_ROWS if r[1].temperature != 0]
    with pytest.raises(AssertionError, match="the oracle expects|outside the oracle's support"):
        check_distributions(rows, 2000)


def test_teeth_temperature_ignored_without_filters(monkeypatch):
    """No top-k / top-p: only the distribution test sees a temperature that is not applied."""
    monkeypatch.setattr(sampling_mod, "sample_token", buggy_sampler("temperature_ignored"))
    with pytest.raises(AssertionError, match="the oracle expects"):
        check_distributions([DIST_ROWS[2]])


def test_teeth_rows_mixed_up(monkeypatch):
    """Choices drawing every row with the first row's params is caught."""
    real = sampling_mod.sample_token
    first = DIST_ROWS[0][1]
    monkeypatch.setattr(sampling_mod, "sample_token", lambda logits, params, gen: real(logits, first, gen))
    with pytest.raises(AssertionError):
        check_distributions([DIST_ROWS[0], DIST_ROWS[2]], 2000)


# ---- (c) through Engine.step: each request sampled with its own params ---------------------------------------

ENGINE_GROUPS = [  # (params, token block offset): group g's logits live on tokens 16 g + 8 .. 16 g + 19
    SamplingParams(temperature=0.6, top_p=0.75),
    SamplingParams(temperature=1.8, top_k=5, top_p=0.6),
    SamplingParams(temperature=1.4),
    SamplingParams(temperature=0.7, top_k=3),
]
ENGINE_NEW_TOKENS = 100
ENGINE_PER_GROUP = 6


def _group_logits(g: int) -> torch.Tensor:
    row = torch.full((VOCAB,), -1e4)
    row[16 * g + 8:16 * g + 20] = torch.tensor(_perm(L12, 10 + g))
    return row


def run_engine_sampling():
    engine = scripted_engine(max_batch_size=12, max_num_tokens=64)
    group_of = {}

    def next_logits(req, context):
        return _group_logits(group_of[req.request_id])

    ScriptedModel(engine, next_logits)
    for k in range(ENGINE_PER_GROUP):
        for g, p in enumerate(ENGINE_GROUPS):
            sp = SamplingParams(max_new_tokens=ENGINE_NEW_TOKENS, temperature=p.temperature, top_k=p.top_k,
                                top_p=p.top_p, seed=100 * g + k, ignore_eos=True)
            group_of[engine.add_request([1, 5 + g], sp, request_id=f"g{g}-{k}")] = g
    outs = drive(engine)
    counts = np.zeros((len(ENGINE_GROUPS), VOCAB), dtype=np.int64)
    for rid, o in outs.items():
        assert o[-1].finish_reason == "length" and len(o[-1].token_ids) == ENGINE_NEW_TOKENS
        for t in o[-1].token_ids:
            counts[group_of[rid], t] += 1
    return engine, counts


def check_engine_sampling():
    engine, counts = run_engine_sampling()
    assert engine.stats.max_batch == 12  # requests of every group shared steps
    n = ENGINE_NEW_TOKENS * ENGINE_PER_GROUP
    for g, p in enumerate(ENGINE_GROUPS):
        expected = oracle_probs(_group_logits(g).tolist(), p.temperature, p.top_k, p.top_p)
        check_distribution(counts[g], expected, n, f"engine group {g} ({p})")


def test_engine_samples_each_request_with_its_params():
    check_engine_sampling()


def test_teeth_engine_params_of_the_wrong_row(monkeypatch):
    """The engine handing Choices its params shifted by one row (a realistic indexing slip) is caught."""
    real_init = Choices.__init__

    def shifted(self, logits, params):
        params = list(params)
        real_init(self, logits, params[1:] + params[:1])

    monkeypatch.setattr(Choices, "__init__", shifted)
    with pytest.raises(AssertionError, match="engine group"):
        check_engine_sampling()
