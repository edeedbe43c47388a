"""paged-serve over the REAL engine (pagedkit.engine.Engine) on a tiny exported Llama (vocab 144)
with a word-level tokenizer in its folder: a real uvicorn server called with httpx. The streamed text equals
the non-streamed text of the same greedy request; concurrent requests (continuous batching) each equal the
same request run alone; stop strings; seeded sampling; and `paged-serve MODEL_DIR` as a subprocess."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from pagedkit.engine import Engine
from pagedkit.apps.serve import create_app
from pagedkit.apps.serve.tokenizer import load_tokenizer
from test_serve_helpers import ServeCommand, ServerThread, completion_text, sse_events, tiny_served_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_served_model(tmp_path_factory.mktemp("serve") / "tiny-llama")


@pytest.fixture(scope="module")
def engine(model_dir):
    return Engine(model_dir, max_batch_size=8, max_num_tokens=128)


@pytest.fixture(scope="module")
def url(model_dir, engine):
    with ServerThread(create_app(engine, load_tokenizer(model_dir), model_dir.name)) as base:
        yield base


def _text(events) -> str:
    out = ""
    for e in events[:-1]:
        for c in e["choices"]:
            out += c["text"] if "text" in c else c["delta"].get("content", "")
    return out


def test_models(url):
    assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["tiny-llama"]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hello world the cat", "max_tokens": 16}),
    ("/v1/completions", {"prompt": [1, 9, 10, 11, 12, 13, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], "max_tokens": 20}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello cat"}], "max_tokens": 14}),
])
def test_streamed_text_equals_non_streamed(url, engine, monkeypatch, path, body):
    req = body | {"model": "tiny-llama", "temperature": 0, "ignore_eos": True}
    # the server sends what has arrived since its last send as one chunk: a step of this tiny model takes about a
    # millisecond, so spread the tokens out (5 ms a step) for the stream to show them one by one
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: (step(), time.sleep(0.005))[0])
    full = httpx.post(url + path, json=req, timeout=60)
    assert full.status_code == 200, full.text
    full = full.json()
    assert full["usage"]["completion_tokens"] == req["max_tokens"] and full["choices"][0]["finish_reason"] == "length"
    text = full["choices"][0]["text" if "text" in full["choices"][0] else "message"]
    text = text if isinstance(text, str) else text["content"]
    assert text.strip()  # the tiny model says something
    with httpx.stream("POST", url + path, json=req | {"stream": True}, timeout=60) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]" and len(events) > 4
    assert _text(events) == text
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_concurrent_requests_equal_alone(url, engine):
    prompts = ["hello", "the cat sat on the mat", "a dog", "world hello world", "t40 t41 t42", "mat mat",
               "system user", "t100 t101 t102 t103 t104 t105 t106 t107 t108 t109"]
    reqs = [{"prompt": p, "max_tokens": 10 + 2 * i, "temperature": 0, "ignore_eos": True} for i, p in enumerate(prompts)]
    alone = [httpx.post(f"{url}/v1/completions", json=r, timeout=60).json()["choices"][0]["text"] for r in reqs]

    async def together():
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await asyncio.gather(*(completion_text(client, r, stream=i % 2) for i, r in enumerate(reqs)))

    engine.stats.max_batch = 0
    assert asyncio.run(together()) == alone
    assert engine.stats.max_batch > 1  # they were batched together


def test_overlapped_engine_serves_the_same_text(model_dir, url):
    """paged-serve over an engine whose decode steps run one step ahead of the host (overlap, as on CUDA; here
    over the graphs' padded plans): concurrent streamed and plain completions, and a stop string, give the
    synchronous engine's text."""
    lookahead = Engine(model_dir, max_batch_size=8, max_num_tokens=128, cuda_graphs="padded", overlap=True)
    prompts = ["hello", "the cat sat on the mat", "a dog", "world hello world"]
    reqs = [{"prompt": p, "max_tokens": 9 + 3 * i, "temperature": 0, "ignore_eos": True} for i, p in enumerate(prompts)]
    stop_req = {"prompt": "the cat sat", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    ref = [httpx.post(f"{url}/v1/completions", json=r, timeout=60).json()["choices"][0]["text"] for r in reqs]
    full = httpx.post(f"{url}/v1/completions", json=stop_req, timeout=60).json()["choices"][0]["text"]
    stop = full.split()[len(full.split()) // 2]
    with ServerThread(create_app(lookahead, load_tokenizer(model_dir), model_dir.name)) as base:

        async def together():
            async with httpx.AsyncClient(base_url=base, timeout=60) as client:
                return await asyncio.gather(*(completion_text(client, r, stream=i % 2) for i, r in enumerate(reqs)))

        assert asyncio.run(together()) == ref
        got = httpx.post(f"{base}/v1/completions", json=stop_req | {"stop": [stop]}, timeout=60).json()["choices"][0]
        assert got["text"] == full[:full.find(stop)] and got["finish_reason"] == "stop"
    assert lookahead.stats.overlapped_steps > 0 and lookahead.check_invariants() == []


def test_stop_string(url):
    req = {"prompt": "the cat sat", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    full = httpx.post(f"{url}/v1/completions", json=req, timeout=60).json()["choices"][0]["text"]
    words = full.split()
    stop = words[len(words) // 2]
    expected = full[:full.find(stop)]
    for stream in (False, True):
        if stream:
            with httpx.stream("POST", f"{url}/v1/completions", json=req | {"stop": [stop], "stream": True}) as r:
                events = sse_events(r)
            text, reason = _text(events), events[-2]["choices"][0]["finish_reason"]
        else:
            got = httpx.post(f"{url}/v1/completions", json=req | {"stop": [stop]}, timeout=60).json()["choices"][0]
            text, reason = got["text"], got["finish_reason"]
        assert text == expected and reason == "stop" and stop not in text
    assert httpx.get(f"{url}/health").json()["pending_requests"] == 0


def test_seeded_sampling_repeats(url):
    req = {"prompt": "hello world", "max_tokens": 12, "temperature": 1.0, "top_p": 0.9, "top_k": 50, "seed": 7,
           "ignore_eos": True}
    a, b = (httpx.post(f"{url}/v1/completions", json=req, timeout=60).json()["choices"][0]["text"] for _ in range(2))
    assert a == b


def test_bad_request_against_the_real_engine(url):
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 1000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "at most 255" in r.json()["error"]["message"]


def test_paged_serve_command_serves_the_folder(model_dir):
    with ServeCommand(model_dir, "--max-batch-size", "4", "--log-level", "warning") as url:
        base = f"{url}/v1"
        assert httpx.get(f"{base}/models").json()["data"][0]["id"] == "tiny-llama"
        r = httpx.post(f"{base}/chat/completions", json={"model": "tiny-llama", "max_tokens": 5, "temperature": 0,
                                                         "messages": [{"role": "user", "content": "hello"}]})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"


def test_a_small_kv_pool_serves_chat_without_max_tokens(model_dir):
    """--num-blocks 4 (64 tokens of cache for a 256-token context): a chat request without max_tokens generates what
    the pool can hold instead of failing (it was a 500 the openai client retried), and a prompt the pool can never
    hold is a 400 naming both numbers; the pool is whole afterwards."""
    small = Engine(model_dir, max_batch_size=2, max_num_tokens=64, num_blocks=4)
    with ServerThread(create_app(small, load_tokenizer(model_dir), model_dir.name)) as base:
        r = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hello cat"}], "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["completion_tokens"] == 64 + 1 - usage["prompt_tokens"] and usage["total_tokens"] == 65
        assert r.json()["choices"][0]["finish_reason"] == "length"
        r = httpx.post(f"{base}/v1/completions", json={"prompt": [5] * 70, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert "70 tokens" in r.json()["error"]["message"] and "at most 64 tokens" in r.json()["error"]["message"]
    assert small.num_free_blocks() == small.num_blocks() and small.check_invariants() == []
    assert small.max_pool_tokens == 64
