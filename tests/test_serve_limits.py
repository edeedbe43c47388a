"""paged-serve under hostile or careless clients (issue 37, items 1-4), over the fake engine and a real uvicorn
server in a thread: malformed JSON (lone surrogates, deep nesting, huge integers, NaN) and requests the KV pool
can never hold are 400s naming the field; stop strings are bounded and matched in linear time; a full queue is a
429 with Retry-After; a request's deadline; 404 / 405 as JSON; an engine failure marks /health 503 and fails each
in-flight request once, logged once; orphaned requests (the openai client's timed-out retries) are aborted within
an engine step; the API key, JSON-only bodies, the Host check and CORS; tokenization, templating and detokenization
off the event loop. The real sockets and the paged-serve process: tests/test_serve_process.py."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import threading
import time

import httpx
import openai
import pytest

from pagedkit.apps.serve import create_app, security
from pagedkit.apps.serve.limits import ServeLimits
from pagedkit.apps.serve.textstream import TextStream
from pagedkit.apps.serve.tokenizer import ServeTokenizer, load_tokenizer
from test_serve_helpers import FakeEngine, ServerThread, sse_events, write_tokenizer

MODEL = "tiny-serve"
USER = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("tok"))


def serve(engine, tok_dir, limits=None, **kw):
    return ServerThread(create_app(engine, load_tokenizer(tok_dir), MODEL, limits=limits, **kw), limits=limits)


@pytest.fixture(scope="module")
def url(tok_dir):
    with serve(FakeEngine(), tok_dir) as base:
        yield base


def _post(url, path, raw: bytes):
    return httpx.post(url + path, content=raw, headers={"content-type": "application/json"}, timeout=30)


def _error(r, status=400):
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json", r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


# -- malformed bodies: 400 naming the field (they were 500s with a traceback) -------------------------------------

@pytest.mark.parametrize("path, raw, param, words", [
    ("/v1/completions", b'{"prompt": "abc \\ud800 def"}', "prompt", "lone surrogate"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x \\udc00"}]}', "messages",
     "messages[0].content: a lone surrogate"),
    ("/v1/completions", b'{"prompt": "hi", "stop": ["ok", "\\ud83d"]}', "stop", "stop[1]: a lone surrogate"),
    ("/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "prompt", "nested deeper than 64"),
    ("/v1/completions", b'{"prompt": "hi", "stop": ' + b"[" * 70 + b"]" * 70 + b"}", "stop", "nested deeper than 64"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", "max_tokens", "5001 digits"),
    ("/v1/completions", b'{"prompt": [1, 2, -' + b"9" * 4400 + b"]}", "prompt", "prompt[2]: an integer literal"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', "temperature", "NaN is not a JSON number"),
    ("/v1/completions", b'{"prompt": "hi", "top_p": -Infinity}', "top_p", "-Infinity"),
    ("/v1/completions", b'{"prompt": "hi", "seed": 1' + b"0" * 30 + b"}", "seed", "<= 9223372036854775807"),
    ("/v1/completions", b'{"prompt": "hi", "max_time": 1e999}', "max_time", "seconds > 0"),
], ids=["surrogate", "surrogate-chat", "surrogate-stop", "nesting-100000", "nesting-70", "digits-5001",
        "digits-4400", "nan", "infinity", "seed-31-digits", "max-time-inf"])
def test_malformed_bodies_are_400s_naming_the_field(url, path, raw, param, words):
    err = _error(_post(url, path, raw))
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert err["message"].startswith(param) and words in err["message"], err["message"]
    assert httpx.get(f"{url}/health").json()["status"] == "ok"


# -- the KV pool: a request it can never hold is a 400 naming both numbers -----------------------------------------

def test_a_request_the_pool_can_never_hold_is_a_400_naming_both_numbers(tok_dir):
    tok = ServeTokenizer(load_tokenizer(tok_dir))
    engine = FakeEngine(max_pool_tokens=40)
    with serve(engine, tok_dir) as url:
        err = _error(httpx.post(f"{url}/v1/completions", json={"prompt": "t9 " * 45}))
        assert err["param"] == "prompt" and "45 tokens" in err["message"] and "at most 40" in err["message"], err
        err = _error(httpx.post(f"{url}/v1/completions", json={"prompt": [5] * 10, "max_tokens": 35}))
        assert err["param"] == "max_tokens" and "expected at most 31" in err["message"], err
        assert "40 tokens" in err["message"] and "prompt has 10 tokens" in err["message"], err
        # chat without max_tokens: the rest of the context, cut to what the pool holds (it was a 500)
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": USER})
        assert r.status_code == 200, r.text
        prompt_len = len(tok.chat(USER))
        assert r.json()["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 40 + 1 - prompt_len,
                                     "total_tokens": 41, "prompt_tokens_details": {"cached_tokens": 0}}
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert httpx.post(f"{url}/v1/completions", json={"prompt": [5] * 10, "max_tokens": 31}).status_code == 200
        assert not engine.aborted  # nothing reached the engine's own refusal


# -- stop strings: bounded, and matched in time linear in the text -----------------------------------------------

def test_stop_string_limits(tok_dir):
    with serve(FakeEngine(), tok_dir) as url:
        err = _error(httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}))
        assert err["param"] == "stop" and "at most 16 stop strings" in err["message"] and "got 17" in err["message"]
        err = _error(httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "stop": "x" * 1025}))
        assert err["param"] == "stop" and "at most 1024 characters" in err["message"], err
        ok = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "stop": ["x" * 1024] * 16, "max_tokens": 3})
        assert ok.status_code == 200, ok.text
    with serve(FakeEngine(), tok_dir, ServeLimits(max_stop_strings=2, max_stop_length=5)) as url:
        err = _error(httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "stop": ["a", "b", "c"]}))
        assert err["param"] == "stop" and "at most 2 stop strings" in err["message"], err
        assert _error(httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "stop": "abcdef"}))["param"] == "stop"
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "stop": ["abcde", "b"]}).status_code == 200


def _traced_lines(fn, *args) -> int:
    """Python lines run inside textstream.py by fn(*args): the matcher's work, counted, not timed."""
    import pagedkit.apps.serve.textstream as module

    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if frame.f_code.co_filename != module.__file__:
            return None
        if event == "line":
            count += 1
        return tracer

    sys.settrace(tracer)
    try:
        fn(*args)
    finally:
        sys.settrace(None)
    return count


