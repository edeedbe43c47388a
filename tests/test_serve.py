"""paged-serve over a fake engine (the real engine's interface, deterministic tokens): a real uvicorn server
on a free port called with httpx. Endpoints and their JSON, SSE chunks (the streamed text equals the
non-streamed text), stop strings (never past them, partial matches held back), concurrency, abort on a
client disconnect, 400s naming the field, and the incremental detokenizer itself."""

from __future__ import annotations

import asyncio
import sys
import time

import httpx
import pytest

from pagedkit.apps.serve import create_app
from pagedkit.apps.serve.textstream import TextStream
from pagedkit.apps.serve.tokenizer import ServeTokenizer, load_tokenizer
from test_serve_helpers import (FakeEngine, ServerThread, completion_text, fake_continuation, sse_events,
                                write_tokenizer)

MODEL = "tiny-serve"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_dir):
    return ServeTokenizer(load_tokenizer(tok_dir))


@pytest.fixture(scope="module")
def shared_url(tok_dir):
    with serve(FakeEngine(), tok_dir) as url:
        yield url


def serve(engine, tok_dir, **kw):
    return ServerThread(create_app(engine, load_tokenizer(tok_dir), MODEL, **kw))


def _expected(tok, prompt_ids, n, **kw):
    return tok.decode(fake_continuation(prompt_ids, n, **kw))


def test_models_and_health(tok_dir):
    with serve(FakeEngine(), tok_dir) as url:
        r = httpx.get(f"{url}/v1/models")
        assert r.status_code == 200
        assert [m["id"] for m in r.json()["data"]] == [MODEL] and r.json()["object"] == "list"
        assert r.json()["data"][0]["max_model_len"] == 256
        h = httpx.get(f"{url}/health")
        assert h.status_code == 200 and h.json()["status"] == "ok"


def test_completion_text_usage_and_params(tok_dir, tok):
    engine = FakeEngine()
    with serve(engine, tok_dir) as url:
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hello world", "max_tokens": 7,
                                                      "temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 3})
        assert r.status_code == 200, r.text
        body = r.json()
        ids = tok.encode("hello world")
        assert body["object"] == "text_completion" and body["model"] == MODEL and body["id"].startswith("cmpl-")
        assert body["choices"][0]["text"] == _expected(tok, ids, 7)
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 7, "total_tokens": len(ids) + 7,
                                 "prompt_tokens_details": {"cached_tokens": 0}}
        (params,) = engine.params.values()
        assert (params.max_new_tokens, params.temperature, params.top_p, params.top_k, params.seed) == (7, 0.5, 0.9, 5, 3)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [7, 8, 9], "max_tokens": 4, "temperature": 0})
        assert r.json()["choices"][0]["text"] == _expected(tok, [7, 8, 9], 4)
        assert r.json()["usage"]["prompt_tokens"] == 3


def test_eos_finish_reason_stop(tok_dir, tok):
    with serve(FakeEngine(eos_at=3), tok_dir) as url:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "the cat", "max_tokens": 10})
        ch = r.json()["choices"][0]
        assert ch["finish_reason"] == "stop" and r.json()["usage"]["completion_tokens"] == 4
        assert ch["text"] == _expected(tok, tok.encode("the cat"), 3)


