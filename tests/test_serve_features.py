"""paged-serve's OpenAI features through the official `openai` client, against the REAL engine on a tiny exported
Llama (vocab 144, word-level tokenizer), each checked against an independent numpy oracle of the engine's own
logits (captured by wrapping the model's run: one row per generated token when one request runs at a time):

- logprobs / top_logprobs (completions and chat, plain and streamed): each token's logprob and the top tokens
  equal numpy's log_softmax of the RAW logits row (temperature does not change them), the sampled token among
  the completions' top_logprobs;
- presence / frequency / repetition penalties and logit_bias (greedy): each token is the oracle's argmax of the
  processed logits of its context; logit_bias +100 forces a token; min_p (sampled): each token in the oracle's
  support;
- n = 4: greedy gives 4 equal choices, seeded sampling 4 different ones, the prompt prefilled once (the engine's
  fed tokens), usage counts every choice; streamed n = 2 reassembles to the plain answer;
- usage.prompt_tokens_details.cached_tokens: the prefix-cache hit of a repeated prompt;
- /v1/models/{id} (a name with a slash too).
Teeth: choices submitted as separate requests (prefill n times), every choice with one seed, logprob entries
shifted by one token, the sampled token missing from top_logprobs.
"""

from __future__ import annotations

import numpy as np
import openai
import pytest

from pagedkit.apps.serve import create_app
from pagedkit.apps.serve import generation as gen_mod
from pagedkit.apps.serve import responses as resp_mod
from pagedkit.apps.serve.tokenizer import ServeTokenizer, load_tokenizer
from pagedkit.engine import Engine, SamplingParams
from test_engine_logits import oracle_logprobs, oracle_probs, oracle_processed
from test_serve_helpers import ServerThread, tiny_served_model, vocab

IDS = vocab()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_served_model(tmp_path_factory.mktemp("features") / "tiny-llama")


class Capture:
    """engine.model.run wrapped: the float64 rows of every step's sampled logits, in order."""

    def __init__(self, engine):
        self.rows: list[np.ndarray] = []
        real = engine.model.run

        def run(plan, token_ids, rows=None, device_ids=None):
            out = real(plan, token_ids, rows, device_ids)
            self.rows += [r for r in out.detach().double().cpu().numpy()]
            return out

        engine.model.run = run

    def take(self) -> list[np.ndarray]:
        rows, self.rows = self.rows, []
        return rows


@pytest.fixture(scope="module")
def served(model_dir):
    engine = Engine(model_dir, max_batch_size=8, max_num_tokens=128)
    capture = Capture(engine)
    with ServerThread(create_app(engine, load_tokenizer(model_dir), model_dir.name)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        yield engine, capture, client, ServeTokenizer(load_tokenizer(model_dir))


PROMPT = "hello world the cat sat on the mat"


def _ids(texts):
    return [IDS[t] for t in texts]


# ---- logprobs ---------------------------------------------------------------------------------------------------

def check_completion_logprobs(engine, capture, client, tok):
    capture.take()
    kw = dict(model="tiny-llama", prompt=PROMPT, max_tokens=8, temperature=0.6, seed=3, logprobs=3,
              extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    rows = capture.take()
    lp = r.choices[0].logprobs
    toks = _ids(lp.tokens)
    assert len(rows) == len(toks) == 8 and r.usage.completion_tokens == 8
    assert tok.decode(toks) == r.choices[0].text
    for k, (t, row) in enumerate(zip(toks, rows)):
        ref = oracle_logprobs(row)
        assert abs(lp.token_logprobs[k] - ref[t]) < 1e-5, f"token {k}: logprob {lp.token_logprobs[k]}, numpy {ref[t]}"
        top = lp.top_logprobs[k]
        want = set(np.argsort(-ref)[:3].tolist()) | {t}
        assert set(_ids(top)) == want, f"token {k}: top_logprobs {sorted(_ids(top))}, numpy's top 3 + sampled {want}"
        assert all(abs(v - ref[IDS[s]]) < 1e-5 for s, v in top.items())
    assert lp.text_offset == [sum(len(s) for s in lp.tokens[:k]) for k in range(8)]
    streamed = list(client.completions.create(**kw, stream=True))
    got = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.token_logprobs]
    assert np.allclose(got, lp.token_logprobs, atol=1e-9, rtol=0), "streamed logprobs differ from the plain ones"
    assert "".join(c.choices[0].text for c in streamed if c.choices) == r.choices[0].text


def test_completion_logprobs_are_log_softmax_of_the_engine_logits(served):
    check_completion_logprobs(*served)


def test_chat_logprobs_plain_and_streamed(served):
    engine, capture, client, tok = served
    capture.take()
    kw = dict(model="tiny-llama", messages=[{"role": "user", "content": "hello cat"}], max_tokens=6, temperature=1.2,
              seed=11, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    rows = capture.take()
    content = r.choices[0].logprobs.content
    toks = [IDS[c.token] for c in content]
    assert len(rows) == len(toks) == 6
    for k, (c, row) in enumerate(zip(content, rows)):
        ref = oracle_logprobs(row)
        assert abs(c.logprob - ref[toks[k]]) < 1e-5 and c.bytes == list(c.token.encode())
        assert [IDS[t.token] for t in c.top_logprobs] == np.argsort(-ref, kind="stable")[:2].tolist()
        assert np.allclose([t.logprob for t in c.top_logprobs], np.sort(ref)[::-1][:2], atol=1e-5, rtol=0)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 9)) for e in streamed] == [(e.token, round(e.logprob, 9)) for e in content]


