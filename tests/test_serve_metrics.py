"""paged-serve's /metrics (Prometheus text format, parsed with prometheus_client's own parser) against what the
requests and the engine say: the real engine on a tiny exported Llama with a small KV pool (so that concurrent
requests are preempted), concurrent plain / streamed / n = 2 requests through the `openai` client.

- counters: prompt tokens = the prompts' usage (a group's prompt once), generation tokens = every choice's
  completion tokens, one time-to-first-token and one end-to-end observation per engine request, an inter-token
  observation per further token, finished requests by reason, prefix-cache queries / hits and preemptions equal
  to the engine's stats (preemptions > 0);
- gauges while a stream runs: a running request, KV blocks in use, a request in progress; at the end: nothing
  running or queued, no block in use, the pool's size;
- /metrics needs no API key.
Teeth: a worker that does not report outputs, and one that never refreshes the engine snapshot, fail.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedkit.apps.serve import create_app
from pagedkit.apps.serve import metrics as metrics_mod
from pagedkit.apps.serve.tokenizer import load_tokenizer
from pagedkit.engine import Engine
from test_serve_helpers import ServerThread, tiny_served_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_served_model(tmp_path_factory.mktemp("metrics") / "tiny-llama")


def scrape(url: str) -> dict:
    r = httpx.get(f"{url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else "")
            out[key] = s.value
    return out


def run_and_scrape(model_dir):
    engine = Engine(model_dir, max_batch_size=4, max_num_tokens=64, num_blocks=6)  # 96 tokens for 4 x 40
    with ServerThread(create_app(engine, load_tokenizer(model_dir), "tiny", api_key="sk-test")) as url:
        results, requests, m, stats, live = asyncio.run(_requests(url, engine))
    return engine, stats, results, requests, m, live


async def _requests(url, engine):
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-test", max_retries=0)
    prompts = ["hello world", "the cat sat on the mat", "a dog", "t40 t41 t42 t43 t44 t45"]

    async def one(i, p):
        kw = dict(model="tiny", prompt=p, max_tokens=24 + i, temperature=0, extra_body={"ignore_eos": True})
        if i % 3 == 1:
            prompt_len, done = None, 0
            async for c in await client.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
                if c.usage:
                    prompt_len, done = c.usage.prompt_tokens, c.usage.completion_tokens
            return prompt_len, [done]
        r = await client.completions.create(**kw, n=2 if i % 3 == 2 else 1)
        return r.usage.prompt_tokens, [r.usage.completion_tokens // len(r.choices)] * len(r.choices)

    results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts * 2)))
    requests = [k for _, ks in results for k in ks]  # completion tokens of each engine request
    deadline = time.monotonic() + 3
    while True:  # the worker observes a step's outputs right after handing them over
        m = await asyncio.to_thread(scrape, url)
        if m.get("paged_serve_e2e_request_latency_seconds_count") == len(requests) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    stats = dataclasses.replace(engine.stats)  # the engine is idle: its stats when `m` was scraped
    stream = await client.completions.create(model="tiny", prompt="hello", max_tokens=90, stream=True,
                                             temperature=0, extra_body={"ignore_eos": True})
    seen, live = 0, None
    async for _ in stream:
        seen += 1
        if seen == 20:
            live = await asyncio.to_thread(scrape, url)
            break
    await stream.close()
    await client.close()
    return results, requests, m, stats, live


def check_metrics(model_dir):
    engine, stats, results, requests, m, live = run_and_scrape(model_dir)
    assert m["paged_serve_prompt_tokens_total"] == sum(p for p, _ in results)
    assert m["paged_serve_generation_tokens_total"] == sum(requests), "generation tokens"
    assert m["paged_serve_time_to_first_token_seconds_count"] == len(requests) == 10, "time to first token"
    assert m["paged_serve_e2e_request_latency_seconds_count"] == len(requests), "end-to-end"
    assert m["paged_serve_inter_token_latency_seconds_count"] == sum(k - 1 for k in requests), "inter-token"
    assert m["paged_serve_requests_finished_total{finish_reason=length}"] == len(requests)
    assert 0 < m["paged_serve_time_to_first_token_seconds_sum"] < m["paged_serve_e2e_request_latency_seconds_sum"]
    assert m["paged_serve_preemptions_total"] == stats.preemptions > 0, "preemptions"
    assert m["paged_serve_prefix_cache_hits_total"] == stats.prefix_hit_tokens
    assert m["paged_serve_prefix_cache_queries_total"] == stats.prefix_query_tokens > 0
    assert m["paged_serve_kv_cache_blocks{group=full}"] == 6 and m["paged_serve_kv_cache_used_blocks{group=full}"] == 0
    for name in ("requests_running", "requests_waiting", "requests_in_progress", "queue_depth", "kv_cache_usage_ratio"):
        assert m[f"paged_serve_{name}"] == 0, name
    assert live["paged_serve_requests_running"] == 1 and live["paged_serve_requests_in_progress"] == 1, "running"
    assert live["paged_serve_kv_cache_used_blocks{group=full}"] >= 2 and live["paged_serve_kv_cache_usage_ratio"] > 0
    assert engine.num_free_blocks() == engine.num_blocks()


def test_metrics_count_what_the_requests_and_the_engine_did(model_dir):
    check_metrics(model_dir)


def test_teeth_outputs_not_observed(model_dir, monkeypatch):
    monkeypatch.setattr(metrics_mod.ServeMetrics, "observe", lambda self, outputs, now=None, forget=(): None)
    with pytest.raises(AssertionError, match="generation tokens"):
        check_metrics(model_dir)


def test_teeth_stale_engine_snapshot(model_dir, monkeypatch):
    monkeypatch.setattr(metrics_mod.ServeMetrics, "after_step", lambda self, engine: None)
    with pytest.raises(AssertionError, match="preemptions|running"):
        check_metrics(model_dir)


def test_metrics_without_an_api_key_and_over_a_fake_engine(tmp_path):
    from test_serve_helpers import FakeEngine, write_tokenizer

    tok = write_tokenizer(tmp_path)
    with ServerThread(create_app(FakeEngine(), load_tokenizer(tok), "fake", api_key="sk-x")) as url:
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "hello"}).status_code == 401
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 3},
                       headers={"Authorization": "Bearer sk-x"})
        assert r.status_code == 200
        m = scrape(url)
        assert m["paged_serve_generation_tokens_total"] == 3 and m["paged_serve_requests_running"] == 0
        assert "paged_serve_kv_cache_usage_ratio" in m
