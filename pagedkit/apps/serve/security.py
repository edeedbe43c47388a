"""Who may drive paged-serve: the API key, the Host check, the body's media type, CORS (docs/serve.md, "Security").

- `HostCheck`: on a loopback bind (127.0.0.1, ::1, localhost) only requests whose `Host` header names a
  loopback address are served (400 otherwise), so a web page whose name resolves to 127.0.0.1 (DNS
  rebinding) cannot reach the server through the user's browser; `--allowed-hosts` adds names.
- `Gate`: with an API key, every /v1/ request needs `Authorization: Bearer KEY` (compared in constant time
  with hmac.compare_digest; 401 otherwise, as OpenAI answers); a POST body must be `application/json`
  (415 otherwise: a browser's "simple" cross-site request, text/plain or a form, cannot drive the server).
- CORS: no CORS headers at all unless `--allowed-origins` names origins (Starlette's CORSMiddleware).
"""

from __future__ import annotations

import hmac
import ipaddress
from pagedkit import settings
from typing import Iterable, Sequence

from .limits import error_response

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def api_key_from_env() -> str | None:
    """PAGEDKIT_API_KEY (pagedkit/settings.py): the API key when --api-key is not given."""
    return settings.read("PAGEDKIT_API_KEY") or None


def is_loopback(host: str) -> bool:
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_hosts_for(bind_host: str, extra: Iterable[str] = ()) -> tuple[str, ...] | None:
    """The Host names served for a bind address: loopback names on a loopback bind (plus `extra`), `extra`
    alone on another bind, None (no check) when that is empty."""
    extra = tuple(h.lower() for h in extra)
    if is_loopback(bind_host):
        return LOOPBACK_NAMES + extra
    return extra or None


def _host_name(value: str) -> str:
    """The name of a Host header value: without the port; an IPv6 literal without its brackets."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class HostCheck:
    """ASGI middleware: 400 for a Host header not in `allowed` (loopback names match any loopback address)."""

    def __init__(self, app, allowed: Sequence[str]):
        self.app, self.allowed = app, frozenset(a.lower() for a in allowed)
        self.loopback = any(is_loopback(a) for a in self.allowed)

    def ok(self, host: str) -> bool:
        name = _host_name(host)
        return name in self.allowed or (self.loopback and is_loopback(name))

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            if not self.ok(host):
                return await error_response(
                    400, f"Host {host!r}: this server answers only requests for {', '.join(sorted(self.allowed))} "
                    "(a loopback bind refuses other names: DNS rebinding; the server's --allowed-hosts adds names)",
                    "invalid_host")(scope, receive, send)
        await self.app(scope, receive, send)


class Gate:
    """ASGI middleware: the API key on /v1/ (when one is set), and JSON bodies only on POST."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.key = api_key.encode() if api_key else None

    def authorized(self, headers: dict) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        # compare_digest on the whole header's token, always run: the time does not depend on where it differs
        return hmac.compare_digest(token.strip(), self.key) and scheme.lower() == b"bearer"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.key is not None and scope["path"].startswith("/v1/") and not self.authorized(headers):
            return await error_response(
                401, "Incorrect or missing API key: send the header 'Authorization: Bearer YOUR_KEY' (the server's "
                "--api-key or PAGEDKIT_API_KEY)", "invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
        if scope["method"] == "POST":
            media = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if media != b"application/json":
                return await error_response(
                    415, f"Content-Type {media.decode('latin-1') or '(none)'!r}: expected 'application/json'",
                    "unsupported_media_type")(scope, receive, send)
        await self.app(scope, receive, send)