def test_teeth_logprob_entries_shifted(served, monkeypatch):
    real = gen_mod.Generation._push

    def shifted(self, ids, lps):  # each token gets the entry of the token before it
        lps, prev = list(lps), getattr(self, "_prev_entry", None)
        if lps:
            self._prev_entry = lps[-1]
            lps = [prev if prev is not None else lps[0]] + lps[:-1]
        return real(self, ids, lps)

    monkeypatch.setattr(gen_mod.Generation, "_push", shifted)
    with pytest.raises(AssertionError, match="numpy"):
        check_completion_logprobs(*served)


def test_teeth_sampled_token_missing_from_top(served, monkeypatch):
    real = resp_mod.Logprobs.format

    def without_sampled(self, entries):
        out = real(self, entries)
        if not self.chat:
            out["top_logprobs"] = [{t: v for t, v in top.items() if t != s or len(top) == 1}
                                   for top, s in zip(out["top_logprobs"], out["tokens"])]
        return out

    monkeypatch.setattr(resp_mod.Logprobs, "format", without_sampled)
    with pytest.raises(AssertionError, match="sampled"):
        for _ in range(3):  # the sampled token is not always outside the top 3
            check_completion_logprobs(*served)


# ---- penalties, logit_bias, min_p ----------------------------------------------------------------------------------

def test_penalties_and_logit_bias_are_the_oracles_argmax(served):
    engine, capture, client, tok = served
    prompt = tok.encode(PROMPT)
    cases = [dict(frequency_penalty=1.2, presence_penalty=0.6, logit_bias={"20": 1.5, "30": -2.0}),
             dict(extra_body={"repetition_penalty": 1.5}, presence_penalty=-0.8),
             dict(frequency_penalty=-0.5, logit_bias={str(IDS["cat"]): 0.7}, extra_body={"repetition_penalty": 0.8})]
    for case in cases:
        capture.take()
        body = case.pop("extra_body", {})
        r = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=16, temperature=0, logprobs=0,
                                      extra_body=body | {"ignore_eos": True}, **case)
        rows, toks = capture.take(), _ids(r.choices[0].logprobs.tokens)
        p = SamplingParams(temperature=0, presence_penalty=case.get("presence_penalty", 0.0),
                           frequency_penalty=case.get("frequency_penalty", 0.0),
                           repetition_penalty=body.get("repetition_penalty", 1.0),
                           logit_bias={int(k): v for k, v in case.get("logit_bias", {}).items()} or None)
        plain = [int(np.argmax(row)) for row in rows]
        want = [int(np.argmax(oracle_processed(row, p, prompt + toks[:k], len(prompt)))) for k, row in enumerate(rows)]
        assert toks == want, f"{case} {body}: tokens {toks}, the oracle's argmaxes {want}"
        assert toks != plain, f"{case}: the processing changed nothing here (not a test of it)"
    forced = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=5, temperature=0.9, seed=1,
                                       logit_bias={str(IDS["dog"]): 100})
    assert forced.choices[0].text.split() == ["dog"] * 5


def test_min_p_keeps_the_oracles_support(served):
    engine, capture, client, tok = served
    prompt = tok.encode(PROMPT)
    p = SamplingParams(temperature=1.5, min_p=0.3)
    outside_plain = 0
    for seed in range(6):
        capture.take()
        r = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=8, temperature=1.5, seed=seed,
                                      logprobs=0, extra_body={"min_p": 0.3, "ignore_eos": True})
        rows, toks = capture.take(), _ids(r.choices[0].logprobs.tokens)
        for k, (t, row) in enumerate(zip(toks, rows)):
            assert oracle_probs(row, p, prompt + toks[:k], len(prompt))[t] > 0, f"seed {seed} token {k}: {t} is " \
                "outside min_p's support"
            outside_plain += int((oracle_probs(row, SamplingParams(temperature=1.5), [], 0) > 0).sum() >
                                 (oracle_probs(row, p, [], 0) > 0).sum())
    assert outside_plain > 0  # min_p did cut tokens at these steps


