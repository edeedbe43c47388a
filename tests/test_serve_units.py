"""paged-serve's pieces called directly (no HTTP server): fast unit checks of behaviour the end-to-end tests reach
only on their happy paths.

- cli._listen_problem agrees with asyncio's own bind (an IPv6 socket is v6-only): "::" on a port an IPv4 socket
  holds is free for uvicorn, a port an IPv6 socket holds is not;
- generation.Server.parse: a typical body is parsed on the event loop, a body above PARSE_IN_THREAD_BYTES (and
  only above) in the pool; Server.params: choice i of a seeded request draws with seed + i, wrapped into
  [0, SEED_MAX];
- metrics.ServeMetrics with a known clock: time to first token from the arrival given (or the submission time),
  k inter-token observations of gap / k for a step of k tokens, end-to-end latency, finish reasons (the
  server's own, else the engine's);
- protocol: Sampling's defaults are what a request without the fields gets; logit_bias's range [-100, 100] at its
  edges, with the error naming the key; error messages echoing a huge value are cut at 300 characters (400 for
  response_format's) and still start with the field;
- tools.parse_tools: a tool whose type is not "function" is refused;
- worker.EngineWorker: an exception (a plain Exception) from engine.has_unfinished() or engine.step() fails every
  pending request once, even when engine.abort raises as well; /health's failure is set and submit refuses.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
import types

import pytest

from pagedkit.apps.serve import generation, metrics as metrics_mod, protocol as P
from pagedkit.apps.serve.cli import _listen_problem
from pagedkit.apps.serve.limits import parse_body
from pagedkit.apps.serve.structured import parse_response_format
from pagedkit.apps.serve.tools import history_fields, parse_tools
from pagedkit.apps.serve.worker import EngineDown, EngineWorker
from pagedkit.engine.params import RequestOutput


# -- cli: the listen check -------------------------------------------------------------------------------------------

def _ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


async def _asyncio_can_listen(host: str, port: int) -> bool:
    try:
        server = await asyncio.start_server(lambda r, w: None, host, port)
    except OSError:
        return False
    server.close()
    await server.wait_closed()
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 on this machine")
def test_listen_problem_agrees_with_asyncio_on_ipv6_only_sockets():
    with socket.socket() as v4:  # an IPv4 listener: a v6-only bind of "::" on its port still works
        v4.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        v4.bind(("127.0.0.1", 0))
        v4.listen()
        port = v4.getsockname()[1]
        assert asyncio.run(_asyncio_can_listen("::", port))  # the oracle: what uvicorn's bind would do
        assert _listen_problem("::", port) is None
    with socket.socket(socket.AF_INET6) as v6:  # an IPv6 listener on "::": that port is taken for "::"
        v6.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        v6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        v6.bind(("::", 0))
        v6.listen()
        port = v6.getsockname()[1]
        assert not asyncio.run(_asyncio_can_listen("::", port))
        problem = _listen_problem("::", port)
        assert problem is not None and problem.startswith(f"--host :: --port {port}: cannot listen there"), problem


# -- generation.Server: parse, params --------------------------------------------------------------------------------

def _parse_where(raw: bytes) -> tuple[object, bool]:
    """Server.parse(raw) on a stub server: (the value, whether it went through the pool)."""
    calls = []

    async def in_thread(fn, *args):
        calls.append(fn)
        return fn(*args)

    stub = types.SimpleNamespace(limits=types.SimpleNamespace(max_json_depth=32), in_thread=in_thread)
    value = asyncio.run(generation.Server.parse(stub, raw))
    assert calls in ([], [parse_body])
    return value, bool(calls)


def _body_of(size: int) -> bytes:
    raw = b'{"prompt": "' + b"x" * (size - 14) + b'"}'
    assert len(raw) == size
    return raw


def test_small_bodies_are_parsed_inline_and_big_ones_in_the_pool():
    assert _parse_where(b'{"prompt": "hello", "max_tokens": 16, "temperature": 0.5}') == (
        {"prompt": "hello", "max_tokens": 16, "temperature": 0.5}, False)
    assert _parse_where(_body_of(4096)) == ({"prompt": "x" * (4096 - 14)}, False)  # a long prompt: still inline
    n = generation.PARSE_IN_THREAD_BYTES
    assert _parse_where(_body_of(n)) == ({"prompt": "x" * (n - 14)}, False)  # "above" the threshold goes to the pool
    assert _parse_where(_body_of(n + 1)) == ({"prompt": "x" * (n + 1 - 14)}, True)
    assert _parse_where(_body_of(4 * n)) == ({"prompt": "x" * (4 * n - 14)}, True)


def _seed_of(seed, index: int):
    stub = types.SimpleNamespace(params_cls=lambda **kw: kw)
    return generation.Server.params(stub, P.Sampling(seed=seed), 8, index)["seed"]


def test_seeded_choices_draw_with_seed_plus_index_wrapped_into_the_seed_range():
    assert [_seed_of(None, i) for i in range(3)] == [None] * 3
    assert [_seed_of(7, i) for i in range(3)] == [7, 8, 9]
    top = P.SEED_MAX  # 2**63 - 1: the largest seed a request may give
    assert [_seed_of(top, i) for i in range(3)] == [top, 0, 1]  # top + i wraps modulo 2**63
    assert [_seed_of(top - 1, i) for i in range(3)] == [top - 1, top, 0]
    assert all(0 <= _seed_of(top - 2, i) <= top for i in range(8))


# -- metrics with a known clock --------------------------------------------------------------------------------------

def _out(rid, k, finished=False, reason=None):
    return RequestOutput(rid, list(range(3, 3 + k)), list(range(3, 3 + k)), finished, reason)


def test_metrics_latencies_with_a_known_clock(monkeypatch):
    monkeypatch.setattr(metrics_mod.time, "monotonic", lambda: 100.0)
    m = metrics_mod.ServeMetrics()
    value = m.registry.get_sample_value
    m.submitted(["a"], 5, None)  # arrival: now (100.0)
    m.submitted(["b0", "b1"], 3, 98.0)  # a group of two choices: its prompt counted once
    assert value("paged_serve_prompt_tokens_total") == 8
    m.observe([_out("a", 1), _out("b0", 1)], now=101.5)
    assert value("paged_serve_time_to_first_token_seconds_count") == 2
    assert value("paged_serve_time_to_first_token_seconds_sum") == pytest.approx(1.5 + 3.5)
    m.observe([_out("a", 2), _out("b1", 1)], now=102.5)  # a: 2 tokens 1 s after its last: 2 x 0.5 s
    assert value("paged_serve_time_to_first_token_seconds_sum") == pytest.approx(1.5 + 3.5 + 4.5)
    assert value("paged_serve_inter_token_latency_seconds_count") == 2
    assert value("paged_serve_inter_token_latency_seconds_sum") == pytest.approx(1.0)
    assert value("paged_serve_inter_token_latency_seconds_bucket", {"le": "0.5"}) == 2
    assert value("paged_serve_inter_token_latency_seconds_bucket", {"le": "0.4"}) == 0
    m.ended("b0", "length")  # the server ended it (a deadline): the client saw "length"
    m.observe([_out("a", 1, True, "stop"), _out("b0", 1, True, "stop"), _out("b1", 0, True, "abort")], now=103.0)
    assert value("paged_serve_inter_token_latency_seconds_count") == 4
    assert value("paged_serve_inter_token_latency_seconds_sum") == pytest.approx(1.0 + 0.5 + 1.5)
    assert value("paged_serve_e2e_request_latency_seconds_count") == 3
    assert value("paged_serve_e2e_request_latency_seconds_sum") == pytest.approx(3.0 + 5.0 + 5.0)
    assert value("paged_serve_generation_tokens_total") == 7
    assert {r: value("paged_serve_requests_finished_total", {"finish_reason": r}) for r in ("stop", "length", "abort")} \
        == {"stop": 1, "length": 1, "abort": 1}
    m.observe([_out("a", 1, True, "stop")], now=104.0)  # a finished request: ignored
    assert value("paged_serve_generation_tokens_total") == 7


# -- protocol --------------------------------------------------------------------------------------------------------

def test_sampling_defaults_are_what_a_request_without_the_fields_gets():
    parsed, default = P.parse_sampling({}), P.Sampling()
    for f in dataclasses.fields(P.Sampling):
        if f.name != "max_time":  # the server's request timeout, filled in by parse_sampling
            assert getattr(parsed, f.name) == getattr(default, f.name), f.name
    assert default.stream is False and parsed.stream is False


@pytest.mark.parametrize("value", [-100, 100, -100.0, 100.0, 0, -99.5, 99.5])
def test_logit_bias_range_edges_accepted(value):
    assert P.parse_sampling({"logit_bias": {"3": value}}).logit_bias == {3: float(value)}


@pytest.mark.parametrize("value", [-100.5, -101, 100.5, 101, -1e9, float("inf"), True, "1", None, [1]])
def test_logit_bias_out_of_range_is_a_400_naming_the_key(value):
    with pytest.raises(P.RequestError) as exc:
        P.parse_sampling({"logit_bias": {"3": value}})
    assert exc.value.param == "logit_bias" and exc.value.status == 400
    assert exc.value.message == f"logit_bias['3']: expected a number in [-100, 100], got {value!r}"


HUGE = "z" * 5000

# (a call that refuses the huge value, the start of its message, the message's cap)
CUT = [
    (lambda: P.parse_sampling({"logit_bias": HUGE}), "logit_bias: expected an object", 300),
    (lambda: P.parse_sampling({"logit_bias": {HUGE: 1}}), "logit_bias: keys should be token ids", 300),
    (lambda: P.parse_sampling({"logit_bias": {"3": HUGE}}), "logit_bias['3']: expected a number", 300),
    (lambda: parse_response_format({"response_format": {"type": "json_schema", "json_schema": HUGE}}),
     "response_format.json_schema: expected an object", 300),
    (lambda: parse_response_format({"response_format": {"type": "json_schema", "json_schema": {"schema": HUGE}}}),
     "response_format.json_schema.schema: expected a JSON schema", 300),
    (lambda: parse_response_format({"response_format": {"type": "regex", "regex": [HUGE]}}),
     "response_format.regex: expected a non-empty string", 300),
    (lambda: parse_response_format({"response_format": {"type": HUGE}}), "response_format: expected", 400),
    (lambda: parse_tools({"tool_choice": HUGE}), "tool_choice: only allowed with tools", 300),
    (lambda: parse_tools({"tools": HUGE}), "tools: expected a list", 300),
    (lambda: parse_tools({"tools": [HUGE]}), "tools[0]: expected", 300),
    (lambda: parse_tools({"tools": [{"type": "function", "function": {"name": HUGE}}]}),
     "tools[0].function.name: expected a unique name", 300),
    (lambda: parse_tools({"tools": [{"type": "function", "function": {"name": "f", "parameters": HUGE}}]}),
     "tools[0].function.parameters: expected a JSON schema", 300),
    (lambda: parse_tools({"tools": [{"type": "function", "function": {"name": "f"}}], "parallel_tool_calls": HUGE}),
     "parallel_tool_calls: expected true or false", 300),
    (lambda: parse_tools({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": HUGE}),
     "tool_choice: expected", 300),
    (lambda: parse_tools({"tools": [{"type": "function", "function": {"name": "f"}}],
                          "tool_choice": {"type": "function", "function": {"name": HUGE}}}), "tool_choice: function", 300),
    (lambda: history_fields({"role": "assistant", "tool_calls": HUGE}, "messages[1]"),
     "messages[1].tool_calls: expected a list", 300),
    (lambda: history_fields({"role": "assistant", "tool_calls": [HUGE]}, "messages[1]"),
     "messages[1].tool_calls[0]: expected", 300),
    (lambda: history_fields({"role": "tool", "tool_call_id": [HUGE]}, "messages[2]"),
     "messages[2].tool_call_id: a tool message needs", 300),
]


@pytest.mark.parametrize("case", range(len(CUT)))
def test_a_huge_bad_value_gives_a_message_cut_at_its_cap_naming_the_field(case):
    call, start, cap = CUT[case]
    with pytest.raises(P.RequestError) as exc:
        call()
    message = exc.value.message
    assert message.startswith(start) and len(message) == cap, (len(message), message[:120])


# -- tools -----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["custom", "code_interpreter", "file_search", "", "Function", None])
def test_a_tool_whose_type_is_not_function_is_refused(kind):
    tool = {"type": kind, "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    with pytest.raises(P.RequestError) as exc:
        parse_tools({"tools": [{"type": "function", "function": {"name": "ok"}}, tool]})
    assert exc.value.param == "tools" and exc.value.message.startswith("tools[1]: expected {\"type\": \"function\"")
    assert parse_tools({"tools": [dict(tool, type="function")]}).tools == [dict(tool, type="function")]


# -- worker: an engine that raises -----------------------------------------------------------------------------------

class _BadEngine:
    """Holds requests until `armed`; then has_unfinished (where="busy") or step (where="step") raises a plain
    Exception, and abort raises too when abort_raises."""

    def __init__(self, where: str, abort_raises: bool = False):
        self.where, self.abort_raises = where, abort_raises
        self.armed = threading.Event()
        self.added, self.aborted = [], []

    def add_request(self, prompt_token_ids, params=None, request_id=None, drafter=None):
        self.added.append(request_id)
        return request_id

    def has_unfinished(self):
        if self.armed.is_set() and self.where == "busy":
            raise Exception("busy check broke")
        return self.armed.is_set()

    def step(self):
        if self.where == "step":
            raise Exception("step broke")
        return []

    def abort(self, request_id):
        self.aborted.append(request_id)
        if self.abort_raises:
            raise Exception("abort broke too")


@pytest.mark.parametrize("where,abort_raises", [("busy", False), ("step", False), ("step", True), ("busy", True)])
def test_an_engine_exception_fails_every_pending_request_once(where, abort_raises):
    engine = _BadEngine(where, abort_raises)
    worker = EngineWorker(engine, idle_wait_s=0.01)

    async def run():
        subs = [worker.submit([1, 4, 5], object()) for _ in range(3)]
        engine.armed.set()
        worker._wake.set()
        got = [await asyncio.wait_for(q.get(), 5) for _, q in subs]
        await asyncio.sleep(0.05)  # nothing more arrives on any queue
        assert all(q.empty() for _, q in subs)
        with pytest.raises(EngineDown, match="restart the server"):
            worker.submit([1], object())
        return [rid for rid, _ in subs], got

    try:
        ids, got = asyncio.run(run())
        worker._thread.join(5)
        assert not worker.running  # the thread ended: a failed engine is not stepped again
    finally:
        worker.stop(1)
    message = "busy check broke" if where == "busy" else "step broke"
    assert all(type(g) is Exception and str(g) == message for g in got), got
    assert type(worker.failure) is Exception and str(worker.failure) == message
    assert sorted(engine.aborted) == sorted(ids) and worker.pending() == 0


def test_the_documented_limit_defaults_are_the_servers():
    """docs/serve.md's limits table (flag | default) against ServeLimits' defaults, through the CLI's flag table;
    and the request-field limits a parser uses by default are the server's (FieldLimits() == ServeLimits().fields)."""
    import re
    from pathlib import Path

    from pagedkit.apps.serve.cli import LIMIT_FLAGS
    from pagedkit.apps.serve.limits import ServeLimits
    from pagedkit.apps.serve.protocol import FieldLimits

    doc = (Path(__file__).resolve().parents[1] / "docs" / "serve.md").read_text()
    rows = dict(re.findall(r"^\| `(--[a-z-]+)` \| ([0-9.]+)", doc, re.M))
    defaults = ServeLimits()
    assert {flag for flag, *_ in LIMIT_FLAGS} <= set(rows), sorted(set(f for f, *_ in LIMIT_FLAGS) - set(rows))
    for flag, field, typ, *_ in LIMIT_FLAGS:
        assert typ(rows[flag]) == getattr(defaults, field), (flag, rows[flag], getattr(defaults, field))
    assert defaults.max_header_bytes == 16 * 1024
    assert FieldLimits() == defaults.fields


