"""The gateway's one error type: an HTTP status with an OpenAI-style error body."""
from __future__ import annotations

from typing import Any

from aiohttp import web

RETRY_AFTER_S = {429: 1, 503: 5}  # a worker at capacity frees up soon; a new worker registers within a heartbeat TTL


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s  # 429/503: the Retry-After header (None = the status's default)

    def body(self) -> dict[str, Any]:
        kind = {400: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error",
                503: "service_unavailable"}.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def error_response(exc: ApiError) -> web.Response:
    """The error as an HTTP response; 429 and 503 with a Retry-After header."""
    retry_after_s = exc.retry_after_s if exc.retry_after_s is not None else RETRY_AFTER_S.get(exc.status)
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return web.json_response(exc.body(), status=exc.status, headers=headers)
