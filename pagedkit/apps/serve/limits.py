"""paged-serve's limits: what one request may cost before it reaches the engine (docs/serve.md, "Limits").

`ServeLimits` holds them all (cli.py sets them from its flags). `BodyReader` is the ASGI middleware that
reads a request's body whole before the app sees it: a Content-Length above `max_body_bytes` is a 413 before
any byte of the body is read, a body that grows past it while it streams in (chunked) is a 413 as soon as it
does, a body that takes longer than `body_timeout_s` is a 408, and a client that leaves during the upload is
one INFO line in the log (never a traceback). Both refusals close the connection. `parse_body` turns the
bytes into JSON and checks what `json` lets through: a lone surrogate in a string (no tokenizer takes it),
nesting deeper than `max_json_depth`, an integer literal longer than MAX_INT_DIGITS digits (Python's own
limit raises while parsing), NaN / Infinity (not JSON): each a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse

from .protocol import FieldLimits, RequestError

log = logging.getLogger("uvicorn.error")  # uvicorn's logger: its format, its --log-level

MAX_INT_DIGITS = 100  # digits of one JSON integer literal (token ids, seeds and counts need 20 at most)


@dataclass(frozen=True)
class ServeLimits:
    """Every limit of a paged-serve app (the defaults are the CLI's). 0 turns a timeout off."""

    max_body_bytes: int = 8 * 2 ** 20  # a request body (413 above, refused before it is read whole)
    max_json_depth: int = 64  # nesting of the request's JSON (400 above)
    max_stop_strings: int = 16  # stop strings of one request (400 above)
    max_stop_length: int = 1024  # characters of one stop string (400 above)
    max_queue_len: int = 256  # requests waiting beyond the engine's batch (429 + Retry-After above)
    retry_after_s: int = 1  # the Retry-After of a 429
    request_timeout_s: float = 600.0  # a request's deadline (it ends with finish_reason "length"); max_time lowers it
    header_timeout_s: float = 10.0  # a connection's request line and headers must arrive within it
    body_timeout_s: float = 60.0  # a request's body must arrive within it once its headers did (408 after)
    keep_alive_timeout_s: float = 5.0  # an idle keep-alive connection is closed after it
    max_header_bytes: int = 16 * 2 ** 10  # request line + headers (uvicorn's h11 answers 400 above)
    limit_concurrency: int = 1024  # connections + running requests (uvicorn answers 503 above)

    def __post_init__(self):
        for name, value in self.__dict__.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"ServeLimits.{name} must be a number >= 0, got {value!r}")
        for name in ("max_body_bytes", "max_json_depth", "max_stop_strings", "max_stop_length",
                     "max_header_bytes", "limit_concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServeLimits.{name} must be >= 1, got {getattr(self, name)!r}")

    @property
    def fields(self) -> FieldLimits:
        return FieldLimits(self.max_stop_strings, self.max_stop_length, self.request_timeout_s)


def error_response(status: int, message: str, code: str | None = None, param: str | None = None,
                   type: str = "invalid_request_error", headers: dict | None = None) -> JSONResponse:
    """An OpenAI error object with an HTTP status."""
    return JSONResponse({"error": {"message": message, "type": type, "param": param, "code": code}},
                        status_code=status, headers=headers)


def _closing(status: int, message: str, code: str) -> JSONResponse:
    return error_response(status, message, code, headers={"Connection": "close"})