def test_stop_matching_work_per_token_does_not_grow_with_the_text():
    """16 stop strings of 1000 characters that never match: a token's matching work is the same at token 10 and
    token 1500 (the old matcher tried every prefix length of every stop string against the text's end: its work
    per token grew with the text, 0.9 s of event loop a token in the issue's measurement)."""
    stops = [chr(ord("A") + i) * 999 + "!" for i in range(16)]
    ts = TextStream(lambda ids: "".join(chr(97 + i % 26) for i in ids), stops)
    work = []
    for i in range(1500):
        work.append(_traced_lines(ts.push, [i]))
    assert len(ts.text) == 1500 and not ts.stopped
    assert max(work[1000:]) <= max(work[5:15]), (work[5:15], max(work[1000:]))


def _released_oracle(pieces, stops):
    """Brute force: after each piece, the text is cut at the earliest stop string it contains; what is shown is the
    text minus its longest suffix that is a proper prefix of a stop string (nothing is held once stopped)."""
    text, shown, out, stopped = "", 0, [], False
    for piece in pieces:
        if stopped:
            out.append("")
            continue
        text += piece
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            text, stopped = text[:min(hits)], True
            hold = 0
        else:
            hold = max([k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])], default=0)
        end = max(shown, len(text) - hold)
        out.append(text[shown:end])
        shown = end
    return out, stopped, text


