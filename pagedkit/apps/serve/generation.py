"""One request's generation, from the engine's outputs to text (used by app.py).

`Server` is what the endpoints share: the engine's worker thread, the tokenizer (and what structured output and
tool calls need of it: structured.py, tools.py), a small thread pool where
tokenization, chat templating, detokenization and the parsing of large bodies run (never on the event loop),
the limits, the metrics and the count of requests in progress. `Job` is one HTTP request: its `n` choices
(`Generation`s: one engine request each; n > 1 goes to the engine as one group, `Engine.add_group`, whose
prompt is prefilled once), its deadline and the watch on its client. A Generation reads its request's
RequestOutputs from its asyncio queue, turns tokens into text with a `TextStream` (in the pool) and ends at
a stop string, the engine's finish, the request's deadline (`max_time`, finish_reason "length") or its client
leaving: a task watches the connection (`receive()` returns `http.disconnect`) and puts CLIENT_GONE on every
choice's queue, so an orphaned request is aborted in the engine at its next step, streaming or not.
`Job.pieces()` yields (choice index, Piece) as the choices produce text, whichever comes first.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator

from . import protocol as P
from .limits import ServeLimits, parse_body
from .metrics import ServeMetrics
from .structured import Structured
from .textstream import TextStream
from .tokenizer import as_serve_tokenizer
from .tools import ToolOutput, choose_parser
from .worker import EngineWorker

CLIENT_GONE, DEADLINE = object(), object()  # queue items from the app itself (the engine's are RequestOutputs)
PARSE_IN_THREAD_BYTES = 64 * 1024  # bodies above this are parsed in the pool


class EngineFailure(Exception):
    """engine.step() raised while this request was running (or the engine aborted it midway)."""


class ClientGone(Exception):
    """The request's client disconnected: the request was aborted."""


@dataclass
class Piece:
    """Text a choice released, its finish reason (None while it runs) and, with logprobs, one entry per token
    consumed since the last piece: (token text, logprob, [(text, logprob)] of the top tokens)."""

    text: str
    reason: str | None = None
    logprobs: list | None = None


class Server:
    """What the endpoints share: the engine's worker, the tokenizer, the model's name, limits and metrics."""

    def __init__(self, engine, tokenizer, model_name: str, sampling_params_cls, limits: ServeLimits,
                 tool_call_parser: str | None = None):
        self.engine = engine
        self.limits = limits
        self.active = 0  # requests past the queue check and not finished (parsing, waiting, generating)
        self.metrics = ServeMetrics(self)
        self.worker = EngineWorker(engine, metrics=self.metrics)
        self.tok = as_serve_tokenizer(tokenizer)
        self.model_name = model_name
        self.params_cls = sampling_params_cls
        self.created = int(time.time())
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="paged-serve-text")
        self.pool_tokens = getattr(engine, "max_pool_tokens", None)  # most tokens one request's cache can hold
        self.capacity = getattr(engine, "max_batch_size", 0) + limits.max_queue_len
        self.structured = Structured(self.tok.tok, getattr(engine, "vocab_size", None),
                                     getattr(engine, "eos_token_ids", ()))  # response_format
        self.tool_parser = choose_parser(self.tok.chat_template, tool_call_parser)  # tools.py

    async def in_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def parse(self, raw: bytes):
        if len(raw) > PARSE_IN_THREAD_BYTES:
            return await self.in_thread(parse_body, raw, self.limits.max_json_depth)
        return parse_body(raw, self.limits.max_json_depth)

    def params(self, s: P.Sampling, max_tokens: int, index: int = 0):
        """The engine's SamplingParams of choice `index` (a seeded request's choice i draws with seed + i)."""
        seed = None if s.seed is None else (s.seed + index) % (P.SEED_MAX + 1)
        extra = {"constraint": s.constraint} if s.constraint is not None else {}
        return self.params_cls(max_new_tokens=max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                               seed=seed, stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos,
                               presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                               repetition_penalty=s.repetition_penalty, logit_bias=dict(s.logit_bias) or None,
                               min_p=s.min_p, logprobs=s.logprobs, **extra)

    def usage(self, prompt_len: int, job: "Job") -> dict:
        done = sum(g.text.num_tokens for g in job.gens)
        return {"prompt_tokens": prompt_len, "completion_tokens": done, "total_tokens": prompt_len + done,
                "prompt_tokens_details": {"cached_tokens": job.gens[0].cached_tokens}}


