"""The engine's logit processing (logit_bias, repetition / frequency / presence penalties, min_p) and logprobs
against an independent numpy oracle (float64 loops over the documented rules; no code shared with
pagedkit/engine/logits.py or sampling.py).

Rules (params.py, logits.py; OpenAI / vLLM): z = logits + logit_bias; repetition_penalty r over the set of
prompt + generated tokens: z / r where z > 0, z * r elsewhere; then z -= frequency x count + presence x [count > 0]
over the GENERATED tokens only; greedy = argmax z; sampled: softmax(z / T), tokens below min_p x the largest
probability dropped, then top-k, then top-p (renormalised), one draw. logprobs: log_softmax of the RAW logits.

(a) distribution: seeded draws through Choices (rows batched, each with its own params and history) against
    the oracle with a Bernstein bound per (row, token); tokens outside the oracle's support are never drawn;
(b) greedy through Engine.step with a scripted model whose logits depend on the context: every token is the
    oracle's argmax of the processed logits of its context;
(c) logprobs through Engine.step: each token's logprob and top-k equal numpy's log_softmax of the scripted
    logits (raw: temperature and penalties do not change them).
Teeth: each realistic bug is monkeypatched in and the matching check fails.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pagedkit.engine import SamplingParams
from pagedkit.engine import logits as logits_mod
from pagedkit.engine import sampling as sampling_mod
from pagedkit.engine.sampling import Choices
from scripted_engine import VOCAB, ScriptedModel, drive, scripted_engine
from test_sampling_oracle import check_distribution


# ---- the oracle ----------------------------------------------------------------------------------------------

def oracle_processed(logits, p: SamplingParams, tokens, prompt_len: int) -> np.ndarray:
    z = np.array([float(v) for v in logits], dtype=np.float64)
    for t, b in (p.logit_bias or {}).items():
        z[t] += b
    if p.repetition_penalty != 1.0:
        for t in set(tokens):
            z[t] = z[t] / p.repetition_penalty if z[t] > 0 else z[t] * p.repetition_penalty
    counts = {}
    for t in tokens[prompt_len:]:
        counts[t] = counts.get(t, 0) + 1
    for t, c in counts.items():
        z[t] -= p.frequency_penalty * c + p.presence_penalty
    return z


def oracle_probs(logits, p: SamplingParams, tokens, prompt_len: int) -> np.ndarray:
    z = oracle_processed(logits, p, tokens, prompt_len)
    out = np.zeros(len(z))
    if p.temperature == 0:
        out[int(np.argmax(z))] = 1.0
        return out
    w = [math.exp((v - z.max()) / p.temperature) for v in z]
    w = [x / sum(w) for x in w]
    keep = [x >= p.min_p * max(w) for x in w]
    if 0 < p.top_k < len(w):
        kth = sorted(w, reverse=True)[p.top_k - 1]
        keep = [k and x >= kth for k, x in zip(keep, w)]
    w = [x if k else 0.0 for x, k in zip(w, keep)]
    w = [x / sum(w) for x in w]
    if p.top_p < 1.0:
        kept, mass = set(), 0.0
        for i in sorted(range(len(w)), key=lambda i: -w[i]):
            if mass >= p.top_p:
                break
            kept.add(i)
            mass += w[i]
        w = [x if i in kept else 0.0 for i, x in enumerate(w)]
        w = [x / sum(w) for x in w]
    return np.array(w)


def oracle_logprobs(logits) -> np.ndarray:
    z = np.array([float(v) for v in logits], dtype=np.float64)
    m = z.max()
    return z - m - math.log(sum(math.exp(v - m) for v in z))


# ---- (a) distributions through Choices -----------------------------------------------------------------------

L12 = [2.0, 1.2, 0.9, 0.3, -0.4, -1.0, -2.0, -3.0, 1.5, -0.2, 0.6, 1.1]
PROMPT = [0, 3, 4, 9, 9, 6, 7]  # the history of every row: prompt (7 tokens) + generated
OUT = [1, 8, 8, 8, 11, 4]
HISTORY = PROMPT + OUT
DIST_ROWS = [
    # frequency x count (token 8 thrice) + presence; prompt tokens 3, 9 unpenalised
    SamplingParams(temperature=0.9, frequency_penalty=0.7, presence_penalty=1.5),
    # repetition 3 over prompt + output: positive logits (0, 8, 11, 1) divided, negative (4, 9, 6, 7) multiplied
    SamplingParams(temperature=1.2, repetition_penalty=3.0),
    # a bias promotes 3 and 10, bans 0; top-p over the biased distribution
    SamplingParams(temperature=1.0, top_p=0.9, logit_bias={3: 2.5, 0: -100.0, 10: 1.0}),
    # min_p on the hot (T 1.6) distribution keeps 10 tokens; on the raw one (T 1) it keeps 8
    SamplingParams(temperature=1.6, min_p=0.1),
    # every step at once; a negative presence penalty encourages the generated tokens
    SamplingParams(temperature=0.7, min_p=0.05, top_k=6, top_p=0.95, presence_penalty=-1.0, frequency_penalty=0.3,
                   repetition_penalty=1.3, logit_bias={5: 3.0}),
    # greedy of the processed logits: 8 biased to 3.5, minus 0.6 x 3 -> 1.7 < token 0's 2.0 (counted once: 2.9)
    SamplingParams(temperature=0, frequency_penalty=0.6, logit_bias={8: 2.0}),
]
DRAWS = 4000


def draw(rows, n: int, seed: int = 3) -> np.ndarray:
    logits = torch.tensor([L12] * len(rows), dtype=torch.float32)
    choices = Choices(logits, rows)
    gens = [torch.Generator().manual_seed(seed + 97 * i) for i in range(len(rows))]
    counts = np.zeros((len(rows), len(L12)), dtype=np.int64)
    for _ in range(n):
        for i in range(len(rows)):
            counts[i, choices.token(i, gens[i], HISTORY, len(PROMPT))] += 1
    return counts


def check_distributions(rows=DIST_ROWS, n=DRAWS):
    for i, (p, row) in enumerate(zip(rows, draw(rows, n))):
        check_distribution(row, oracle_probs(L12, p, HISTORY, len(PROMPT)), n, f"row {i} ({p})")


def test_oracle_cases_are_sensitive():
    """Each case's distribution differs from the unprocessed one (its support, or by > 0.05 somewhere), and
    min_p's support depends on temperature."""
    for p in DIST_ROWS[:-1]:  # the greedy row: its teeth test shows what it catches
        plain = SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p)
        a, b = oracle_probs(L12, p, HISTORY, len(PROMPT)), oracle_probs(L12, plain, HISTORY, len(PROMPT))
        assert np.abs(a - b).max() > 0.05 or ((a > 0) != (b > 0)).any(), p
    hot = oracle_probs(L12, DIST_ROWS[3], HISTORY, len(PROMPT))
    assert (hot > 0).sum() == 10 and (oracle_probs(L12, SamplingParams(temperature=1.0, min_p=0.1), [], 0) > 0).sum() == 8