def test_streamed_completion_equals_non_streamed(tok_dir):
    with serve(FakeEngine(), tok_dir) as url:
        req = {"model": MODEL, "prompt": "the cat sat", "max_tokens": 9, "temperature": 0}
        full = httpx.post(f"{url}/v1/completions", json=req).json()
        with httpx.stream("POST", f"{url}/v1/completions", json=req | {"stream": True,
                                                                       "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = sse_events(r)
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert all(c["object"] == "text_completion" and c["model"] == MODEL for c in chunks)
        assert len({c["id"] for c in chunks}) == 1
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        assert text == full["choices"][0]["text"] and len(chunks) > 3
        reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert reasons[-1] == "length" and all(x is None for x in reasons[:-1])
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]


def test_chat_completion_and_stream(tok_dir, tok):
    with serve(FakeEngine(), tok_dir) as url:
        msgs = [{"role": "system", "content": "a dog"}, {"role": "user", "content": [{"type": "text", "text": "hello"}]}]
        req = {"model": MODEL, "messages": msgs, "max_tokens": 6, "temperature": 0}
        r = httpx.post(f"{url}/v1/chat/completions", json=req)
        assert r.status_code == 200, r.text
        body = r.json()
        prompt = tok.chat([{"role": "system", "content": "a dog"}, {"role": "user", "content": "hello"}])
        assert prompt[0] == 1  # the template's bos_token
        assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
        msg = body["choices"][0]["message"]
        assert msg == {"role": "assistant", "content": _expected(tok, prompt, 6)}
        assert body["usage"]["prompt_tokens"] == len(prompt) and body["choices"][0]["finish_reason"] == "length"
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=req | {"stream": True}) as s:
            events = sse_events(s)
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == msg["content"]
        assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
        # max_completion_tokens (the newer name) works too
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": msgs, "max_completion_tokens": 2})
        assert r.json()["usage"]["completion_tokens"] == 2


def test_stop_string_cuts_the_text_and_aborts(tok_dir, tok):
    engine = FakeEngine()
    ids = tok.encode("hello world")
    words = _expected(tok, ids, 12).split(" ")
    stop = " " + words[5]
    expected = " ".join(words)[:" ".join(words).find(stop)]
    with serve(engine, tok_dir) as url:
        req = {"prompt": "hello world", "max_tokens": 12, "stop": [stop, "zzz"]}
        r = httpx.post(f"{url}/v1/completions", json=req).json()
        assert r["choices"][0]["text"] == expected and not r["choices"][0]["text"].endswith(stop)
        assert r["choices"][0]["finish_reason"] == "stop"
        assert r["usage"]["completion_tokens"] == expected.count(" ") + 2  # up to the token completing the stop
        assert len(engine.aborted) == 1  # the engine request was cut short
        with httpx.stream("POST", f"{url}/v1/completions", json=req | {"stream": True}) as s:
            chunks = sse_events(s)[:-1]
        assert "".join(c["choices"][0]["text"] for c in chunks) == expected
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        # a stop string as a plain string
        r = httpx.post(f"{url}/v1/completions", json=req | {"stop": stop}).json()
        assert r["choices"][0]["text"] == expected


def test_concurrent_requests_each_equal_to_alone(tok_dir):
    engine = FakeEngine(delay=0.003)
    prompts = ["hello", "the cat sat on", "a dog", "world world", "t40 t41", "mat"]
    with serve(engine, tok_dir) as url:
        alone = [httpx.post(f"{url}/v1/completions", json={"prompt": p, "max_tokens": 8 + i}).json()["choices"][0]["text"]
                 for i, p in enumerate(prompts)]

        async def together():
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                return await asyncio.gather(*(completion_text(client, {"prompt": p, "max_tokens": 8 + i}, stream=i % 2)
                                              for i, p in enumerate(prompts)))

        engine.max_batch = 0
        assert asyncio.run(together()) == alone
        assert engine.max_batch > 1  # they really ran together


def test_client_disconnect_aborts_the_request(tok_dir):
    engine = FakeEngine(delay=0.02)
    with serve(engine, tok_dir) as url:
        with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 200,
                                                                 "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
        deadline = time.monotonic() + 5
        while not engine.aborted and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(engine.aborted) == 1
        assert httpx.get(f"{url}/health").json()["pending_requests"] == 0


