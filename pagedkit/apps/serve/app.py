"""The OpenAI-compatible HTTP app: `create_app(engine, tokenizer, model_name)` (Starlette).

    GET  /health                 {"status": "ok", ...}; 503 {"status": "error", ...} once the engine failed
    GET  /v1/models              the one model (id = model_name)
    POST /v1/completions         prompt (string or token ids) -> text; stream: Server-Sent Events
    POST /v1/chat/completions    messages (the tokenizer's chat template) -> assistant message; stream: SSE

Requests go to the engine through an `EngineWorker` thread (started with the app's lifespan, or by the
first request when the app runs without one); generation.py turns each request's RequestOutputs into text.
In front of the routes, outermost first: the Host check (security.HostCheck, loopback binds), CORS (only
with allowed_origins), the API key and JSON-only bodies (security.Gate), the body read whole within its
limits (limits.BodyReader). Every error is an OpenAI error object (404 / 405 too); a client that
disconnects aborts its engine request, streaming or not. Field checks: protocol.py; response_format:
structured.py (llguidance); tools and tool calls: tools.py; docs/serve.md.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from typing import AsyncIterator, Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from . import protocol as P
from .generation import ClientGone, EngineFailure, Generation, Server
from .limits import BodyReader, ServeLimits, error_response
from .security import Gate, HostCheck
from .structured import Spec, json_spec, parse_response_format, require_library
from .tools import ToolOutput, Tools, parse_tools, template_takes_tools, with_history_fields
from .worker import EngineDown

log = logging.getLogger("uvicorn.error")


def _error(exc: P.RequestError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def _server_error(message: str, status: int = 500) -> JSONResponse:
    return error_response(status, message, type="server_error")


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


class _Stream(StreamingResponse):
    """An SSE response whose `on_close` runs however the response ends (the client gone before it started too)."""

    def __init__(self, chunks: AsyncIterator[bytes], on_close):
        super().__init__(chunks, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def _prompt(srv: Server, body: dict, chat: bool) -> tuple[P.Sampling, list[int], int, ToolOutput | None]:
    """The request's sampling fields (with its grammar, compiled in the pool), prompt token ids (tokenized in the
    pool), max_tokens and the shaping of its tool calls (chat with tools)."""
    limits, vocab = srv.limits.fields, srv.engine.vocab_size
    P.check_common(body, srv.model_name)
    spec, tools = parse_response_format(body), None
    if chat:
        messages = P.chat_messages(body)
        tools, spec = _tools(srv, body, spec)
        s = P.parse_sampling(body, ("max_completion_tokens", "max_tokens"), limits)
        defs = {"tools": tools.tools} if tools is not None else {}

        def render() -> list[int]:  # in the pool: the history's tool calls are JSON to read, then the template
            history = with_history_fields(messages, body["messages"])
            return P.check_token_ids(srv.tok.chat(history, **defs), "messages", vocab)

        prompt_ids = await srv.in_thread(render)
        max_tokens = P.resolve_max_tokens(s.max_tokens, None, len(prompt_ids), srv.engine.max_seq_len, "messages",
                                          s.max_tokens_param, srv.pool_tokens)
    else:
        P.check_completion_fields(body)
        s = P.parse_sampling(body, limits=limits)
        prompt_ids = await srv.in_thread(P.completion_prompt, body, srv.tok.encode, vocab)
        max_tokens = P.resolve_max_tokens(s.max_tokens, P.DEFAULT_COMPLETION_MAX_TOKENS, len(prompt_ids),
                                          srv.engine.max_seq_len, "prompt", pool_tokens=srv.pool_tokens)
    if spec is not None:
        s.constraint = await srv.in_thread(srv.structured.guide, spec)
    out = ToolOutput(srv.tool_parser, tools if tools.choice != "auto" else None) if tools is not None else None
    return s, prompt_ids, max_tokens, out


def _tools(srv: Server, body: dict, spec: Spec | None) -> tuple[Tools | None, Spec | None]:
    """A chat request's tools (tools.py) and the grammar of its answer: response_format's, or the JSON schema
    forcing a tool call (tool_choice "required" / a named function)."""
    tools = parse_tools(body)
    if tools is None:
        return None, spec
    if not template_takes_tools(srv.tok.chat_template):
        raise P.RequestError("tools: this model's chat template does not take tools (it never mentions them); "
                             "describe the tools in a message instead", "tools")
    forced = tools.forced_schema()
    if forced is None:
        return tools, spec
    if spec is not None:
        raise P.RequestError("response_format: not with a \"required\" or named tool_choice (the tool call's "
                             "arguments have their own schema)", "response_format")
    require_library("tool_choice", f"tool_choice {tools.choice!r}")
    return tools, json_spec(forced, "tools")  # a schema llguidance refuses is one of the tools' parameters


def create_app(engine, tokenizer, model_name: str, *, sampling_params_cls=None, limits: ServeLimits | None = None,
               api_key: str | None = None, allowed_hosts: Sequence[str] | None = None,
               allowed_origins: Sequence[str] = (), tool_call_parser: str | None = None) -> Starlette:
    """The Starlette app serving `engine` (pagedkit.engine.Engine or one with its interface).

    tokenizer: a transformers PreTrainedTokenizerFast (see tokenizer.load_tokenizer) or a ServeTokenizer.
    sampling_params_cls: the SamplingParams class handed to engine.add_request (default: the engine's).
    limits: ServeLimits (default: the CLI's defaults). api_key: required as `Authorization: Bearer` on /v1/.
    allowed_hosts: the Host names served (None: any; security.allowed_hosts_for gives a bind's).
    allowed_origins: CORS origins (none: no CORS headers). tool_call_parser: the tool-call format (tools.PARSERS;
    None: chosen from the chat template)."""
    if sampling_params_cls is None:
        from ...engine import SamplingParams as sampling_params_cls
    srv = Server(engine, tokenizer, model_name, sampling_params_cls, limits or ServeLimits(), tool_call_parser)

    async def health(request: Request) -> Response:
        state = {"model": srv.model_name, "pending_requests": srv.worker.pending()}
        failure = srv.worker.failure
        if failure is not None:
            return JSONResponse({"status": "error", "error": f"the engine failed: {type(failure).__name__}: "
                                 f"{failure}"[:500]} | state, status_code=503)
        return JSONResponse({"status": "ok"} | state)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": srv.model_name, "object": "model", "created": srv.created, "owned_by": "pagedkit",
            "max_model_len": srv.engine.max_seq_len}]})

    async def run(request: Request, chat: bool) -> Response:
        if srv.worker.failure is not None:
            return _server_error("the engine failed earlier; restart the server", 503)
        if srv.active >= srv.capacity:
            return error_response(429, f"the server is busy: {srv.active} requests in progress (the engine's batch "
                                  "and the server's --max-queue-len are full); retry later", "queue_full",
                                  type="rate_limit_error", headers={"Retry-After": str(srv.limits.retry_after_s)})
        srv.active += 1
        gen: Generation | None = None

        def finished() -> None:
            srv.active -= 1
            if gen is not None:
                gen.close()

        try:
            s, prompt_ids, max_tokens, tools = await _prompt(srv, await srv.parse(await request.body()), chat)
            gen = Generation(srv, prompt_ids, s, max_tokens, request.receive, tools)
            try:
                gen.start()
            except ValueError as exc:  # add_request refused it
                raise P.RequestError(f"the engine refused the request: {exc}") from None
            first = await gen.next()  # the engine refusing the request is a 400, not a broken stream
            head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "object": "",
                    "created": int(time.time()), "model": srv.model_name}
            if s.stream:
                gen.stop_watching()  # StreamingResponse watches the connection from here
                response = _Stream(_chunks(srv, gen, first, head, chat, len(prompt_ids), s.include_usage), finished)
                finished = None  # the response runs it
                return response
            return await _complete(srv, gen, first, head, chat, len(prompt_ids))
        except P.RequestError as exc:
            return _error(exc)
        except EngineFailure as exc:
            return _server_error(str(exc))
        except EngineDown as exc:
            return _server_error(str(exc), 503)
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        finally:
            if finished is not None:
                finished()

    async def completions(request: Request) -> Response:
        return await run(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await run(request, chat=True)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = (f"{request.method} {request.url.path}: "
                   + {404: "no such endpoint", 405: "method not allowed"}.get(exc.status_code, str(exc.detail)))
        return error_response(exc.status_code, message, code, headers=exc.headers)

    async def internal_error(request: Request, exc: Exception) -> Response:
        return _server_error(f"internal error: {type(exc).__name__}")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        srv.worker.start()
        try:
            yield
        finally:
            srv.worker.stop()

    middleware = [Middleware(HostCheck, allowed=allowed_hosts)] if allowed_hosts else []
    if allowed_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                                     allow_headers=["Authorization", "Content-Type"]))
    middleware += [Middleware(Gate, api_key=api_key), Middleware(BodyReader, limits=srv.limits)]
    app = Starlette(routes=[
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ], middleware=middleware, lifespan=lifespan,
        exception_handlers={HTTPException: http_error, Exception: internal_error})
    app.state.server = srv
    app.state.worker = srv.worker
    return app


async def _complete(srv: Server, gen: Generation, first, head: dict, chat: bool, prompt_len: int) -> Response:
    piece, reason = first
    pieces = [piece]
    while reason is None:  # EngineFailure / ClientGone go to the caller
        piece, reason = await gen.next()
        pieces.append(piece)
    content, calls = "".join(pieces), []
    if gen.tools is not None:
        gen.tools.feed(content)
        content, calls = gen.tools.result()
    if chat:
        message = {"role": "assistant", "content": content} | ({"tool_calls": calls} if calls else {})
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": "tool_calls" if calls else reason}
    else:
        choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": reason}
    return JSONResponse(head | {"object": "chat.completion" if chat else "text_completion", "choices": [choice],
                                "usage": srv.usage(prompt_len, gen.text)})


async def _chunks(srv: Server, gen: Generation, first, head: dict, chat: bool, prompt_len: int,
                  include_usage: bool) -> AsyncIterator[bytes]:
    head = head | {"object": "chat.completion.chunk" if chat else "text_completion"}

    def chunk(piece: str, reason: str | None, role: bool = False) -> dict:
        if chat:
            delta = ({"role": "assistant", "content": piece} if role else {"content": piece} if piece or not reason
                     else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": reason}
        return head | {"choices": [choice]} | ({"usage": None} if include_usage else {})

    def events(piece: str, reason: str | None) -> list[bytes]:
        if piece and reason:  # the last piece of text, then the finish reason on its own chunk
            return [_sse(chunk(piece, None)), _sse(chunk("", reason))]
        return [_sse(chunk(piece, reason))] if piece or reason else []

    def tool_events(piece: str, reason: str | None) -> list[bytes]:  # content held back from a call's marker on
        piece = gen.tools.feed(piece)
        if reason is None:
            return events(piece, None)
        rest, calls = gen.tools.finish()
        if not calls:
            return events(piece + rest, reason)
        deltas = [{"index": k} | call for k, call in enumerate(calls)]
        return (events(piece + rest, None) + [_sse(head | {"choices": [{"index": 0, "delta": {"tool_calls": deltas},
                "logprobs": None, "finish_reason": None}]} | ({"usage": None} if include_usage else {}))]
                + events("", "tool_calls"))

    shape = tool_events if gen.tools is not None else events
    piece, reason = first
    try:
        if chat:
            yield _sse(chunk("", None, role=True))
        for event in shape(piece, reason):
            yield event
        while reason is None:
            piece, reason = await gen.next()
            for event in shape(piece, reason):
                yield event
        if include_usage:
            yield _sse(head | {"choices": [], "usage": srv.usage(prompt_len, gen.text)})
    except EngineFailure as exc:
        yield _sse({"error": {"message": str(exc), "type": "server_error", "param": None, "code": None}})
    except ClientGone:
        return
    finally:
        gen.close()
    yield b"data: [DONE]\n\n"
