"""Every request field paged-serve forwards to the engine, asserted at the engine's side, and the ones that
change when generation ends checked by behaviour.

1. Fields: /v1/completions and /v1/chat/completions requests through a real uvicorn server to the fake engine
   (tests/test_serve_helpers.FakeEngine records the SamplingParams it gets): the whole SamplingParams equals the
   one the request asks for (max_tokens / max_completion_tokens -> max_new_tokens, temperature, top_p, top_k with
   -1 = off, seed, stop_token_ids, ignore_eos; stop strings stay in the server: no stop_sequences), and the
   defaults (OpenAI's temperature 1, top_p 1, completions' 16 tokens, chat's rest of the context).
2. Behaviour through the REAL engine with a scripted model (tests/scripted_engine.py) that emits eos (2) as its
   4th token: without ignore_eos the completion ends there ("stop", 4 tokens, eos not in the text); with it the
   generation goes on to max_tokens ("length"); stop_token_ids ends at that token ("stop", kept in the count);
   top_k 1 / a tiny top_p make a hot temperature greedy; the same seed repeats, another differs.
3. max_tokens at the context's edge: prompt + max_tokens == max_seq_len is served, one more is a 400.
Teeth: the server's request conversion (generation.Server.params) with one field dropped fails (1) for every field and
(2) for ignore_eos, stop_token_ids, top_k, top_p and seed.
"""

from __future__ import annotations

import dataclasses

import httpx
import pytest
import torch

from pagedkit.apps.serve import generation as gen_mod
from pagedkit.apps.serve import create_app
from pagedkit.apps.serve.tokenizer import ServeTokenizer, load_tokenizer
from pagedkit.engine import SamplingParams
from scripted_engine import ScriptedModel, continuation_script, one_hot, scripted_engine
from test_serve_helpers import FakeEngine, ServerThread, write_tokenizer

MODEL = "tiny-serve"
FORWARDED = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos",
             "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_p", "logprobs")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_dir):
    return ServeTokenizer(load_tokenizer(tok_dir))


@pytest.fixture(scope="module")
def fake(tok_dir):
    engine = FakeEngine(max_seq_len=64)
    with ServerThread(create_app(engine, load_tokenizer(tok_dir), MODEL)) as url:
        yield engine, url


# ---- 1. every forwarded field, at the engine ------------------------------------------------------------------

CHAT = [{"role": "user", "content": "hello cat"}]
REST = "rest of the context"
FIELD_CASES = [  # (path, request body, the SamplingParams fields the engine must get; the others: their defaults)
    ("/v1/completions", {"prompt": [7, 8, 9], "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 3,
                         "stop_token_ids": [11, 12], "ignore_eos": True, "stop": ["cat sat"]},
     dict(max_new_tokens=7, temperature=0.5, top_p=0.9, top_k=5, seed=3, stop_token_ids=(11, 12), ignore_eos=True)),
    ("/v1/completions", {"prompt": [7, 8, 9], "max_tokens": 5, "temperature": 1.7, "top_p": 0.25, "top_k": -1, "seed": 0,
                         "stop_token_ids": [4], "ignore_eos": False},
     dict(max_new_tokens=5, temperature=1.7, top_p=0.25, top_k=0, seed=0, stop_token_ids=(4,))),
    ("/v1/completions", {"prompt": [7, 8, 9]},  # OpenAI's defaults
     dict(max_new_tokens=16, temperature=1.0, top_p=1.0, top_k=0, seed=None)),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 6, "max_tokens": 9, "temperature": 0,
                              "top_p": 0.5, "top_k": 2, "seed": 12345, "stop_token_ids": [0, 143], "ignore_eos": True},
     dict(max_new_tokens=6, temperature=0.0, top_p=0.5, top_k=2, seed=12345, stop_token_ids=(0, 143), ignore_eos=True)),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": 0.3, "stop_token_ids": [9]},
     dict(max_new_tokens=REST, temperature=0.3, stop_token_ids=(9,))),
    ("/v1/completions", {"prompt": [7, 8, 9], "max_tokens": 4, "presence_penalty": 0.5, "frequency_penalty": -1.25,
                         "repetition_penalty": 1.3, "logit_bias": {"5": -100, "17": 2.5}, "min_p": 0.05, "logprobs": 3},
     dict(max_new_tokens=4, temperature=1.0, presence_penalty=0.5, frequency_penalty=-1.25, repetition_penalty=1.3,
          logit_bias={5: -100.0, 17: 2.5}, min_p=0.05, logprobs=3)),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "logprobs": True, "top_logprobs": 4,
                              "presence_penalty": -2, "frequency_penalty": 2, "logit_bias": {"143": 100}},
     dict(max_new_tokens=3, temperature=1.0, logprobs=4, presence_penalty=-2.0, frequency_penalty=2.0, logit_bias={143: 100.0})),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "logprobs": True, "min_p": 1},
     dict(max_new_tokens=3, temperature=1.0, logprobs=0, min_p=1.0)),
]