@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/completions", {"prompt": "hello", "n": 0}, "n", ">= 1"),
    ("/v1/completions", {"prompt": "hello", "n": 2}, "n", "add_group"),
    ("/v1/completions", {"prompt": "hello", "max_tokens": 0}, "max_tokens", ">= 1"),
    ("/v1/completions", {"prompt": "hello", "max_tokens": "8"}, "max_tokens", "integer"),
    ("/v1/completions", {"prompt": "hello", "max_tokens": 300}, "max_tokens", "at most 255"),
    ("/v1/completions", {"max_tokens": 3}, "prompt", "required"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt", "batched"),
    ("/v1/completions", {"prompt": [1, 500]}, "prompt", "< 144"),
    ("/v1/completions", {"prompt": "t9 " * 300}, "prompt", "at most 255"),
    ("/v1/completions", {"prompt": "hello", "echo": True}, "echo", "not supported"),
    ("/v1/completions", {"prompt": "hello", "logprobs": 21}, "logprobs", "<= 20"),
    ("/v1/completions", {"prompt": "hello", "logprobs": True}, "logprobs", "integer"),
    ("/v1/completions", {"prompt": "hello", "temperature": 3}, "temperature", "<= 2"),
    ("/v1/completions", {"prompt": "hello", "top_p": 0}, "top_p", "> 0"),
    ("/v1/completions", {"prompt": "hello", "stop": 3}, "stop", "string"),
    ("/v1/completions", {"prompt": "hello", "stream": "yes"}, "stream", "true or false"),
    ("/v1/completions", {"prompt": "hello", "seed": -1}, "seed", ">= 0"),
    ("/v1/completions", {"prompt": "hello", "presence_penalty": 2.5}, "presence_penalty", "<= 2"),
    ("/v1/completions", {"prompt": "hello", "frequency_penalty": "1"}, "frequency_penalty", "number"),
    ("/v1/completions", {"prompt": "hello", "repetition_penalty": 0}, "repetition_penalty", "> 0"),
    ("/v1/completions", {"prompt": "hello", "min_p": 1.5}, "min_p", "<= 1"),
    ("/v1/completions", {"prompt": "hello", "logit_bias": {"x": 1}}, "logit_bias", "token ids"),
    ("/v1/completions", {"prompt": "hello", "logit_bias": {"3": 101}}, "logit_bias", "[-100, 100]"),
    ("/v1/completions", {"prompt": "hello", "logit_bias": {"144": 1}}, "logit_bias", "< 144"),
    ("/v1/completions", {"prompt": "hello", "logit_bias": [1]}, "logit_bias", "object"),
    ("/v1/completions", {"prompt": "hello", "stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ("/v1/chat/completions", {"model": MODEL}, "messages", "required"),
    ("/v1/chat/completions", {"messages": []}, "messages", "non-empty"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages", "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 129}, "n", "<= 128"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs",
     "logprobs: true"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs", "<= 20"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     "tools", "expected {\"type\": \"function\""),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "does not take tools"),
])
def test_bad_requests_name_the_field(shared_url, path, body, param, words):
    r = httpx.post(shared_url + path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert err["message"].startswith(param) and words in err["message"], err["message"]


def test_bad_json_wrong_model_no_chat_template_engine_failure(tok_dir, tmp_path):
    with serve(FakeEngine(), tok_dir) as url:
        r = httpx.post(f"{url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/completions", json={"model": "gpt-4", "prompt": "x"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model" and MODEL in r.json()["error"]["message"]
    plain = write_tokenizer(tmp_path / "plain", chat_template=None)
    with serve(FakeEngine(), plain) as url:
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert "no chat template" in r.json()["error"]["message"]
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "hello"}).status_code == 200
    with serve(FakeEngine(fail=True), tok_dir) as url:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hello"})
        assert r.status_code == 500 and "fake engine failure" in r.json()["error"]["message"]


def test_engine_failure_mid_stream_is_an_error_event(tok_dir):
    engine = FakeEngine(fail_after=3)
    with serve(engine, tok_dir) as url:
        with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 20,
                                                                 "stream": True}) as r:
            events = sse_events(r)
        assert events[-1] == "[DONE]" and "fake engine failure" in events[-2]["error"]["message"]
        assert [e["choices"][0]["text"] for e in events[:-2]] != []
        assert engine.aborted and httpx.get(f"{url}/health").json()["pending_requests"] == 0


# -- the incremental detokenizer ---------------------------------------------------------------------------------

def _chars(ids):
    return "".join(chr(i) for i in ids)


