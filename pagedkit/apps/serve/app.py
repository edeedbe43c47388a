"""The OpenAI-compatible HTTP app: `create_app(engine, tokenizer, model_name)` (Starlette).

    GET  /health                 {"status": "ok", ...}
    GET  /v1/models              the one model (id = model_name)
    POST /v1/completions         prompt (string or token ids) -> text; stream: Server-Sent Events
    POST /v1/chat/completions    messages (the tokenizer's chat template) -> assistant message; stream: SSE

Requests go to the engine through an `EngineWorker` thread (started with the app's lifespan, or by the
first request when the app runs without one); each request reads its RequestOutputs from an asyncio queue
and turns tokens into text with a `TextStream` (stop strings, held-back partial matches). A streaming
client that disconnects aborts its engine request. Field checks: protocol.py; docs/serve.md.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from typing import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from . import protocol as P
from .textstream import TextStream
from .tokenizer import as_serve_tokenizer
from .worker import EngineWorker


class EngineFailure(Exception):
    """engine.step() raised while this request was running."""


def _error(exc: P.RequestError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def _server_error(message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "server_error", "param": None, "code": None}},
                        status_code=500)


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


class _Server:
    """What the endpoints share: the engine's worker, the tokenizer, the model's name and limits."""

    def __init__(self, engine, tokenizer, model_name: str, sampling_params_cls):
        self.engine = engine
        self.worker = EngineWorker(engine)
        self.tok = as_serve_tokenizer(tokenizer)
        self.model_name = model_name
        self.params_cls = sampling_params_cls
        self.created = int(time.time())

    def params(self, s: P.Sampling, max_tokens: int):
        return self.params_cls(max_new_tokens=max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                               seed=s.seed, stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos)

    async def generate(self, prompt_ids: list[int], s: P.Sampling, max_tokens: int
                       ) -> AsyncIterator[tuple[str, str | None, TextStream]]:
        """(text piece, finish reason or None, the TextStream) as the engine produces tokens; the last item
        has the finish reason. Leaving early (a disconnect, an exception) aborts the engine request."""
        request_id, queue = self.worker.submit(prompt_ids, self.params(s, max_tokens))
        text = TextStream(self.tok.decode, s.stop)
        done = False
        try:
            while True:
                out = await queue.get()
                if isinstance(out, BaseException):
                    done = True  # the worker already aborted it
                    raise EngineFailure(f"the engine failed: {type(out).__name__}: {out}")
                piece = text.push(out.new_token_ids)
                if text.stopped:
                    self.worker.abort(request_id)
                    done = True
                    yield piece, "stop", text
                    return
                if out.finished and out.finish_reason == "abort":  # not ours: we dropped our aborted ids
                    done = True
                    raise EngineFailure(f"the engine aborted the request: {getattr(out, 'reason', None) or 'no reason given'}")
                if out.finished:
                    done = True
                    piece += text.finish()
                    reason = "length" if out.finish_reason == "length" and not text.stopped else "stop"
                    yield piece, reason, text
                    return
                if piece:
                    yield piece, None, text
        finally:
            if not done:
                self.worker.abort(request_id)

    def usage(self, prompt_len: int, text: TextStream) -> dict:
        return {"prompt_tokens": prompt_len, "completion_tokens": text.num_tokens,
                "total_tokens": prompt_len + text.num_tokens}


async def _json_body(request: Request):
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise P.RequestError(f"the request body is not valid JSON ({exc})") from None


def _stream_response(chunks: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _submit_checked(srv: _Server, prompt_ids, s, max_tokens):
    """Start the generation and wait for its first item, so that the engine refusing the request
    (add_request raising ValueError: e.g. a prompt the cache pool cannot hold) is a 400, not a broken stream."""
    gen = srv.generate(prompt_ids, s, max_tokens)
    try:
        first = await gen.__anext__()
    except ValueError as exc:
        await gen.aclose()
        raise P.RequestError(f"the engine refused the request: {exc}") from None
    except BaseException:
        await gen.aclose()
        raise
    return gen, first


def create_app(engine, tokenizer, model_name: str, *, sampling_params_cls=None) -> Starlette:
    """The Starlette app serving `engine` (pagedkit.engine.Engine or one with its interface).

    tokenizer: a transformers PreTrainedTokenizerFast (see tokenizer.load_tokenizer) or a ServeTokenizer.
    sampling_params_cls: the SamplingParams class handed to engine.add_request (default: the engine's)."""
    if sampling_params_cls is None:
        from ...engine import SamplingParams as sampling_params_cls
    srv = _Server(engine, tokenizer, model_name, sampling_params_cls)

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": srv.model_name, "pending_requests": srv.worker.pending()})

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": srv.model_name, "object": "model", "created": srv.created, "owned_by": "pagedkit",
            "max_model_len": srv.engine.max_seq_len}]})

    async def run(request: Request, chat: bool) -> Response:
        try:
            body = await _json_body(request)
            P.check_common(body, srv.model_name)
            if chat:
                messages = P.chat_messages(body)
                s = P.parse_sampling(body, ("max_completion_tokens", "max_tokens"))
                prompt_ids = P.check_token_ids(srv.tok.chat(messages), "messages", srv.engine.vocab_size)
                max_tokens = P.resolve_max_tokens(s.max_tokens, None, len(prompt_ids), srv.engine.max_seq_len,
                                                  "messages", s.max_tokens_param)
            else:
                P.check_completion_fields(body)
                s = P.parse_sampling(body)
                prompt_ids = P.completion_prompt(body, srv.tok.encode, srv.engine.vocab_size)
                max_tokens = P.resolve_max_tokens(s.max_tokens, P.DEFAULT_COMPLETION_MAX_TOKENS, len(prompt_ids),
                                                  srv.engine.max_seq_len, "prompt")
            gen, first = await _submit_checked(srv, prompt_ids, s, max_tokens)
        except P.RequestError as exc:
            return _error(exc)
        except EngineFailure as exc:
            return _server_error(str(exc))
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        head = {"id": ident, "object": "", "created": created, "model": srv.model_name}
        if not s.stream:
            return await _complete(srv, gen, first, head, chat, len(prompt_ids))
        return _stream_response(_chunks(srv, gen, first, head, chat, len(prompt_ids), s.include_usage))

    async def completions(request: Request) -> Response:
        return await run(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await run(request, chat=True)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        srv.worker.start()
        try:
            yield
        finally:
            srv.worker.stop()

    app = Starlette(routes=[
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ], lifespan=lifespan)
    app.state.server = srv
    app.state.worker = srv.worker
    return app


async def _complete(srv: _Server, gen, first, head: dict, chat: bool, prompt_len: int) -> Response:
    piece, reason, text = first
    pieces = [piece]
    try:
        async for piece, reason, text in gen:
            pieces.append(piece)
    except EngineFailure as exc:
        return _server_error(str(exc))
    content = "".join(pieces)
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": None,
                  "finish_reason": reason}
    else:
        choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": reason}
    return JSONResponse(head | {"object": "chat.completion" if chat else "text_completion", "choices": [choice],
                                "usage": srv.usage(prompt_len, text)})


async def _chunks(srv: _Server, gen, first, head: dict, chat: bool, prompt_len: int,
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

    piece, reason, text = first
    try:
        if chat:
            yield _sse(chunk("", None, role=True))
        for event in events(piece, reason):
            yield event
        if reason is None:  # generate's last item has the finish reason, and it ends there
            async for piece, reason, text in gen:
                for event in events(piece, reason):
                    yield event
        if include_usage:
            yield _sse(head | {"choices": [], "usage": srv.usage(prompt_len, text)})
    except EngineFailure as exc:
        yield _sse({"error": {"message": str(exc), "type": "server_error", "param": None, "code": None}})
    finally:
        await gen.aclose()
    yield b"data: [DONE]\n\n"