class Generation:
    """One choice: `await next()` -> Piece until its reason is set; `close()` (idempotent) aborts it if it has
    not ended. Job submits it (request_id, queue)."""

    def __init__(self, srv: Server, s: P.Sampling, index: int = 0, tools: ToolOutput | None = None):
        self.srv, self.s, self.index = srv, s, index
        self.tools = tools  # the answer's tool calls (tools.py), None without tools
        keep = tools.keep if tools is not None else frozenset()
        self.text = TextStream((lambda ids: srv.tok.decode_keeping(ids, keep)) if keep else srv.tok.decode, s.stop)
        self.request_id: str | None = None
        self.queue: asyncio.Queue | None = None
        self.done = False
        self.seen_output = False
        self.cached_tokens = 0

    def close(self) -> None:
        if not self.done and self.request_id is not None:
            self.done = True
            self.srv.worker.abort(self.request_id)

    def _end(self, abort: bool, reason: str | None = None) -> None:
        if not abort:
            self.done = True  # the engine finished it (or the worker aborted it): nothing to abort
        if reason is not None and self.request_id is not None:
            self.srv.metrics.ended(self.request_id, reason)
        self.close()

    def _push(self, ids: list[int], lps: list | None) -> tuple[str, list | None]:
        """In the pool: the text released by `ids` and the logprob entries of the tokens it consumed."""
        before = self.text.num_tokens
        piece = self.text.push(ids)
        if self.s.logprobs is None:
            return piece, None
        text = self.srv.tok.token_text
        entries = []
        for tok, lp in zip(ids[:self.text.num_tokens - before], lps or []):
            if lp is not None:
                entries.append((text(tok), lp[0], [(text(t), v) for t, v in lp[1]]))
        return piece, entries

    async def next(self) -> Piece:
        while True:
            items = [await self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            ids, lps, last, signal = [], [], None, None
            for item in items:
                if item is CLIENT_GONE or item is DEADLINE or isinstance(item, BaseException):
                    signal = item
                    break
                ids.extend(item.new_token_ids)
                new_lps = getattr(item, "new_logprobs", None)
                lps.extend(new_lps if new_lps is not None else [None] * len(item.new_token_ids))
                self.cached_tokens = max(self.cached_tokens, getattr(item, "num_cached_tokens", 0) or 0)
                if item.finished:
                    last = item
                    break
            piece, entries = await self.srv.in_thread(self._push, ids, lps) if ids else ("", None)
            if self.s.logprobs is not None and entries is None:
                entries = []
            if self.text.stopped:
                self._end(abort=True, reason="stop")
                return Piece(piece, "stop", entries)
            if signal is CLIENT_GONE:
                self._end(abort=True)
                raise ClientGone()
            if signal is DEADLINE:
                self._end(abort=True, reason="length")
                return Piece(piece + await self.srv.in_thread(self.text.finish), "length", entries)
            if signal is not None:  # the worker failed every request (and aborted them)
                self._end(abort=False)
                raise EngineFailure(f"the engine failed: {type(signal).__name__}: {signal}")
            first, self.seen_output = not self.seen_output, True
            if last is not None and last.finish_reason == "abort":  # not ours: we dropped our aborted ids
                self._end(abort=False)
                why = getattr(last, "reason", None) or "no reason given"
                if first:  # e.g. a request the KV cache can never hold: the engine refused it
                    raise P.RequestError(f"the engine refused the request: {why}")
                raise EngineFailure(f"the engine aborted the request: {why}")
            if last is not None:
                self._end(abort=False)
                piece += await self.srv.in_thread(self.text.finish)
                return Piece(piece, "length" if last.finish_reason == "length" else "stop", entries)
            if piece or entries:
                return Piece(piece, None, entries)


class Job:
    """One request's choices: `start()` submits them (ValueError when the engine refuses, worker.EngineDown
    after a failure); `pieces()` yields (index, Piece); `close()` aborts what has not ended. `receive`: the
    ASGI receive whose `http.disconnect` aborts every choice (None: not watched; `stop_watching()` ends it)."""

    def __init__(self, srv: Server, prompt_ids: list[int], s: P.Sampling, max_tokens: int, receive=None,
                 arrival: float | None = None, shaping=None):
        """shaping: None, or a factory of one choice's tools.ToolOutput (a chat request with tools)."""
        self.srv, self.prompt_ids, self.s, self.max_tokens, self.receive = srv, prompt_ids, s, max_tokens, receive
        self.arrival = time.monotonic() if arrival is None else arrival
        self.gens = [Generation(srv, s, i, shaping() if shaping is not None else None) for i in range(s.n)]
        self._timer: asyncio.TimerHandle | None = None
        self._watch: asyncio.Task | None = None
        self._tasks: dict[asyncio.Future, int] = {}  # pieces(): each running choice's next()

    def start(self) -> None:
        worker, params = self.srv.worker, [self.srv.params(self.s, self.max_tokens, i) for i in range(self.s.n)]
        if self.s.n == 1:
            submitted = [worker.submit(self.prompt_ids, params[0], arrival=self.arrival)]
        else:
            submitted = worker.submit_group(self.prompt_ids, params, arrival=self.arrival)
        for g, (request_id, queue) in zip(self.gens, submitted):
            g.request_id, g.queue = request_id, queue
        loop = asyncio.get_running_loop()
        if self.s.max_time:
            self._timer = loop.call_later(self.s.max_time, self._signal, DEADLINE)
        if self.receive is not None:
            self._watch = loop.create_task(self._watch_client(self.receive))

    def _signal(self, item) -> None:
        for g in self.gens:
            g.queue.put_nowait(item)

    async def _watch_client(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._signal(CLIENT_GONE)

    def stop_watching(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    def close(self) -> None:
        self.stop_watching()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for task in self._tasks:
            task.cancel()
        for g in self.gens:
            g.close()

    async def pieces(self) -> AsyncIterator[tuple[int, Piece]]:
        """(choice index, Piece) as the choices produce them, until every choice has its finish reason; an
        exception of one choice (ClientGone, EngineFailure, RequestError) ends the iteration."""
        tasks = self._tasks
        tasks.update({asyncio.ensure_future(g.next()): g.index for g in self.gens})
        try:
            while tasks:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=tasks.get):
                    index = tasks.pop(task)
                    piece = task.result()
                    if piece.reason is None:
                        tasks[asyncio.ensure_future(self.gens[index].next())] = index
                    yield index, piece
        finally:
            for task in tasks:
                task.cancel()
            tasks.clear()