def test_processed_distribution_equals_the_oracle():
    check_distributions()


def _bug_process(bug: str):
    real = logits_mod.process

    def process(logits, p, tokens, prompt_len):
        if bug == "bias_ignored":
            p = SamplingParams(**{**vars(p), "logit_bias": None})
        if bug == "penalties_over_the_prompt":  # presence / frequency counted over prompt + output
            prompt_len = 0
        if bug == "repetition_over_output_only":
            q = SamplingParams(**{**vars(p), "presence_penalty": 0.0, "frequency_penalty": 0.0})
            x = real(logits, SamplingParams(**{**vars(q), "logit_bias": None, "repetition_penalty": 1.0}), tokens,
                     prompt_len)
            x = real(x, SamplingParams(**{**vars(q), "logit_bias": None}), list(tokens[prompt_len:]), 0)
            x = real(x, SamplingParams(**{**vars(p), "logit_bias": None, "repetition_penalty": 1.0}), tokens,
                     prompt_len)
            return real(x, SamplingParams(**{**vars(p), "presence_penalty": 0.0, "frequency_penalty": 0.0,
                                             "repetition_penalty": 1.0}), tokens, prompt_len)
        if bug == "repetition_swapped":  # a positive logit multiplied, a negative one divided
            x = logits.clone()
            if p.repetition_penalty != 1.0:
                seen = torch.unique(torch.tensor(list(tokens)))
                v = x[seen]
                x[seen] = torch.where(v > 0, v * p.repetition_penalty, v / p.repetition_penalty)
            return real(x, SamplingParams(**{**vars(p), "repetition_penalty": 1.0}), tokens, prompt_len)
        if bug == "frequency_as_presence":  # the count ignored
            x = logits.clone()
            seen = torch.unique(torch.tensor(list(tokens[prompt_len:]), dtype=torch.long))
            x[seen] -= p.frequency_penalty
            return real(x, SamplingParams(**{**vars(p), "frequency_penalty": 0.0}), tokens, prompt_len)
        return real(logits, p, tokens, prompt_len)

    return process


