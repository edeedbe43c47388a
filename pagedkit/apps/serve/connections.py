"""paged-serve's connections: uvicorn (h11) with a header read timeout, and its config from ServeLimits.

uvicorn times out only idle keep-alive connections: a connection that never sends a complete request line
and headers (half-open, or a slow "slowloris" client) is held forever. `header_timeout_protocol(s)` is
uvicorn's H11Protocol with a timer armed when a connection opens and when the first bytes of a later request
on it arrive (idle time in between is the keep-alive timeout's), cancelled when the request's headers are
complete; when it fires the connection is closed. The body's own timeout is limits.BodyReader's; the idle
keep-alive timeout is uvicorn's `timeout_keep_alive`. h11 is used whatever is installed (httptools has no size limit on headers that
uvicorn exposes; h11's is `h11_max_incomplete_event_size`).
"""

from __future__ import annotations

import logging

from .limits import ServeLimits

log = logging.getLogger("uvicorn.error")


def header_timeout_protocol(header_timeout_s: float):
    """uvicorn's H11Protocol closing a connection whose request headers take longer than header_timeout_s
    (0: no timeout, uvicorn's own protocol)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    if not header_timeout_s:
        return H11Protocol

    class HeaderTimeoutH11Protocol(H11Protocol):
        _header_timer = None

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout_s, self._timed_out)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _timed_out(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                log.debug("%s: no complete request headers within %gs: connection closed",
                          "%s:%s" % self.client if self.client else "a client", header_timeout_s)
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            if self._header_timer is None and (cycle is None or cycle.response_complete):
                self._arm()  # the first bytes of a request on a kept-alive connection
            super().data_received(data)
            if self.cycle is not cycle:  # a request's headers came: the app has it (its body: BodyReader's timeout)
                self._disarm()

    return HeaderTimeoutH11Protocol


def uvicorn_config(app, host: str, port: int, limits: ServeLimits, log_level: str = "info"):
    """uvicorn.Config serving `app` within `limits` (timeouts, header size, concurrency)."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                          http=header_timeout_protocol(limits.header_timeout_s),
                          timeout_keep_alive=limits.keep_alive_timeout_s,
                          limit_concurrency=limits.limit_concurrency,
                          h11_max_incomplete_event_size=limits.max_header_bytes)
