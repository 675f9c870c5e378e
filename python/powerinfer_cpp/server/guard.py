"""ASGI middleware in front of every route: who may ask, and how much.

In this order, each refusal an OpenAI-style JSON error:
- Host: only the names this server is reached by (loopback names, the bound address,
  --allow-host); a DNS-rebinding page, whose Host is its own domain, gets 403 before it
  can read a reply or /metrics. Off when bound to all interfaces (0.0.0.0 / ::), where
  the names are not known (and the startup warns without --api-key).
- Origin: a browser's request from another site gets 403 unless --allow-origin names
  it (then it gets the CORS headers to read the reply); the server's own page is
  same-origin.
- the API key (Bearer) on /v1 and /metrics, when one is set;
- POST bodies: Content-Type application/json (a cross-site form or text/plain POST,
  which a browser sends without asking, is 415), at most --max-body bytes (413, checked
  while reading, so a chunked upload cannot pass it), arriving within --body-timeout
  (408).
An exception escaping a route becomes a JSON 500 (not Starlette's plain text), and every
request is counted in /metrics.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from urllib.parse import urlsplit

from fastapi.responses import Response

from .errors import error_response

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
ALL_INTERFACES = frozenset({"0.0.0.0", "::", ""})

log = logging.getLogger("uvicorn.error")


def host_name(value: str) -> str:
    """The name in a Host header or an authority: no port, no brackets, lower case."""
    value = value.strip().lower()
    if value.startswith("["):  # [::1]:8080
        return value[1:value.find("]")] if "]" in value else value
    if value.count(":") == 1:
        value = value.split(":", 1)[0]
    return value.rstrip(".")


class Guard:
    OPEN = ("/", "/health")

    def __init__(self, app, server):
        self.app, self.server = app, server
        s = server.settings
        extra = {host_name(h) for h in s.allow_hosts}
        self.any_host = "*" in s.allow_hosts or s.host in ALL_INTERFACES
        self.hosts = LOOPBACK_NAMES | {host_name(s.host)} | extra
        self.any_origin = "*" in s.allow_origins
        self.origins = {o.rstrip("/").lower() for o in s.allow_origins}

    def host_allowed(self, host: str) -> bool:
        return self.any_host or not host or host_name(host) in self.hosts

    def foreign_origin(self, origin: str, host: str) -> bool:
        """True for an Origin other than this server's own page and not allowed by flag."""
        if not origin:
            return False
        o = origin.rstrip("/").lower()
        if self.any_origin or o in self.origins:
            return False
        parts = urlsplit(o)
        return not (parts.scheme in ("http", "https") and parts.netloc == host.strip().lower())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        s = self.server.settings
        seen = {}
        host = _header(scope, b"host")
        origin = _header(scope, b"origin")
        cors = origin and not self.foreign_origin(origin, host) and \
            urlsplit(origin.lower()).netloc != host.strip().lower()

        async def counting_send(message):
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
                if cors:  # an origin allowed by flag may read the reply
                    message = dict(message)
                    message["headers"] = list(message.get("headers", [])) + [
                        (b"access-control-allow-origin", origin.encode("latin-1")),
                        (b"vary", b"Origin")]
            await send(message)

        async def reply(resp):
            return await resp(scope, receive, counting_send)

        try:
            if not self.host_allowed(host):
                return await reply(error_response(
                    403, f"Host '{host}' is not a name this server answers to (allow it with "
                    f"--allow-host {host_name(host)})", code="host_not_allowed"))
            if origin and self.foreign_origin(origin, host):
                return await reply(error_response(
                    403, f"cross-origin request from '{origin}' refused (allow it with "
                    f"--allow-origin {origin})", code="origin_not_allowed"))
            method = scope.get("method")
            if method == "OPTIONS" and cors:
                return await reply(_preflight())
            if s.api_key and path not in self.OPEN and not path.startswith("/static/"):
                auth = _header(scope, b"authorization")
                token = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
                if not hmac.compare_digest(token.encode(), s.api_key.encode()):
                    return await reply(error_response(
                        401, "Incorrect API key provided (send it as 'Authorization: Bearer "
                        "KEY')", code="invalid_api_key"))
            length = _header(scope, b"content-length")
            if length.isdigit() and int(length) > s.max_body:
                return await reply(_too_large(s.max_body))
            if method in ("POST", "PUT", "PATCH"):
                ctype = _header(scope, b"content-type").split(";", 1)[0].strip().lower()
                if ctype != "application/json":
                    return await reply(error_response(
                        415, f"the request body must be sent as Content-Type: application/json"
                        f" (got {ctype or 'none'}; with curl: -H 'Content-Type: "
                        "application/json')", code="unsupported_media_type"))
                body = await self._read_body(receive, s)
                if not isinstance(body, bytes):
                    return await reply(body) if body is not None else None
                replayed = False

                async def replay():
                    nonlocal replayed
                    if not replayed:
                        replayed = True
                        return {"type": "http.request", "body": body, "more_body": False}
                    return await receive()

                return await self._run(scope, replay, counting_send, seen)
            return await self._run(scope, receive, counting_send, seen)
        finally:
            self.server.metrics.count(path, seen.get("status", 0))

    async def _run(self, scope, receive, send, seen):
        try:
            await self.app(scope, receive, send)
        except Exception:
            log.exception("error in %s %s", scope.get("method"), scope.get("path"))
            if "status" in seen:
                raise  # the reply had begun: only closing the connection is left
            await error_response(500, "internal server error (see the server's log)",
                                 type="server_error")(scope, receive, send)

    async def _read_body(self, receive, s):
        """The whole body (bytes), an error response, or None when the client left."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + s.body_timeout
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                return error_response(408, f"the request body did not arrive within "
                                      f"{s.body_timeout:g} s (--body-timeout)",
                                      code="request_timeout", headers={"Connection": "close"})
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > s.max_body:
                return _too_large(s.max_body)
            chunks.append(chunk)
            if not message.get("more_body"):
                return b"".join(chunks)


def _preflight():
    return Response(status_code=204, headers={
        "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
        "Access-Control-Allow-Headers": "Authorization, Content-Type",
        "Access-Control-Max-Age": "600"})


def _too_large(limit: int):
    return error_response(413, f"the request body is larger than this server's limit of "
                          f"{limit} bytes", code="request_too_large")


def _header(scope, name: bytes) -> str:
    for k, v in scope.get("headers", ()):
        if k.lower() == name:
            return v.decode("latin-1")
    return ""
