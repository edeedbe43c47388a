"""One request's generation, from the engine's outputs to text (used by app.py).

`Server` is what the endpoints share: the engine's worker thread, the tokenizer (and what structured output and
tool calls need of it: structured.py, tools.py), a small thread pool where
tokenization, chat templating, detokenization and the parsing of large bodies run (never on the event loop),
the limits and the count of requests in progress. `Generation` is one request: submitted to the worker, it
reads the request's RequestOutputs from its asyncio queue, turns tokens into text with a `TextStream` (in the
pool) and ends at a stop string, the engine's finish, the request's deadline (`max_time`, finish_reason
"length") or its client leaving: a task watches the connection (`receive()` returns `http.disconnect`)
and puts CLIENT_GONE on the queue, so an orphaned request is aborted in the engine at its next step,
streaming or not.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from . import protocol as P
from .limits import ServeLimits, parse_body
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


class Server:
    """What the endpoints share: the engine's worker, the tokenizer, the model's name and limits."""

    def __init__(self, engine, tokenizer, model_name: str, sampling_params_cls, limits: ServeLimits,
                 tool_call_parser: str | None = None):
        self.engine = engine
        self.worker = EngineWorker(engine)
        self.tok = as_serve_tokenizer(tokenizer)
        self.model_name = model_name
        self.params_cls = sampling_params_cls
        self.limits = limits
        self.created = int(time.time())
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="paged-serve-text")
        self.active = 0  # requests past the queue check and not finished (parsing, waiting, generating)
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

    def params(self, s: P.Sampling, max_tokens: int):
        extra = {"constraint": s.constraint} if s.constraint is not None else {}
        return self.params_cls(max_new_tokens=max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                               seed=s.seed, stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos, **extra)

    def usage(self, prompt_len: int, text: TextStream) -> dict:
        return {"prompt_tokens": prompt_len, "completion_tokens": text.num_tokens,
                "total_tokens": prompt_len + text.num_tokens}


class Generation:
    """One engine request: `start()`, then `await next()` -> (text piece, finish reason or None) until the
    reason is set; `close()` (idempotent) aborts it if it has not ended. `receive`: the ASGI receive whose
    `http.disconnect` aborts the request (None: not watched; `stop_watching()` ends the watch)."""

    def __init__(self, srv: Server, prompt_ids: list[int], s: P.Sampling, max_tokens: int, receive=None,
                 tools: ToolOutput | None = None):
        self.srv, self.prompt_ids, self.s, self.max_tokens, self.receive = srv, prompt_ids, s, max_tokens, receive
        self.tools = tools  # the answer's tool calls (tools.py), None without tools
        keep = tools.keep if tools is not None else frozenset()
        self.text = TextStream((lambda ids: srv.tok.decode_keeping(ids, keep)) if keep else srv.tok.decode, s.stop)
        self.request_id: str | None = None
        self.done = False
        self.seen_output = False
        self._timer: asyncio.TimerHandle | None = None
        self._watch: asyncio.Task | None = None

    def start(self) -> None:
        """Submit to the engine: ValueError when it refuses the request, worker.EngineDown after a failure."""
        self.request_id, self.queue = self.srv.worker.submit(self.prompt_ids, self.srv.params(self.s, self.max_tokens))
        loop = asyncio.get_running_loop()
        if self.s.max_time:
            self._timer = loop.call_later(self.s.max_time, self.queue.put_nowait, DEADLINE)
        if self.receive is not None:
            self._watch = loop.create_task(self._watch_client(self.receive))

    async def _watch_client(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.queue.put_nowait(CLIENT_GONE)

    def stop_watching(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    def close(self) -> None:
        self.stop_watching()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.done and self.request_id is not None:
            self.done = True
            self.srv.worker.abort(self.request_id)

    def _end(self, abort: bool) -> None:
        if not abort:
            self.done = True  # the engine finished it (or the worker aborted it): nothing to abort
        self.close()

    async def next(self) -> tuple[str, str | None]:
        while True:
            items = [await self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            ids, last, signal = [], None, None
            for item in items:
                if item is CLIENT_GONE or item is DEADLINE or isinstance(item, BaseException):
                    signal = item
                    break
                ids.extend(item.new_token_ids)
                if item.finished:
                    last = item
                    break
            piece = await self.srv.in_thread(self.text.push, ids) if ids else ""
            if self.text.stopped:
                self._end(abort=True)
                return piece, "stop"
            if signal is CLIENT_GONE:
                self._end(abort=True)
                raise ClientGone()
            if signal is DEADLINE:
                self._end(abort=True)
                return piece + await self.srv.in_thread(self.text.finish), "length"
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
                return piece, "length" if last.finish_reason == "length" else "stop"
            if piece:
                return piece, None
