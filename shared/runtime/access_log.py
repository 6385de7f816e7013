"""The access log of every service's HTTP server (the gateway's OpenAI API included): one JSON event per request,
`http_request`, with its method, path, status, duration and, where the reply carries one, its request id."""
from __future__ import annotations

import logging

import structlog
from aiohttp.abc import AbstractAccessLogger
from aiohttp.web import BaseRequest, StreamResponse

REQUEST_ID_HEADER = "X-Request-Id"  # the gateway's replies carry it (services/gateway/api.py)
log = structlog.get_logger()


class JsonAccessLogger(AbstractAccessLogger):
    """aiohttp's `access_log_class`: AppRunner(app, access_log_class=JsonAccessLogger, access_log=<a logger>)."""

    def log(self, request: BaseRequest, response: StreamResponse, time: float) -> None:
        request_id = response.headers.get(REQUEST_ID_HEADER) or request.headers.get(REQUEST_ID_HEADER)
        log.info("http_request", method=request.method, path=request.path, status=response.status,
                 duration_ms=round(time * 1000, 2), remote=request.remote, **({"request_id": request_id} if request_id else {}))

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.INFO)