def test_textstream_stop_matching_equals_a_brute_force_oracle():
    """The linear matcher against brute force over random texts and overlapping stop strings (a, ab, aab...)."""
    import random

    rng = random.Random(37)
    for _ in range(400):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
        pieces = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 12))]
        ts = TextStream(lambda ids: "".join(pieces[i] for i in ids), stops)
        got = [ts.push([i]) for i in range(len(pieces))]
        want, stopped, text = _released_oracle(pieces, stops)
        assert (got, ts.stopped, ts.text) == (want, stopped, text), (stops, pieces)
        if not stopped:
            assert "".join(got) + ts.finish() == text


# -- the queue, the deadline -----------------------------------------------------------------------------------------

def test_a_full_queue_is_a_429_with_retry_after(tok_dir):
    engine = FakeEngine(delay=0.02)
    with serve(engine, tok_dir, ServeLimits(max_queue_len=1, retry_after_s=3)) as url:
        with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 250,
                                                                 "stream": True}) as held:
            lines = held.iter_lines()  # kept: a dropped iterator closes the connection
            assert next(lines).startswith("data: {")  # one request in progress: the queue is full
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            err = _error(r, 429)
            assert r.headers["retry-after"] == "3" and err["type"] == "rate_limit_error", (r.headers, err)
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.RateLimitError):
                client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})  # the stream's slot is free
        assert r.status_code == 200, r.text


def test_a_request_deadline_ends_it_with_length(tok_dir):
    engine = FakeEngine(delay=0.02, max_seq_len=4096)
    with serve(engine, tok_dir, ServeLimits(request_timeout_s=0.4)) as url:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2000, "ignore_eos": True},
                       timeout=20)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert 0 < r.json()["usage"]["completion_tokens"] < 2000
        assert len(engine.aborted) == 1  # the engine request ended with the deadline
        err = _error(httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_time": 5}))
        assert err["param"] == "max_time" and "<= 0.4" in err["message"], err
        with httpx.stream("POST", f"{url}/v1/completions", timeout=20, json={
                "prompt": "hi", "max_tokens": 2000, "stream": True, "max_time": 0.2}) as s:
            events = sse_events(s)
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert len(engine.aborted) == 2


# -- 404 / 405, engine failure ---------------------------------------------------------------------------------------

def test_404_and_405_are_json_error_objects(url):
    err = _error(httpx.get(f"{url}/v1/nope"), 404)
    assert err["code"] == "not_found" and "/v1/nope" in err["message"]
    r = httpx.get(f"{url}/v1/completions")
    err = _error(r, 405)
    assert err["code"] == "method_not_allowed" and r.headers["allow"] == "POST"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("something-else")
    assert exc.value.body["code"] == "model_not_found" and "something-else" in exc.value.body["message"]
    assert client.models.retrieve(MODEL).id == MODEL  # /v1/models/{id}


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_engine_failure_marks_health_503_and_fails_each_request_once(tok_dir):
    engine = FakeEngine(delay=0.05, fail_after=4)
    records = _Records()
    try:
        with serve(engine, tok_dir) as url:
            logging.getLogger("uvicorn.error").addHandler(records)  # after uvicorn configured its loggers
            async def in_flight():
                async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                    async def stream():
                        async with client.stream("POST", "/v1/completions", json={
                                "prompt": "hi", "max_tokens": 100, "stream": True}) as r:
                            return [line async for line in r.aiter_lines() if line]
                    plain = [client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 100})
                             for _ in range(2)]
                    return await asyncio.gather(*plain, stream())

            first, second, events = asyncio.run(in_flight())
            for r in (first, second):
                err = _error(r, 500)
                assert err["type"] == "server_error" and "fake engine failure" in err["message"]
            errors = [json.loads(e[6:]) for e in events if e.startswith("data: {") and '"error"' in e]
            assert len(errors) == 1 and events[-1] == "data: [DONE]"
            h = httpx.get(f"{url}/health")
            assert h.status_code == 503 and h.json()["status"] == "error" and "fake engine failure" in h.json()["error"]
            assert _error(httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}), 503)["type"] == "server_error"
    finally:
        logging.getLogger("uvicorn.error").removeHandler(records)
    failures = [r for r in records.records if r.levelno >= logging.ERROR]
    assert len(failures) == 1 and "fake engine failure" in str(failures[0].exc_info[1]), failures


