"""Errors as OpenAI answers them: {"error": {message, type, param, code}} with a 4xx/5xx.

Used by the routes, by the middleware in front of them and by the connection layer below
them (which writes raw bytes), so that every reply the server makes has this shape."""

from __future__ import annotations

import json

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class APIError(Exception):
    """An error answered as OpenAI does: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (status, message, type,
                                                                       param, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def error_response(status: int, message: str, type: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    """An OpenAI-style error as a JSON response."""
    return JSONResponse(APIError(status, message, type, param, code).body(), status_code=status,
                        headers=headers)


def raw_error(status: int, reason: str, message: str, code: str | None = None) -> bytes:
    """A whole HTTP/1.1 response carrying an OpenAI-style error, closing the connection:
    for the connection layer, which answers before any request reached the app."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = json.dumps(APIError(status, message, kind, None, code).body()).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("latin-1") + body


def as_api_error(e: BaseException) -> APIError:
    """A generation's failure as the error its reply carries: a bad argument 400, the rest 500."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, (ValueError, TypeError)):
        return APIError(400, str(e))
    return APIError(500, f"generation failed: {e}", type="server_error")


def add_handlers(app) -> None:
    """Answer every error the app meets in this shape: ours, a body that fails its model's
    validation, and Starlette's own (404, 405, ...)."""

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            return error_response(400, f"the request body is not valid JSON: "
                                  f"{first.get('ctx', {}).get('error', first.get('msg'))}")
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        msg = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}"
                        f": {e.get('msg')}" for e in errs[:5])
        return error_response(400, f"invalid request: {msg}", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), type=kind)
