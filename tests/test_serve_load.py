"""A load test of paged-serve over the REAL engine (tiny exported Llama): 64 concurrent clients, completions and
chat, plain and streamed, some with n = 2, 10% of them disconnecting midway (streams closed after two chunks,
plain requests timing out). Every completed response is well-formed (OpenAI's fields, one finish reason per
choice, usage adding up, [DONE] last); every disconnected client's engine request ended as "abort" (not run to
its 200 tokens for nobody); afterwards the engine holds nothing, the KV pool is whole and its invariants hold.
Teeth: a server that does not abort a gone client's request, and usage that counts one choice of n, fail.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from pagedkit.apps.serve import create_app
from pagedkit.apps.serve import generation as gen_mod
from pagedkit.apps.serve.tokenizer import load_tokenizer
from pagedkit.engine import Engine
from test_serve_helpers import ServerThread, tiny_served_model
from test_serve_metrics import scrape

CLIENTS = 64
WORDS = ["hello", "world", "the", "cat", "sat", "on", "mat", "a", "dog"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_served_model(tmp_path_factory.mktemp("load") / "tiny-llama")


def request_of(i: int) -> tuple[str, dict, bool, bool]:
    """(path, body, stream, disconnects) of client i: a mix of endpoints, lengths, n, streaming; 10% disconnect."""
    gone = i % 10 == 7
    prompt = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(1 + i % 23))
    body = {"max_tokens": 200 if gone else 4 + (i * 7) % 29, "temperature": (i % 3) * 0.5, "seed": i,
            "ignore_eos": gone or i % 2 == 0}
    if not gone and i % 5 == 0:
        body["n"] = 2
    chat = i % 4 >= 2
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    stream = i % 2 == 1
    if stream and i % 3:
        body["stream_options"] = {"include_usage": True}
    return ("/v1/chat/completions" if chat else "/v1/completions"), body, stream, gone


def check_response(r: dict, body: dict, chat: bool) -> int:
    n = body.get("n", 1)
    assert r["id"].startswith("chatcmpl-" if chat else "cmpl-") and r["object"] == (
        "chat.completion" if chat else "text_completion") and isinstance(r["created"], int)
    assert [c["index"] for c in r["choices"]] == list(range(n))
    for c in r["choices"]:
        text = c["message"]["content"] if chat else c["text"]
        assert isinstance(text, str) and c["finish_reason"] in ("stop", "length")
        if body["ignore_eos"]:
            assert c["finish_reason"] == "length"
    u = r["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] and u["prompt_tokens"] > 0
    if body["ignore_eos"]:
        assert u["completion_tokens"] == n * body["max_tokens"], f"usage {u} for n={n} x {body['max_tokens']}"
    assert u["completion_tokens"] <= n * body["max_tokens"]
    return n


def check_stream(events: list, body: dict, chat: bool) -> int:
    assert events[-1] == "[DONE]", events[-3:]
    chunks = events[:-1]
    n = body.get("n", 1)
    assert len({c["id"] for c in chunks}) == 1
    reasons = {}
    for c in chunks:
        assert c["object"] == ("chat.completion.chunk" if chat else "text_completion")
        for ch in c["choices"]:
            assert 0 <= ch["index"] < n and ch["index"] not in reasons, "a chunk after the choice's finish reason"
            if ch["finish_reason"]:
                reasons[ch["index"]] = ch["finish_reason"]
    assert sorted(reasons) == list(range(n)) and set(reasons.values()) <= {"stop", "length"}
    if body.get("stream_options"):
        usage = chunks[-1]["usage"]
        assert chunks[-1]["choices"] == [] and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        if body["ignore_eos"]:
            assert usage["completion_tokens"] == n * body["max_tokens"], f"usage {usage} for n={n}"
    return n


async def one_client(client: httpx.AsyncClient, i: int) -> tuple[str, int]:
    path, body, stream, gone = request_of(i)
    chat = "chat" in path
    await asyncio.sleep((i % 8) * 0.01)  # arrivals spread a little
    if not stream:
        try:
            r = await client.post(path, json=body, timeout=0.3 if gone else 120)
        except httpx.ReadTimeout:
            assert gone
            return "gone", 1
        assert r.status_code == 200 and not gone, r.text
        return "done", check_response(r.json(), body, chat)
    events, buf = [], ""
    async with client.stream("POST", path, json=body | {"stream": True}, timeout=120) as r:
        assert r.status_code == 200
        async for text in r.aiter_text():
            buf += text
            while "\n\n" in buf:
                event, buf = buf.split("\n\n", 1)
                payload = event[len("data: "):]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
            if gone and len(events) >= 2:
                return "gone", 1  # leaving the block closes the connection midway
    assert not gone
    return "done", check_stream(events, body, chat)


def run_load(model_dir):
    engine = Engine(model_dir, max_batch_size=16, max_num_tokens=256)
    with ServerThread(create_app(engine, load_tokenizer(model_dir), "tiny")) as url:
        async def all_clients():
            async with httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=CLIENTS)) as client:
                return await asyncio.gather(*(one_client(client, i) for i in range(CLIENTS)))

        results = asyncio.run(all_clients())
        gone = sum(n for kind, n in results if kind == "gone")
        assert gone == sum(request_of(i)[3] for i in range(CLIENTS)) == 6
        deadline = time.monotonic() + 120
        while engine.has_unfinished() or httpx.get(f"{url}/health").json()["pending_requests"]:
            assert time.monotonic() < deadline, "the engine did not drain"
            time.sleep(0.02)
        time.sleep(0.1)  # the worker reports the last step's outputs right after handing them over
        m = scrape(url)
    assert m.get("paged_serve_requests_finished_total{finish_reason=abort}", 0) == gone, \
        f"{m.get('paged_serve_requests_finished_total{finish_reason=abort}')} aborted engine requests for {gone} gone " \
        "clients: a gone client's request ran on"
    assert m["paged_serve_requests_in_progress"] == 0 and engine.stats.max_batch == 16
    assert engine.num_free_blocks() == engine.num_blocks() and engine.check_invariants() == []


def test_64_clients_mixed_with_disconnects(model_dir):
    run_load(model_dir)


def test_teeth_gone_clients_not_aborted(model_dir, monkeypatch):
    monkeypatch.setattr(gen_mod.Generation, "close", lambda self: None)
    with pytest.raises(AssertionError, match="ran on"):
        run_load(model_dir)


def test_teeth_usage_of_one_choice(model_dir, monkeypatch):
    real = gen_mod.Server.usage

    def first_only(self, prompt_len, job):
        class One:
            gens = job.gens[:1]
        return real(self, prompt_len, One)

    monkeypatch.setattr(gen_mod.Server, "usage", first_only)
    with pytest.raises(AssertionError, match="usage"):
        run_load(model_dir)
