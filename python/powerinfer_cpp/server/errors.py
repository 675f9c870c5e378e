"""Errors as OpenAI answers them: {"error": {message, type, param, code}} with a 4xx/5xx.

Used by the routes, by the middleware in front of them and by the connection layer below
them (which writes raw bytes), so that every reply the server makes has this shape."""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse


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