def test_textstream_holds_back_partial_stop_matches():
    ts = TextStream(_chars, ["xyz"])
    assert ts.push([ord("a"), ord("b")]) == "ab"
    assert ts.push([ord("x")]) == ""  # could be the start of "xyz"
    assert ts.push([ord("y")]) == ""
    assert ts.push([ord("q")]) == "xyq"  # it was not
    assert ts.push([ord("x"), ord("y"), ord("z"), ord("w")]) == ""
    assert ts.stopped and ts.text == "abxyq" and ts.num_tokens == 8
    assert ts.finish() == ""
    ts = TextStream(_chars, ["xyz"])
    assert ts.push([ord("a"), ord("x")]) == "a"
    assert ts.finish() == "x" and not ts.stopped  # the generation ended on a partial match: released


def test_textstream_stop_inside_one_piece_and_over_pieces():
    ts = TextStream(_chars, ["bc", "zz"])
    assert ts.push([ord(c) for c in "abcd"]) == "a" and ts.stopped
    words = {1: "hello", 2: " wor", 3: "ld", 4: "!"}
    ts = TextStream(lambda ids: "".join(words[i] for i in ids), ["world"])
    assert ts.push([1]) == "hello" and ts.push([2]) == " " and ts.push([3]) == "" and ts.stopped
    assert ts.text == "hello "


def test_textstream_waits_for_complete_characters():
    ts = TextStream(lambda ids: bytes(ids).decode("utf-8", errors="replace"))
    data = "é€x".encode()
    out = [ts.push([b]) for b in data]
    assert out == ["", "é", "", "", "€", "x"]
    ts = TextStream(lambda ids: bytes(ids).decode("utf-8", errors="replace"))
    assert ts.push(list("a€".encode())[:2]) == "a" and ts.finish() == "\ufffd"


# -- the paged-serve command's errors: one line on stderr, exit status 2 ----------------------------------------

def _one_line_error(capsys, argv, *words):
    from pagedkit.apps.serve.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("paged-serve: error: "), err
    for w in words:
        assert w in err, err


def test_cli_folder_without_tokenizer(capsys, tmp_path):
    _one_line_error(capsys, [str(tmp_path)], str(tmp_path / "tokenizer.json"), "no such file")


def test_cli_bad_arguments(capsys, tmp_path, tok_dir):
    _one_line_error(capsys, [str(tmp_path / "nope")], "not a folder")
    _one_line_error(capsys, [str(tok_dir), "--port", "70000"], "--port", "0..65535")
    _one_line_error(capsys, [str(tok_dir), "--max-batch-size", "0"], "--max-batch-size", ">= 1")
    _one_line_error(capsys, [str(tok_dir), "--max-body-bytes", "0"], "--max-body-bytes", ">= 1")
    _one_line_error(capsys, [str(tok_dir), "--header-timeout", "-1"], "--header-timeout", ">= 0")
    _one_line_error(capsys, [str(tok_dir), "--request-timeout", "nan"], "--request-timeout", ">= 0")
    _one_line_error(capsys, [str(tok_dir), "--kv-memory-fraction", "1.5"], "--kv-memory-fraction", "(0, 1]")
    _one_line_error(capsys, [str(tok_dir)], "genai_config.json")  # a tokenizer but no model: the engine's error
    with pytest.raises(SystemExit) as exc:  # argparse's own usage error
        from pagedkit.apps.serve.cli import main

        main([str(tok_dir), "--port", "x"])
    assert exc.value.code == 2


def test_cli_missing_serve_package_names_the_extra(capsys, monkeypatch, tok_dir):
    monkeypatch.setitem(sys.modules, "starlette", None)  # import starlette -> ModuleNotFoundError
    _one_line_error(capsys, [str(tok_dir)], "'starlette'", 'pip install "pagedkit[serve]"')


def test_cli_port_in_use_or_unknown_host(capsys, tok_dir):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        _one_line_error(capsys, [str(tok_dir), "--port", port], "--port " + port, "cannot listen")
    _one_line_error(capsys, [str(tok_dir), "--host", "no-such-host.invalid"], "--host no-such-host.invalid",
                    "cannot listen")
