"""A hypothesis fuzz of paged-serve's request bodies against the REAL engine on a tiny exported Llama (issue 37):
well-formed requests, every field replaced at random by junk JSON (lone surrogates, huge integers, NaN, nesting,
wrong types), raw bytes, streams the client leaves after the first event. Whatever comes: no 5xx, /health keeps
answering, and once everything ended the engine holds no request and every KV block is back in the pool."""

from __future__ import annotations

import collections
import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkit.apps.serve import create_app
from pagedkit.apps.serve.limits import ServeLimits
from pagedkit.apps.serve.tokenizer import load_tokenizer
from pagedkit.engine import Engine
from test_serve_helpers import WORDS, ServerThread, tiny_served_model

NAME = "tiny-llama"
SEEN: collections.Counter = collections.Counter()  # what the fuzz reached: statuses, streams left early


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = tiny_served_model(tmp_path_factory.mktemp("fuzz") / NAME)
    engine = Engine(model, max_batch_size=4, max_num_tokens=64, num_blocks=8)  # 128 tokens: never-fits happen
    limits = ServeLimits(request_timeout_s=2, max_stop_strings=8, max_stop_length=16, max_json_depth=8)
    with ServerThread(create_app(engine, load_tokenizer(model), NAME, limits=limits), limits=limits) as url:
        yield engine, url


SURROGATES = st.sampled_from(["\ud800", "a \udfff b", "\udbff\udbff"])
SCALARS = (st.none() | st.booleans() | st.integers() | st.integers(min_value=10 ** 200, max_value=10 ** 201)
           | st.floats() | st.text(max_size=8) | SURROGATES)
JUNK = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                         max_size=3), max_leaves=12)
CLEAN = st.lists(st.sampled_from(WORDS + ["t40", "t99", "zzz"]), max_size=12).map(" ".join)
TEXT = st.one_of(CLEAN, CLEAN, CLEAN, st.tuples(CLEAN, SURROGATES).map(" ".join))  # a lone surrogate now and then


GOOD = {  # values a client may well send (some still refused: a never-fitting max_tokens, stream_options alone)
    "model": st.just(NAME),
    "max_tokens": st.integers(1, 12) | st.integers(100, 250),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 200),
    "seed": st.integers(0, 2 ** 63 - 1),
    "stop": TEXT | st.lists(TEXT, max_size=10),
    "stop_token_ids": st.lists(st.integers(0, 143), max_size=4),
    "ignore_eos": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "n": st.just(1),
    "max_time": st.floats(0.05, 2),
}
PROMPTS = TEXT | st.lists(st.integers(0, 143), min_size=1, max_size=140)
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                           "content": TEXT | st.lists(st.fixed_dictionaries(
                                               {"type": st.just("text"), "text": TEXT}), max_size=2)}),
                    min_size=1, max_size=3)


def _consistent(body: dict) -> dict:
    return body | {"stream": True} if "stream_options" in body else body


COMPLETIONS = st.fixed_dictionaries({"prompt": PROMPTS, "stream": st.booleans()}, optional=GOOD).map(_consistent)
CHATS = st.fixed_dictionaries({"messages": MESSAGES, "stream": st.booleans()}, optional=GOOD).map(_consistent)
# up to two fields (known or not) replaced by junk, or none
JUNK_FIELDS = st.one_of(st.just({}), st.just({}), st.dictionaries(
    st.sampled_from(["prompt", "messages", "user", *GOOD]), JUNK, min_size=1, max_size=2))
REQUESTS = st.one_of(
    st.tuples(st.just("/v1/completions"), COMPLETIONS, JUNK_FIELDS),
    st.tuples(st.just("/v1/chat/completions"), CHATS, JUNK_FIELDS),
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), COMPLETIONS | CHATS, JUNK_FIELDS),
).map(lambda t: (t[0], json.dumps(t[1] | t[2]).encode()))
RAW = st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
                JUNK.map(json.dumps).map(str.encode) | st.binary(max_size=40))


@settings(max_examples=100, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(request=st.one_of(REQUESTS, REQUESTS, REQUESTS, RAW), leave_early=st.booleans())
def test_fuzzed_bodies_never_get_a_5xx_and_leak_no_block(served, request, leave_early):
    engine, url = served
    path, raw = request
    headers = {"content-type": "application/json"}
    with httpx.stream("POST", url + path, content=raw, headers=headers, timeout=60) as r:
        assert r.status_code < 500, (raw, r.read())
        SEEN[r.status_code] += 1
        if r.headers["content-type"].startswith("text/event-stream"):
            lines = r.iter_lines()
            first = next(lines)
            assert first.startswith("data: {"), first
            SEEN["left early" if leave_early else "streamed"] += 1
            if not leave_early:
                rest = [line for line in lines if line]
                assert rest[-1] == "data: [DONE]" and not any('"error"' in line for line in rest), rest[-3:]
        else:
            body = json.loads(r.read())
            assert ("error" in body) == (r.status_code >= 400), body
    assert httpx.get(f"{url}/health", timeout=30).json()["status"] == "ok"


def test_after_the_fuzz_the_pool_is_whole(served):
    """Runs after the fuzz (file order): every request ended and every block is back."""
    engine, url = served
    deadline = time.monotonic() + 30
    while (engine.has_unfinished() or httpx.get(f"{url}/health").json()["pending_requests"]) and \
            time.monotonic() < deadline:
        time.sleep(0.02)
    assert not engine.has_unfinished() and httpx.get(f"{url}/health").json() == {
        "status": "ok", "model": NAME, "pending_requests": 0}
    assert engine.num_free_blocks() == engine.num_blocks() and engine.check_invariants() == []
    assert min(SEEN[200], SEEN[400]) >= 15 and min(SEEN["left early"], SEEN["streamed"]) >= 3, SEEN
