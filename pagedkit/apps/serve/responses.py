"""The bodies of a request's answer (used by app.py): the whole response, or its Server-Sent Events.

A request of n choices answers `choices[0..n-1]` (index = the choice); streamed, each chunk holds one
choice's piece, the choices interleaved as they produce text. With logprobs, each choice (each chunk, when
streamed) carries the entries of its tokens:
- completions (`logprobs: k`): {"tokens", "token_logprobs", "top_logprobs" (the k most likely tokens and the
  sampled one: up to k + 1 entries), "text_offset" (of each token in the choice's text of token texts)};
- chat (`logprobs: true`, `top_logprobs: k`): {"content": [{"token", "logprob", "bytes", "top_logprobs":
  [{"token", "logprob", "bytes"}] (k of them)}], "refusal": null}.
A chat request with tools shapes each choice's text with its own tools.ToolOutput (the generation's `tools`):
content from a call's marker on is held back, and the calls come as `tool_calls` (a message's, or one chunk's
delta before the finish reason) with finish_reason "tool_calls".
"""

from __future__ import annotations

import json
from typing import AsyncIterator

from starlette.responses import JSONResponse, Response

from .generation import ClientGone, EngineFailure, Job, Piece, Server


def sse(obj) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


LOGPROB_FLOOR = -9999.0  # a logprob of -inf is not JSON: shown as this (vLLM's)


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


class Logprobs:
    """One choice's logprob entries in the endpoint's format (`offset`: completions' text offset so far)."""

    def __init__(self, chat: bool):
        self.chat, self.offset = chat, 0

    def format(self, entries: list) -> dict:
        if self.chat:
            def one(text, lp):
                return {"token": text, "logprob": _lp(lp), "bytes": list(text.encode("utf-8"))}

            return {"content": [one(t, lp) | {"top_logprobs": [one(u, v) for u, v in top]} for t, lp, top in entries],
                    "refusal": None}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for text, lp, top in entries:
            out["tokens"].append(text)
            out["token_logprobs"].append(_lp(lp))
            out["top_logprobs"].append({u: _lp(v) for u, v in top} | {text: _lp(lp)})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


async def complete(srv: Server, job: Job, it: AsyncIterator, first: tuple[int, Piece], head: dict, chat: bool,
                   prompt_len: int) -> Response:
    n = len(job.gens)
    texts, entries, reasons = [[] for _ in range(n)], [[] for _ in range(n)], [None] * n
    index, piece = first
    while True:  # EngineFailure / ClientGone go to the caller
        texts[index].append(piece.text)
        entries[index] += piece.logprobs or []
        reasons[index] = piece.reason or reasons[index]
        if all(reasons):
            break
        index, piece = await it.__anext__()
    choices = []
    for i, gen in enumerate(job.gens):
        lps = Logprobs(chat).format(entries[i]) if job.s.logprobs is not None else None
        content, calls, reason = "".join(texts[i]), [], reasons[i]
        if gen.tools is not None:
            gen.tools.feed(content)
            content, calls = gen.tools.result()
            reason = "tool_calls" if calls else reason
        if chat:
            body = {"message": {"role": "assistant", "content": content} | ({"tool_calls": calls} if calls else {})}
        else:
            body = {"text": content}
        choices.append({"index": i} | body | {"logprobs": lps, "finish_reason": reason})
    return JSONResponse(head | {"object": "chat.completion" if chat else "text_completion", "choices": choices,
                                "usage": srv.usage(prompt_len, job)})


async def chunks(srv: Server, job: Job, it: AsyncIterator, first: tuple[int, Piece], head: dict, chat: bool,
                 prompt_len: int, include_usage: bool) -> AsyncIterator[bytes]:
    head = head | {"object": "chat.completion.chunk" if chat else "text_completion"}
    n, want_lps = len(job.gens), job.s.logprobs is not None
    formats = [Logprobs(chat) for _ in range(n)]

    def chunk(i: int, text: str, reason: str | None, entries=None, role: bool = False) -> dict:
        lps = formats[i].format(entries or []) if want_lps and (entries or not reason) and not role else None
        if chat:
            delta = ({"role": "assistant", "content": text} if role else {"content": text} if text or not reason
                     else {})
            choice = {"index": i, "delta": delta, "logprobs": lps, "finish_reason": reason}
        else:
            choice = {"index": i, "text": text, "logprobs": lps, "finish_reason": reason}
        return head | {"choices": [choice]} | ({"usage": None} if include_usage else {})

    def events(i: int, text: str, reason: str | None, entries=None) -> list[bytes]:
        if (text or entries) and reason:  # the last piece of text, then the finish reason on its own chunk
            return [sse(chunk(i, text, None, entries)), sse(chunk(i, "", reason))]
        return [sse(chunk(i, text, reason, entries))] if text or entries or reason else []

    def shape(i: int, piece: Piece) -> list[bytes]:
        tools = job.gens[i].tools
        if tools is None:
            return events(i, piece.text, piece.reason, piece.logprobs)
        text = tools.feed(piece.text)  # content held back from a call's marker on
        if piece.reason is None:
            return events(i, text, None, piece.logprobs)
        rest, calls = tools.finish()
        if not calls:
            return events(i, text + rest, piece.reason, piece.logprobs)
        deltas = [{"index": k} | call for k, call in enumerate(calls)]
        call_chunk = head | {"choices": [{"index": i, "delta": {"tool_calls": deltas}, "logprobs": None,
                                          "finish_reason": None}]} | ({"usage": None} if include_usage else {})
        return events(i, text + rest, None, piece.logprobs) + [sse(call_chunk)] + events(i, "", "tool_calls")

    try:
        if chat:
            for i in range(n):
                yield sse(chunk(i, "", None, role=True))
        index, piece = first
        while True:
            for event in shape(index, piece):
                yield event
            try:
                index, piece = await it.__anext__()
            except StopAsyncIteration:
                break
        if include_usage:
            yield sse(head | {"choices": [], "usage": srv.usage(prompt_len, job)})
    except EngineFailure as exc:
        yield sse({"error": {"message": str(exc), "type": "server_error", "param": None, "code": None}})
    except ClientGone:
        return
    finally:
        job.close()
    yield b"data: [DONE]\n\n"
