"""The HTTP connection layer under the app: uvicorn's h11 protocol with the limits it lacks.

- a deadline for each request's head (request line and headers): from the moment the
  connection opens or the previous response ends; idle and slow-header connections
  (slowloris) are closed at it, where uvicorn would hold them forever;
- a cap on open connections: one past it is answered 503 and closed at once, with a
  warning in the log (at most one per 10 s, with the count refused meanwhile), so idle
  sockets cannot use up the process's file descriptors;
- malformed HTTP (a bad Content-Length, an over-long header) answered with an
  OpenAI-style JSON 400 instead of uvicorn's plain text.

The idle keep-alive timeout and the header-size limit are uvicorn's own settings
(timeout_keep_alive, h11_max_incomplete_event_size); the body deadline is the app's
(guard.py), as only it knows when it waits for a body.
"""

from __future__ import annotations

import time

from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import raw_error


def protocol_class(header_timeout: float, max_connections: int) -> type:
    """An H11Protocol subclass bound to these limits (uvicorn's `http=` takes a class)."""

    class Protocol(_LimitedH11):
        HEADER_TIMEOUT = header_timeout
        MAX_CONNECTIONS = max_connections

    return Protocol


class _CapLog:
    """Rate-limited warning for the connection cap."""

    last = 0.0
    refused = 0


class _LimitedH11(H11Protocol):
    HEADER_TIMEOUT = 10.0
    MAX_CONNECTIONS = 1000
    _timer = None
    _seen = None
    _got_bytes = False

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.MAX_CONNECTIONS:
            self._refuse()
            return
        self._arm()

    def _refuse(self) -> None:
        _CapLog.refused += 1
        now = time.monotonic()
        if now - _CapLog.last >= 10.0:
            self.logger.warning(
                "connection limit reached: %d connections are open (--max-connections %d); "
                "refused %d new connection(s) with 503", len(self.connections) - 1,
                self.MAX_CONNECTIONS, _CapLog.refused)
            _CapLog.last, _CapLog.refused = now, 0
        self.transport.write(raw_error(
            503, "Service Unavailable", f"the server has {self.MAX_CONNECTIONS} open "
            "connections, its limit; retry later", code="server_busy"))
        self.transport.close()

    def _arm(self) -> None:
        """Start the clock for the next request's head."""
        self._disarm()
        self._seen, self._got_bytes = self.cycle, False
        self._timer = self.loop.call_later(self.HEADER_TIMEOUT, self._head_timed_out)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def data_received(self, data: bytes) -> None:
        self._got_bytes = True
        super().data_received(data)
        if self._timer is not None and self.cycle is not self._seen:
            self._disarm()  # a request's head arrived in time

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _head_timed_out(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not self._seen or not (self.cycle is None or
                                                self.cycle.response_complete):
            return  # a request is being served (e.g. one pipelined behind the last)
        if self._got_bytes:
            self.transport.write(raw_error(
                408, "Request Timeout", f"the request line and headers did not arrive "
                f"within {self.HEADER_TIMEOUT:g} s (--header-timeout)",
                code="request_timeout"))
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        # h11 refused the bytes (bad Content-Length, header too long, not HTTP): the
        # same JSON shape as every other error, then close as uvicorn does.
        self._disarm()
        self.transport.write(raw_error(400, "Bad Request", "invalid HTTP request (a malformed "
                                       "request line, header or Content-Length, or headers "
                                       "over --max-header-bytes)"))
        self.transport.close()