# -- orphaned requests ------------------------------------------------------------------------------------------------

def _steps_later(engine, n: int) -> None:
    """Wait until the engine ran n more steps (a keeper request keeps it stepping)."""
    target = engine.steps + n
    while engine.steps < target:
        time.sleep(0.01)


def test_orphaned_retries_are_aborted_within_an_engine_step(tok_dir):
    """The openai client times out and retries twice: each of its three requests is aborted once its connection
    is gone; two engine steps after the client gave up the engine holds none of them, only another client's
    request that keeps it stepping (they used to generate on until max_tokens or the context)."""
    engine = FakeEngine(delay=0.1, max_seq_len=4096)
    with serve(engine, tok_dir) as url:
        keeper_open, stop = threading.Event(), threading.Event()

        def keeper():
            with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
                    "prompt": "the cat", "max_tokens": 4000, "ignore_eos": True, "stream": True}) as r:
                lines = r.iter_lines()
                next(lines)
                keeper_open.set()
                while not stop.is_set():
                    next(lines)

        thread = threading.Thread(target=keeper, daemon=True)
        thread.start()
        assert keeper_open.wait(30)
        (keeper_id,) = engine.params
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=0.4, max_retries=2)
        try:
            with pytest.raises(openai.APITimeoutError):
                client.completions.create(model=MODEL, prompt="hello", max_tokens=2000, extra_body={"ignore_eos": True})
            _steps_later(engine, 2)
            assert len(engine.params) == 4 and len(engine.aborted) == 3 and list(engine._reqs) == [keeper_id]
            with pytest.raises(openai.APITimeoutError):  # chat, without max_tokens: the rest of the context
                client.chat.completions.create(model=MODEL, messages=USER)
            _steps_later(engine, 2)
            assert len(engine.params) == 7 and len(engine.aborted) == 6 and list(engine._reqs) == [keeper_id]
        finally:
            stop.set()
            thread.join(30)
        _steps_later(engine, 0)
        deadline = time.monotonic() + 10
        while engine.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine.has_unfinished() and httpx.get(f"{url}/health").json()["pending_requests"] == 0


# -- who may drive the server -----------------------------------------------------------------------------------