def test_structured_keeps_only_eos_ids_inside_the_vocabulary():
    from pagedkit.apps.serve.structured import Structured

    assert Structured(None, 10, [0, 3, 9, 10, -1, 12]).eos == [0, 3, 9]
    assert Structured(None, None, [0, 7, 100000]).eos == [0, 7, 100000]


def test_body_deadline_already_passed_between_chunks_is_a_408_at_once():
    """A body chunk that arrives after the body deadline (the receive blocked past it): the next read gets no time
    at all (max(0, deadline - now)), so the request ends 408 at once instead of waiting on the client again."""
    import time

    from pagedkit.apps.serve.limits import BodyReader, ServeLimits

    calls, sent = [], []

    async def receive():
        calls.append(1)
        if len(calls) == 1:
            time.sleep(0.3)  # blocks the loop past the 0.2 s deadline: wait_for cannot cut it short
            return {"type": "http.request", "body": b"{", "more_body": True}
        await asyncio.sleep(5)  # the client sends nothing more
        return {"type": "http.request", "body": b"}", "more_body": False}

    async def send(message):
        sent.append(message)

    async def app(scope, receive, send):  # pragma: no cover - must not run
        raise AssertionError("the app ran")

    reader = BodyReader(app, ServeLimits(body_timeout_s=0.2))
    scope = {"type": "http", "headers": [], "client": ("127.0.0.1", 1), "method": "POST", "path": "/v1/completions"}
    t0 = time.monotonic()
    asyncio.run(asyncio.wait_for(reader(scope, receive, send), 3))
    assert time.monotonic() - t0 < 1.5
    assert sent and sent[0]["type"] == "http.response.start" and sent[0]["status"] == 408


def test_a_deadline_queued_after_the_final_output_does_not_change_its_finish_reason():
    """The request's last output (finish_reason 'stop') and the deadline's signal drained together: the answer ends
    as the engine finished it ('stop', its text), and the deadline is ignored."""
    ended, aborted = [], []

    async def in_thread(fn, *a):
        return fn(*a)

    srv = types.SimpleNamespace(tok=types.SimpleNamespace(decode=lambda ids: "".join(f"<{i}>" for i in ids)),
                                in_thread=in_thread, metrics=types.SimpleNamespace(ended=lambda *a: ended.append(a)),
                                worker=types.SimpleNamespace(abort=aborted.append))
    gen = generation.Generation(srv, P.Sampling(), 0)
    gen.request_id, gen.queue = "r1", asyncio.Queue()
    last = types.SimpleNamespace(new_token_ids=[5, 6], new_logprobs=None, num_cached_tokens=0, finished=True,
                                 finish_reason="stop")
    gen.queue.put_nowait(last)
    gen.queue.put_nowait(generation.DEADLINE)
    piece = asyncio.run(gen.next())
    assert (piece.text, piece.reason) == ("<5><6>", "stop") and gen.done and aborted == []
