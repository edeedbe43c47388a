"""paged-serve's `/metrics`: Prometheus text format through prometheus_client, one registry per app.

Observed by the engine's worker thread (worker.py), per engine request (a request of n choices is n engine
requests sharing one prompt):
    paged_serve_time_to_first_token_seconds      histogram: arrival of the HTTP request -> its first token
    paged_serve_inter_token_latency_seconds      histogram: between two tokens of a request (a step that
                                                 gives k tokens at once: k observations of gap / k)
    paged_serve_e2e_request_latency_seconds      histogram: arrival -> the request's end (any reason)
    paged_serve_prompt_tokens_total              counter: prompt tokens submitted (a group's prompt once)
    paged_serve_generation_tokens_total          counter: tokens the engine generated and handed over
    paged_serve_requests_finished_total{finish_reason}  counter: stop / length / abort (a client gone, the
                                                 engine's refusal); a stop string or deadline the server
                                                 applies counts as the client sees it (stop, length)
Snapshots the worker takes after each engine step (a collector reads them, never the engine itself):
    paged_serve_requests_running / paged_serve_requests_waiting   gauges: the engine's running / queued requests
    paged_serve_kv_cache_blocks{group} / paged_serve_kv_cache_used_blocks{group}   gauges
    paged_serve_kv_cache_usage_ratio             gauge: used / total blocks of the full-attention pool
    paged_serve_prefix_cache_queries_total / paged_serve_prefix_cache_hits_total   counters: prompt tokens looked up
                                                 in the prefix cache at admissions / found there
    paged_serve_preemptions_total                counter
And from the server itself:
    paged_serve_requests_in_progress             gauge: HTTP requests past the queue check, not finished
    paged_serve_queue_depth                      gauge: of those, the ones not running in the engine
                                                 (parsing, tokenizing, queued): what --max-queue-len bounds
An engine without these attributes (a fake one) reports 0.
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "paged_serve_"
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 10.0, 20.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0)


def engine_snapshot(engine) -> dict:
    """The engine's gauges and cumulative counters now (called on the engine's thread, between steps)."""
    stats = getattr(engine, "stats", None)
    snap = {"running": len(getattr(engine, "running", ())), "waiting": len(getattr(engine, "waiting", ())),
            "blocks": {}, "used": {},
            "prefix_queries": getattr(stats, "prefix_query_tokens", 0), "prefix_hits": getattr(stats, "prefix_hit_tokens", 0),
            "preemptions": getattr(stats, "preemptions", 0)}
    if hasattr(engine, "num_blocks") and hasattr(engine, "num_free_blocks"):
        total, free = engine.num_blocks(), engine.num_free_blocks()
        snap["blocks"] = dict(total)
        snap["used"] = {g: total[g] - free.get(g, total[g]) for g in total}
    return snap


class _Snapshot:
    """A prometheus_client collector of the worker's latest engine snapshot and the server's counts."""

    def __init__(self, metrics: "ServeMetrics"):
        self.m = metrics

    def collect(self):
        snap, srv = self.m.snapshot, self.m.srv
        yield GaugeMetricFamily(PREFIX + "requests_running", "Requests running in the engine", snap["running"])
        yield GaugeMetricFamily(PREFIX + "requests_waiting", "Requests queued in the engine", snap["waiting"])
        active = getattr(srv, "active", 0)
        yield GaugeMetricFamily(PREFIX + "requests_in_progress", "HTTP requests past the queue check, not finished",
                                active)
        yield GaugeMetricFamily(PREFIX + "queue_depth", "HTTP requests in progress not running in the engine",
                                max(0, active - snap["running"]))
        blocks = GaugeMetricFamily(PREFIX + "kv_cache_blocks", "KV cache blocks of the pool", labels=["group"])
        used = GaugeMetricFamily(PREFIX + "kv_cache_used_blocks", "KV cache blocks in use (not free or evictable)",
                                 labels=["group"])
        for g, n in snap["blocks"].items():
            blocks.add_metric([g], n)
            used.add_metric([g], snap["used"][g])
        yield blocks
        yield used
        g = "full" if "full" in snap["blocks"] else next(iter(snap["blocks"]), None)
        ratio = snap["used"][g] / snap["blocks"][g] if g is not None and snap["blocks"][g] else 0.0
        yield GaugeMetricFamily(PREFIX + "kv_cache_usage_ratio", "Used / total blocks of the full-attention pool",
                                ratio)
        yield CounterMetricFamily(PREFIX + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                  snap["prefix_queries"])
        yield CounterMetricFamily(PREFIX + "prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                  snap["prefix_hits"])
        yield CounterMetricFamily(PREFIX + "preemptions", "Requests preempted (recomputed later)", snap["preemptions"])


class ServeMetrics:
    """One app's metrics. `submitted` / `observe` / `after_step` run on the worker thread; `ended` on the event
    loop (the finish reason the client sees for a request the server ended: a stop string, a deadline)."""

    def __init__(self, srv=None):
        self.srv = srv
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Arrival -> first token", buckets=TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between two tokens of a request",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival -> end of the request",
                             buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens submitted", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter(PREFIX + "requests_finished", "Requests ended, by finish reason", ["finish_reason"],
                                registry=r)
        self.snapshot = engine_snapshot(getattr(srv, "engine", None))
        r.register(_Snapshot(self))
        self._lock = threading.Lock()
        self._live: dict[str, list] = {}  # request id -> [arrival, time of the last token or None]
        self._ended: dict[str, str] = {}  # request id -> the finish reason the server gave it

    def submitted(self, request_ids: list[str], prompt_len: int, arrival: float | None) -> None:
        arrival = time.monotonic() if arrival is None else arrival
        with self._lock:
            for rid in request_ids:
                self._live[rid] = [arrival, None]
        self.prompt_tokens.inc(prompt_len)

    def ended(self, request_id: str, reason: str) -> None:
        with self._lock:
            if request_id in self._live:
                self._ended[request_id] = reason

    def observe(self, outputs, now: float | None = None, forget=()) -> None:
        """A step's outputs (at `now`); `forget`: request ids the engine refused at submission."""
        now = time.monotonic() if now is None else now
        with self._lock:
            for rid in forget:
                self._live.pop(rid, None)
        for out in outputs:
            with self._lock:
                state = self._live.get(out.request_id)
                if state is None:
                    continue
                if out.finished:
                    del self._live[out.request_id]
                    reason = self._ended.pop(out.request_id, out.finish_reason)
            k = len(out.new_token_ids)
            if k:
                self.generation_tokens.inc(k)
                if state[1] is None:
                    self.ttft.observe(now - state[0])
                else:
                    for _ in range(k):
                        self.itl.observe((now - state[1]) / k)
                state[1] = now
            if out.finished:
                self.e2e.observe(now - state[0])
                self.finished.labels(reason or "abort").inc()

    def after_step(self, engine) -> None:
        self.snapshot = engine_snapshot(engine)

    def render(self) -> bytes:
        return generate_latest(self.registry)