def _bug_min_p(bug: str):
    def mask(x, min_p):
        if min_p <= 0:
            return x
        if bug == "min_p_absolute":  # probability < min_p, not < min_p x the largest
            return x.masked_fill(torch.softmax(x, 0) < min_p, float("-inf"))
        return x.masked_fill(x < math.log(min_p) * 1.6, float("-inf"))  # before temperature (row 3's T)

    return mask


@pytest.mark.parametrize("bug, rows", [
    ("bias_ignored", [2, 4]), ("penalties_over_the_prompt", [0, 4]), ("repetition_over_output_only", [1, 4]),
    ("repetition_swapped", [1]), ("frequency_as_presence", [0, 5]),
    ("min_p_absolute", [3]), ("min_p_before_temperature", [3]),
])
def test_teeth_processing(monkeypatch, bug, rows):
    if bug.startswith("min_p"):
        monkeypatch.setattr(logits_mod, "min_p_mask", _bug_min_p(bug))
    else:
        monkeypatch.setattr(logits_mod, "process", _bug_process(bug))
    for i in rows:
        with pytest.raises(AssertionError, match="the oracle expects|outside the oracle's support"):
            check_distributions([DIST_ROWS[i]], 2000)


# ---- (b) greedy and (c) logprobs through Engine.step -----------------------------------------------------------

def context_logits(req, context, scale: float = 2.0) -> torch.Tensor:
    """Logits that depend on the context (so penalties meet a history they change): a fixed random row plus a
    bump on the last token's neighbours."""
    g = torch.Generator().manual_seed(1000 + len(context) % 7)
    row = torch.randn(VOCAB, generator=g) * scale
    row[(context[-1] * 7 + 3) % VOCAB] += 1.5 * scale / 2
    return row


def flat_logits(req, context) -> torch.Tensor:
    """context_logits with small gaps: any one penalty or bias changes some argmax."""
    return context_logits(req, context, scale=0.4)


GREEDY = [
    SamplingParams(max_new_tokens=24, ignore_eos=True, frequency_penalty=0.8, presence_penalty=0.4),
    SamplingParams(max_new_tokens=24, ignore_eos=True, repetition_penalty=1.6, logit_bias={7: 1.0, 40: -3.0}),
    SamplingParams(max_new_tokens=24, ignore_eos=True, logit_bias={17: 100.0}),
    SamplingParams(max_new_tokens=24, ignore_eos=True, presence_penalty=-2.0, frequency_penalty=2.0,
                   repetition_penalty=0.7, logprobs=4),
]
ALONE = [  # one processing field each (a field that only counts when another one is set is caught)
    SamplingParams(max_new_tokens=24, ignore_eos=True, frequency_penalty=1.0),
    SamplingParams(max_new_tokens=24, ignore_eos=True, frequency_penalty=-2.0),
    SamplingParams(max_new_tokens=24, ignore_eos=True, presence_penalty=0.9),
    SamplingParams(max_new_tokens=24, ignore_eos=True, presence_penalty=-1.5),
    SamplingParams(max_new_tokens=24, ignore_eos=True, repetition_penalty=2.0),
    SamplingParams(max_new_tokens=24, ignore_eos=True, repetition_penalty=0.25),
    SamplingParams(max_new_tokens=24, ignore_eos=True, logit_bias={40: 1.2}),
]
SAMPLED = [SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.8, logprobs=3, seed=5,
                          frequency_penalty=0.5, min_p=0.05),
           SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=1.3, logprobs=0, seed=6)]