def check_fields(engine, url, tok):
    for path, body, want in FIELD_CASES:
        before = set(engine.params)
        r = httpx.post(url + path, json=body, timeout=30)
        assert r.status_code == 200, r.text
        (rid,) = set(engine.params) - before
        got = engine.params[rid]
        if want["max_new_tokens"] == REST:  # chat without a limit: the rest of the context
            want = want | {"max_new_tokens": engine.max_seq_len - len(tok.chat(body["messages"]))}
        want = SamplingParams(**want)
        assert isinstance(got, SamplingParams)
        for name in [f.name for f in dataclasses.fields(SamplingParams)]:
            assert getattr(got, name) == getattr(want, name), \
                f"{path} {body}: the engine got {name}={getattr(got, name)!r}, expected {getattr(want, name)!r}"


def test_every_forwarded_field_reaches_the_engine(fake, tok):
    check_fields(*fake, tok)


def dropping(field: str):
    """Server.params with one field left at SamplingParams' default (the conversion forgot it)."""
    real = gen_mod.Server.params

    def params(self, s, max_tokens, index=0):
        p = real(self, s, max_tokens, index)
        default = {f.name: f.default for f in dataclasses.fields(SamplingParams)}[field]
        return dataclasses.replace(p, **{field: default if field != "max_new_tokens" else 16})

    return params


@pytest.mark.parametrize("field", FORWARDED)
def test_teeth_a_dropped_field_is_caught(fake, tok, monkeypatch, field):
    monkeypatch.setattr(gen_mod.Server, "params", dropping(field))
    with pytest.raises(AssertionError, match=f"the engine got {field}="):
        check_fields(*fake, tok)


# ---- 2. behaviour through the real engine with a scripted model ---------------------------------------------------

EOS_PROMPT = [1, 20, 21]
EOS_SCRIPT = [10, 11, 12, 2, 13, 14, 15, 16, 17, 18]  # eos (2) is the 4th token
FLAT_PROMPT = [1, 22, 23]


def _scripted_logits():
    scripted = continuation_script({tuple(EOS_PROMPT): EOS_SCRIPT})

    def next_logits(req, context):
        if tuple(req.prompt) == tuple(FLAT_PROMPT):  # a flat distribution: argmax 30, then 31..37
            row = one_hot(30, high=1.0)
            row[31:38] = 0.8
            row[:30] = row[38:] = -30.0
            return row
        return scripted(req, context)

    return next_logits


@pytest.fixture(scope="module")
def real(tok_dir):
    engine = scripted_engine(max_batch_size=4, max_num_tokens=64)
    ScriptedModel(engine, _scripted_logits())
    with ServerThread(create_app(engine, load_tokenizer(tok_dir), MODEL)) as url:
        yield engine, url


def _complete(url, **body):
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    return ch["text"], ch["finish_reason"], r.json()["usage"]["completion_tokens"]