class BodyReader:
    """ASGI middleware: the request body read whole, within `limits`, before the app runs; the app then
    receives it as one message, and later `receive()` calls (a disconnect) go to the server's."""

    def __init__(self, app, limits: ServeLimits):
        self.app, self.limits = app, limits

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limits.max_body_bytes
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            return await _closing(413, f"the request body has {int(declared)} bytes; expected at most {limit} "
                                  "(the server's --max-body-bytes)", "request_too_large")(scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.body_timeout_s if self.limits.body_timeout_s else None
        chunks, size, more = [], 0, True
        while more:
            try:
                if deadline is None:
                    message = await receive()
                else:
                    message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                log.info("%s: the request body did not arrive within %gs (%d bytes came): 408",
                         _who(scope), self.limits.body_timeout_s, size)
                return await _closing(408, f"the request body did not arrive within {self.limits.body_timeout_s:g} "
                                      "s (the server's --body-timeout)", "request_timeout")(scope, receive, send)
            if message["type"] == "http.disconnect":
                log.info("%s: the client went away during the request body (%d bytes came)", _who(scope), size)
                return
            body = message.get("body", b"")
            size += len(body)
            if size > limit:
                return await _closing(413, f"the request body is larger than {limit} bytes (the server's "
                                      "--max-body-bytes)", "request_too_large")(scope, receive, send)
            if body:
                chunks.append(body)
            more = message.get("more_body", False)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


def _who(scope) -> str:
    client = scope.get("client")
    where = f"{client[0]}:{client[1]}" if client else "a client"
    return f"{where} {scope.get('method', '')} {scope.get('path', '')}"


# -- the JSON of a body -------------------------------------------------------------------------------------------

class _Invalid:
    """What the parser put where the JSON held something the server refuses (reported with its field)."""

    def __init__(self, what: str):
        self.what = what


def _parse_int(text: str):
    return int(text) if len(text.lstrip("-")) <= MAX_INT_DIGITS else _Invalid(
        f"an integer literal of {len(text.lstrip('-'))} digits (at most {MAX_INT_DIGITS})")


def _parse_constant(name: str):
    return _Invalid(f"{name} is not a JSON number")


_SCAN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)


def _field_nested_too_deep(raw: bytes, max_depth: int) -> str | None:
    """The top-level field whose value nests deeper than max_depth (a scan of the raw JSON: strings skipped)."""
    depth, key, last = 0, None, None
    for m in _SCAN.finditer(raw):
        token = m.group()
        if token[:1] == b'"':
            last = token if depth == 1 else last
            continue
        depth += 1 if token in (b"[", b"{") else -1
        if depth == 2 and token in (b"[", b"{"):
            key = last
        if depth > max_depth:
            try:
                return json.loads(key) if key is not None else None
            except ValueError:
                return None
    return None


def _path(parts: tuple) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _check_string(text: str, parts: tuple) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(f"{_path(parts) or 'the request body'}: a lone surrogate "
                           f"({text[exc.start]!r}) at character {exc.start} is not valid Unicode text; expected "
                           "UTF-8 text (a surrogate pair for characters beyond U+FFFF)",
                           str(parts[0]) if parts else None) from None


def check_json(value: Any, max_depth: int) -> None:
    """Every string valid Unicode, no _Invalid, nesting at most max_depth: else a RequestError naming the
    field (param: the top-level field). Iterative: a deep document does not recurse here."""
    stack = [(value, 1, ())]
    while stack:
        node, depth, parts = stack.pop()
        param = str(parts[0]) if parts else None
        if depth > max_depth:
            raise RequestError(f"{_path(parts)}: nested deeper than {max_depth} levels (the server's "
                               "--max-json-depth)", param)
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in items:
            if isinstance(k, str):
                _check_string(k, parts)
            if isinstance(v, str):
                _check_string(v, parts + (k,))
            elif isinstance(v, (dict, list)):
                stack.append((v, depth + 1, parts + (k,)))
            elif isinstance(v, _Invalid):
                where = parts + (k,)
                raise RequestError(f"{_path(where)}: {v.what}", str(where[0]))


def parse_body(raw: bytes, max_depth: int) -> Any:
    """The request's JSON, checked (check_json); a RequestError (400) for anything else."""
    try:
        value = json.loads(raw, parse_int=_parse_int, parse_constant=_parse_constant)
    except RecursionError:
        field = _field_nested_too_deep(raw, max_depth)
        raise RequestError(f"{field or 'the request body'}: nested deeper than {max_depth} levels (the server's "
                           "--max-json-depth)", field) from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError (not UTF-8)
        raise RequestError(f"the request body is not valid JSON ({exc})"[:400]) from None
    if isinstance(value, _Invalid):
        raise RequestError(f"the request body: {value.what}")
    if isinstance(value, str):
        _check_string(value, ())
    elif isinstance(value, (dict, list)):
        check_json(value, max_depth)
    return value