# ---- n > 1 ------------------------------------------------------------------------------------------------------

def check_n(engine, client):
    kw = dict(model="tiny-llama", prompt=PROMPT + " a dog", max_tokens=10, extra_body={"ignore_eos": True})
    engine.kv.clear_prefix_cache()
    fed, hits = engine.stats.tokens, engine.stats.prefix_hit_tokens
    greedy = client.completions.create(n=4, temperature=0, **kw)
    prompt_len = greedy.usage.prompt_tokens
    assert [c.index for c in greedy.choices] == [0, 1, 2, 3]
    assert len({c.text for c in greedy.choices}) == 1 and greedy.usage.completion_tokens == 40
    once = prompt_len - (engine.stats.prefix_hit_tokens - hits) + 4 * 9
    assert engine.stats.tokens - fed == once, f"fed {engine.stats.tokens - fed} tokens; the prompt once: {once}"
    alone = client.completions.create(temperature=0, **kw).choices[0].text
    assert greedy.choices[0].text == alone
    seeded = client.completions.create(n=4, temperature=1.0, seed=21, **kw)
    assert len({c.text for c in seeded.choices}) == 4, [c.text for c in seeded.choices]
    again = client.completions.create(n=4, temperature=1.0, seed=21, **kw)
    assert [c.text for c in again.choices] == [c.text for c in seeded.choices]
    chat = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hello"}], n=2,
                                          max_tokens=5, temperature=1.0, seed=2, stream=True,
                                          stream_options={"include_usage": True})
    parts, reasons, usage = {0: "", 1: ""}, {}, None
    for ch in chat:
        for c in ch.choices:
            parts[c.index] += c.delta.content or ""
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
        usage = ch.usage or usage
    plain = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hello"}], n=2,
                                           max_tokens=5, temperature=1.0, seed=2)
    assert parts == {c.index: c.message.content for c in plain.choices} and set(reasons) == {0, 1}
    assert usage.completion_tokens == plain.usage.completion_tokens
    assert engine.num_free_blocks() == engine.num_blocks() and engine.check_invariants() == []


def test_n_choices(served):
    check_n(served[0], served[2])


def test_teeth_n_as_separate_requests(served, monkeypatch):
    def separately(self, prompt, params, arrival=None):
        return [self.submit(prompt, p, arrival) for p in params]

    monkeypatch.setattr(gen_mod.EngineWorker, "submit_group", separately)
    with pytest.raises(AssertionError, match="the prompt once"):
        check_n(served[0], served[2])


def test_teeth_n_with_one_seed(served, monkeypatch):
    real = gen_mod.Server.params
    monkeypatch.setattr(gen_mod.Server, "params", lambda self, s, max_tokens, index=0: real(self, s, max_tokens, 0))
    with pytest.raises(AssertionError):
        check_n(served[0], served[2])


# ---- cached tokens, models ---------------------------------------------------------------------------------------

def test_cached_prompt_tokens_in_usage(served):
    engine, _, client, _ = served
    long = " ".join(f"t{40 + i}" for i in range(40))  # 40 tokens (+ bos): 2 full blocks of 16 cached
    first = client.completions.create(model="tiny-llama", prompt=long, max_tokens=2)
    second = client.chat.completions  # the chat endpoint reports it too
    again = client.completions.create(model="tiny-llama", prompt=long, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens == 32 == (again.usage.prompt_tokens - 1) // 16 * 16
    assert first.usage.prompt_tokens_details.cached_tokens in (0, 32)
    msgs = [{"role": "user", "content": long}]
    second.create(model="tiny-llama", messages=msgs, max_tokens=2)
    chat = second.create(model="tiny-llama", messages=msgs, max_tokens=2)
    assert chat.usage.prompt_tokens_details.cached_tokens == (chat.usage.prompt_tokens - 1) // 16 * 16 > 0


def test_model_retrieve_with_a_slash(model_dir):
    engine = Engine(model_dir, max_batch_size=2)
    with ServerThread(create_app(engine, load_tokenizer(model_dir), "org/tiny-llama")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        m = client.models.retrieve("org/tiny-llama")
        assert m.id == "org/tiny-llama" and m.owned_by == "pagedkit"
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("org/other")