def run_scripted(params, logits_fn=context_logits):
    engine = scripted_engine(max_batch_size=8, max_num_tokens=64)
    ScriptedModel(engine, logits_fn)
    prompts = {engine.add_request([1, 9 + i, 20, 9 + i], p): [1, 9 + i, 20, 9 + i] for i, p in enumerate(params)}
    outs = drive(engine)
    assert engine.stats.max_batch == len(params) and engine.num_free_blocks() == engine.num_blocks()
    return [(prompts[rid], [t for o in outs[rid] for t in o.new_token_ids],
             [lp for o in outs[rid] for lp in (o.new_logprobs or [])]) for rid in prompts]


def check_greedy(cases=GREEDY, logits_fn=context_logits):
    for p, (prompt, toks, _) in zip(cases, run_scripted(cases, logits_fn)):
        assert len(toks) == 24
        plain = []
        for k, t in enumerate(toks):
            ctx = prompt + toks[:k]
            want = int(np.argmax(oracle_processed(logits_fn(None, ctx).tolist(), p, ctx, len(prompt))))
            assert t == want, f"{p}: token {k} is {t}, the oracle's argmax is {want}"
            plain.append(int(np.argmax(logits_fn(None, ctx).numpy())))
        assert toks != plain, f"{p}: the processing changed no token (not a test of it)"
    if cases is GREEDY:
        assert set(run_scripted(GREEDY[2:3])[0][1]) == {17}


def test_greedy_of_each_field_alone():
    check_greedy(ALONE, flat_logits)


def test_greedy_of_processed_logits_equals_the_oracle():
    check_greedy()


@pytest.mark.parametrize("bug", ["bias_ignored", "penalties_over_the_prompt", "repetition_swapped",
                                 "frequency_as_presence"])
def test_teeth_greedy(monkeypatch, bug):
    monkeypatch.setattr(logits_mod, "process", _bug_process(bug))
    with pytest.raises(AssertionError, match="the oracle's argmax"):
        check_greedy()


def check_logprobs():
    params = GREEDY[3:] + SAMPLED
    for p, (prompt, toks, lps) in zip(params, run_scripted(params)):
        assert len(lps) == len(toks) == 24, p
        for k, (t, (lp, top)) in enumerate(zip(toks, lps)):
            ref = oracle_logprobs(context_logits(None, prompt + toks[:k]).tolist())
            assert abs(lp - ref[t]) < 1e-6, f"{p}: token {k}: logprob {lp}, numpy log_softmax {ref[t]}"
            want = sorted(range(VOCAB), key=lambda i: -ref[i])[:p.logprobs]
            assert [i for i, _ in top] == want, f"{p}: token {k}: top ids {[i for i, _ in top]}, numpy {want}"
            assert np.allclose([v for _, v in top], ref[want], atol=1e-6, rtol=0)
        if p.temperature:  # sampled tokens stay in the oracle's support
            for k, t in enumerate(toks):
                ctx = prompt + toks[:k]
                assert oracle_probs(context_logits(None, ctx).tolist(), p, ctx, len(prompt))[t] > 0


def test_logprobs_are_log_softmax_of_the_raw_logits():
    check_logprobs()


def test_teeth_logprobs_of_the_processed_logits(monkeypatch):
    """logprobs taken after temperature (or penalties) instead of from the raw logits are caught."""
    real = logits_mod.token_logprobs

    def after_temperature(raw, token, k):
        return real(raw / 0.8, token, k)

    monkeypatch.setattr(logits_mod, "token_logprobs", after_temperature)
    with pytest.raises(AssertionError, match="numpy log_softmax"):
        check_logprobs()


def test_teeth_logprobs_of_another_row(monkeypatch):
    real = Choices.logprobs
    monkeypatch.setattr(Choices, "logprobs", lambda self, i, token: real(self, (i + 1) % len(self.params), token))
    with pytest.raises(AssertionError, match="numpy log_softmax"):
        check_logprobs()


def test_sampling_params_check_the_new_fields():
    for bad in ({"presence_penalty": 2.5}, {"frequency_penalty": float("nan")}, {"repetition_penalty": 0},
                {"min_p": -0.1}, {"logit_bias": {"3": 1.0}}, {"logit_bias": {3: float("inf")}}, {"logprobs": -1},
                {"logit_bias": [1]}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    engine = scripted_engine()
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request([1, 2], SamplingParams(logit_bias={VOCAB: 1.0}))
    assert sampling_mod.sample_token  # the module the min_p step lives in