def test_api_key_bearer_compared_in_constant_time(tok_dir, monkeypatch):
    compared = []
    real = security.hmac.compare_digest
    monkeypatch.setattr(security.hmac, "compare_digest", lambda a, b: compared.append((a, b)) or real(a, b))
    with serve(FakeEngine(), tok_dir, api_key="sk-test-37") as url:
        body = {"prompt": "hi", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "sk-test-37"},
                        {"Authorization": "Basic sk-test-37"}):
            r = httpx.post(f"{url}/v1/completions", json=body, headers=headers)
            assert _error(r, 401)["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
        assert (b"sk-wrong", b"sk-test-37") in compared
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/health").status_code == 200  # probes need no key
        r = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer sk-test-37"})
        assert r.status_code == 200, r.text
        assert openai.OpenAI(base_url=f"{url}/v1", api_key="sk-test-37").completions.create(
            model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="sk-nope", max_retries=0).models.list()


def test_only_json_bodies(url):
    body = json.dumps({"prompt": "hi", "max_tokens": 2})
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {} if ctype is None else {"content-type": ctype}
        r = httpx.post(f"{url}/v1/completions", content=body, headers=headers)
        assert _error(r, 415)["code"] == "unsupported_media_type", ctype
    r = httpx.post(f"{url}/v1/completions", content=body, headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text


def test_host_check_and_cors(tok_dir):
    assert security.allowed_hosts_for("0.0.0.0") is None
    assert security.allowed_hosts_for("0.0.0.0", ["api.example"]) == ("api.example",)
    hosts = security.allowed_hosts_for("127.0.0.1")
    with serve(FakeEngine(), tok_dir, allowed_hosts=hosts, allowed_origins=["http://ok.example"]) as url:
        port = url.rsplit(":", 1)[1]
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", "localhost.evil:1"):
            r = httpx.get(f"{url}/v1/models", headers={"host": host})
            assert _error(r, 400)["code"] == "invalid_host", host
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "127.0.0.2", "localhost"):
            assert httpx.get(f"{url}/v1/models", headers={"host": host}).status_code == 200, host
        pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
        r = httpx.options(f"{url}/v1/completions", headers=pre | {"Origin": "http://ok.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ok.example"
        r = httpx.options(f"{url}/v1/completions", headers=pre | {"Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in r.headers
    with serve(FakeEngine(), tok_dir) as url:  # no allowed origins: no CORS headers at all
        r = httpx.get(f"{url}/v1/models", headers={"Origin": "http://ok.example"})
        assert r.status_code == 200 and not any(k.startswith("access-control") for k in r.headers)


# -- text work off the event loop --------------------------------------------------------------------------------------

class _LoopSpy(ServeTokenizer):
    """Records, for each tokenizer call, whether it ran on a thread running an asyncio event loop."""

    def __init__(self, tok):
        super().__init__(tok)
        self.calls: list[tuple[str, bool]] = []

    def _record(self, what):
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        self.calls.append((what, on_loop))

    def encode(self, text):
        self._record("encode")
        return super().encode(text)

    def decode(self, ids):
        self._record("decode")
        return super().decode(ids)

    def chat(self, messages):
        self._record("chat")
        return super().chat(messages)


def test_tokenization_templating_and_detokenization_run_off_the_event_loop(tok_dir):
    spy = _LoopSpy(load_tokenizer(tok_dir))
    with ServerThread(create_app(FakeEngine(), spy, MODEL)) as url:
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "hello world", "max_tokens": 4}).status_code == 200
        with httpx.stream("POST", f"{url}/v1/chat/completions", json={"messages": USER, "max_tokens": 4,
                                                                      "stream": True, "stop": ["zz"]}) as s:
            assert sse_events(s)[-1] == "[DONE]"
    kinds = {what for what, _ in spy.calls}
    assert kinds == {"encode", "decode", "chat"}, kinds
    assert not [c for c in spy.calls if c[1]], [c for c in spy.calls if c[1]]
    assert threading.current_thread() is threading.main_thread()


class _BlockingTokenizer(ServeTokenizer):
    """encode waits for the test's go: a long tokenization the test can hold open."""

    def __init__(self, tok):
        super().__init__(tok)
        self.entered, self.go = threading.Event(), threading.Event()

    def encode(self, text):
        self.entered.set()
        assert self.go.wait(30)
        return super().encode(text)


def test_health_answers_while_a_prompt_is_being_tokenized(tok_dir):
    """The issue's 50 MB prompt: /health waited 33.5 s for its tokenization. Here the tokenization is held open
    until /health has answered (it used to run on the event loop: /health timed out behind it)."""
    tok = _BlockingTokenizer(load_tokenizer(tok_dir))
    with ServerThread(create_app(FakeEngine(), tok, MODEL)) as url:
        result = {}
        thread = threading.Thread(target=lambda: result.update(r=httpx.post(
            f"{url}/v1/completions", json={"prompt": "hello world", "max_tokens": 2}, timeout=60)), daemon=True)
        thread.start()
        try:
            assert tok.entered.wait(30)
            assert httpx.get(f"{url}/health", timeout=5).json()["status"] == "ok"  # while encode is held
        finally:
            tok.go.set()
            thread.join(60)
        assert result["r"].status_code == 200, result["r"].text
