"""The OpenAI-compatible HTTP app: `create_app(engine, tokenizer, model_name)` (Starlette).

    GET  /health                 {"status": "ok", ...}; 503 {"status": "error", ...} once the engine failed
    GET  /v1/models              the one model (id = model_name); /v1/models/{id} that model (else 404)
    GET  /metrics                Prometheus text format (metrics.py)
    POST /v1/completions         prompt (string or token ids) -> text; stream: Server-Sent Events
    POST /v1/chat/completions    messages (the tokenizer's chat template) -> assistant message; stream: SSE

Requests go to the engine through an `EngineWorker` thread (started with the app's lifespan, or by the
first request when the app runs without one); generation.py turns each request's RequestOutputs into text,
responses.py into the response's JSON or its SSE chunks (n choices, logprobs).
In front of the routes, outermost first: the Host check (security.HostCheck, loopback binds), CORS (only
with allowed_origins), the API key and JSON-only bodies (security.Gate), the body read whole within its
limits (limits.BodyReader). Every error is an OpenAI error object (404 / 405 too); a client that
disconnects aborts its engine request, streaming or not. Field checks: protocol.py; response_format:
structured.py (llguidance); tools and tool calls: tools.py; docs/serve.md.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import uuid
from typing import AsyncIterator, Callable, Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from . import protocol as P
from .generation import ClientGone, EngineFailure, Job, Server
from .limits import BodyReader, ServeLimits, error_response
from .metrics import CONTENT_TYPE
from .responses import chunks, complete
from .security import Gate, HostCheck
from .structured import Spec, json_spec, parse_response_format, require_library
from .tools import ToolOutput, Tools, parse_tools, template_takes_tools, with_history_fields
from .worker import EngineDown

log = logging.getLogger("uvicorn.error")


def _error(exc: P.RequestError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def _server_error(message: str, status: int = 500) -> JSONResponse:
    return error_response(status, message, type="server_error")


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


def _check_engine_fields(srv: Server, s: P.Sampling) -> None:
    """The fields the engine bounds: logit_bias's token ids (the vocabulary), n (its batch, its add_group)."""
    P.check_logit_bias(s, srv.engine.vocab_size)
    if s.n > 1:
        batch = getattr(srv.engine, "max_batch_size", None)
        if not hasattr(srv.engine, "add_group"):
            raise P.RequestError(f"n: this engine runs one choice per request (it has no add_group); expected 1, "
                                 f"got {s.n}", "n")
        if batch is not None and s.n > batch:
            raise P.RequestError(f"n: expected at most {batch} (the server's --max-batch-size: the choices run "
                                 f"together), got {s.n}", "n")


async def _prompt(srv: Server, body: dict, chat: bool) -> tuple[P.Sampling, list[int], int, Callable | None]:
    """The request's sampling fields (with its grammar, compiled in the pool), prompt token ids (tokenized in the
    pool), max_tokens and, for a chat with tools, a factory of the shaping of one choice's tool calls."""
    limits, vocab = srv.limits.fields, srv.engine.vocab_size
    P.check_common(body, srv.model_name)
    spec, tools = parse_response_format(body), None
    if chat:
        messages = P.chat_messages(body)
        tools, spec = _tools(srv, body, spec)
        s = P.parse_sampling(body, ("max_completion_tokens", "max_tokens"), limits)
        P.chat_logprobs(body, s)
        _check_engine_fields(srv, s)
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
        P.completion_logprobs(body, s)
        _check_engine_fields(srv, s)
        prompt_ids = await srv.in_thread(P.completion_prompt, body, srv.tok.encode, vocab)
        max_tokens = P.resolve_max_tokens(s.max_tokens, P.DEFAULT_COMPLETION_MAX_TOKENS, len(prompt_ids),
                                          srv.engine.max_seq_len, "prompt", pool_tokens=srv.pool_tokens)
    if spec is not None:
        s.constraint = await srv.in_thread(srv.structured.guide, spec)
    # one ToolOutput per choice (each holds its own text)
    shaping = None if tools is None else functools.partial(ToolOutput, srv.tool_parser,
                                                           tools if tools.choice != "auto" else None)
    return s, prompt_ids, max_tokens, shaping


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

    def model_card() -> dict:
        return {"id": srv.model_name, "object": "model", "created": srv.created, "owned_by": "pagedkit",
                "max_model_len": srv.engine.max_seq_len}

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model(request: Request) -> Response:
        name = request.path_params["model_id"]
        if name != srv.model_name:
            return error_response(404, f"The model {name!r} does not exist; this server serves {srv.model_name!r}",
                                  "model_not_found", "model")
        return JSONResponse(model_card())

    async def metrics(request: Request) -> Response:
        return Response(srv.metrics.render(), media_type=CONTENT_TYPE)

    async def run(request: Request, chat: bool) -> Response:
        if srv.worker.failure is not None:
            return _server_error("the engine failed earlier; restart the server", 503)
        if srv.active >= srv.capacity:
            return error_response(429, f"the server is busy: {srv.active} requests in progress (the engine's batch "
                                  "and the server's --max-queue-len are full); retry later", "queue_full",
                                  type="rate_limit_error", headers={"Retry-After": str(srv.limits.retry_after_s)})
        srv.active += 1
        arrival = time.monotonic()
        job: Job | None = None

        def finished() -> None:
            srv.active -= 1
            if job is not None:
                job.close()

        try:
            s, prompt_ids, max_tokens, shaping = await _prompt(srv, await srv.parse(await request.body()), chat)
            job = Job(srv, prompt_ids, s, max_tokens, request.receive, arrival, shaping)
            try:
                job.start()
            except ValueError as exc:  # add_request / add_group refused it
                raise P.RequestError(f"the engine refused the request: {exc}") from None
            it = job.pieces()
            first = await it.__anext__()  # the engine refusing the request is a 400, not a broken stream
            head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "object": "",
                    "created": int(time.time()), "model": srv.model_name}
            if s.stream:
                job.stop_watching()  # StreamingResponse watches the connection from here
                response = _Stream(chunks(srv, job, it, first, head, chat, len(prompt_ids), s.include_usage),
                                   finished)
                finished = None  # the response runs it
                return response
            return await complete(srv, job, it, first, head, chat, len(prompt_ids))
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
        Route("/v1/models/{model_id:path}", model, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ], middleware=middleware, lifespan=lifespan,
        exception_handlers={HTTPException: http_error, Exception: internal_error})
    app.state.server = srv
    app.state.worker = srv.worker
    return app