def check_eos_behaviour(url, tok):
    base = dict(prompt=EOS_PROMPT, max_tokens=8, temperature=0)
    assert _complete(url, **base) == (tok.decode(EOS_SCRIPT[:3]), "stop", 4), "without ignore_eos: ends at eos"
    assert _complete(url, **base, ignore_eos=True) == (tok.decode(EOS_SCRIPT[:8]), "length", 8), \
        "ignore_eos: goes on past eos"
    assert _complete(url, **base, ignore_eos=True, stop_token_ids=[13]) == (tok.decode(EOS_SCRIPT[:5]), "stop", 5), \
        "stop_token_ids: ends at that token"
    assert _complete(url, **base, stop_token_ids=[11]) == (tok.decode(EOS_SCRIPT[:2]), "stop", 2), \
        "stop_token_ids: ends at that token"


def check_sampling_behaviour(url):
    hot = dict(prompt=FLAT_PROMPT, max_tokens=24, temperature=2.0, seed=5)
    greedy = _complete(url, **(hot | {"temperature": 0}))[0]
    assert set(greedy.split()) == {"t30"}
    assert _complete(url, **hot, top_k=1)[0] == greedy, "top_k 1: greedy"
    assert _complete(url, **hot, top_p=0.01)[0] == greedy, "top_p 0.01: greedy"
    free = _complete(url, **hot)[0]
    assert free != greedy, "temperature 2 without top-k / top-p samples other tokens"
    assert _complete(url, **hot)[0] == free, "seed: the same seed repeats"
    assert _complete(url, **(hot | {"seed": 6}))[0] != free, "seed: another seed differs"


def test_eos_ignore_eos_and_stop_token_ids_through_the_engine(real, tok):
    check_eos_behaviour(real[1], tok)
    assert real[0].check_invariants() == [] and not real[0].running


def test_top_k_top_p_seed_through_the_engine(real):
    check_sampling_behaviour(real[1])


@pytest.mark.parametrize("field", ["ignore_eos", "stop_token_ids"])
def test_teeth_eos_behaviour_needs_the_field(real, tok, monkeypatch, field):
    monkeypatch.setattr(gen_mod.Server, "params", dropping(field))
    with pytest.raises(AssertionError, match=field):
        check_eos_behaviour(real[1], tok)


@pytest.mark.parametrize("field", ["top_k", "top_p", "seed", "temperature"])
def test_teeth_sampling_behaviour_needs_the_field(real, monkeypatch, field):
    monkeypatch.setattr(gen_mod.Server, "params", dropping(field))
    with pytest.raises(AssertionError):
        check_sampling_behaviour(real[1])


def test_tiny_temperature_is_served_greedy(real):
    """temperature 1e-40 is in paged-serve's [0, 2]: greedy text, not a 500 (it used to fail the engine step)."""
    greedy = _complete(real[1], prompt=FLAT_PROMPT, max_tokens=8, temperature=0)
    assert _complete(real[1], prompt=FLAT_PROMPT, max_tokens=8, temperature=1e-40) == greedy


def test_teeth_tiny_temperature_unshifted(real, monkeypatch):
    from pagedkit.engine import sampling

    def unshifted(logits, params, generator):  # the sampler before the fix, without top-k / top-p
        probs = torch.softmax(logits.float() / params.temperature, dim=0)
        return int(torch.multinomial(probs, 1, generator=generator))

    monkeypatch.setattr(sampling, "sample_token", unshifted)
    with pytest.raises(AssertionError, match="the engine failed"):
        test_tiny_temperature_is_served_greedy(real)


# ---- 3. max_tokens at the context's edge ----------------------------------------------------------------------------

def test_max_tokens_at_the_context_edge(fake):
    engine, url = fake  # max_seq_len 64
    prompt = list(range(3, 3 + 60))
    r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "at most 4" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt + [3] * 3})  # 63: one token of room
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
    r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt + [3] * 4})  # 64: none
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "at most 63" in r.json()["error"]["message"]
