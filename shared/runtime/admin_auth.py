"""The admin token: who may use the admin routes that change state.

Every service's admin server (shared/runtime/service.py build_admin_app) runs `require_admin_token`: GET and HEAD
are open (health, metrics, stats), as are a service's public paths (the gateway's OpenAI API, /v1/…);
any other method needs `Authorization: Bearer <token>`, the token set by SMARTGEN_ADMIN_TOKEN or
SMARTGEN_ADMIN_TOKEN_FILE. Without a configured token those routes answer 403: off until someone turns
them on. Clients send `admin_headers(token)`.
"""
from __future__ import annotations

import hmac
import os
import typing
from typing import Awaitable, Callable

from aiohttp import web

from shared.runtime.config import ServiceConfig

SAFE_METHODS = ("GET", "HEAD")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def require_admin_token(token: str, public_prefixes: tuple[str, ...] = (),
                        private_reads: tuple[str, ...] = ()) -> Callable:
    """aiohttp middleware: state-changing requests need the bearer `token` ("" = refuse them all), and so do reads
    of the `private_reads` paths (what shows pids and internal addresses, the gateway's /workers)."""
    expected = token.encode()

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        is_unrouted = request.match_info.http_exception is not None  # aiohttp answers 404/405 as usual
        is_open_read = request.method in SAFE_METHODS and request.path not in private_reads
        if is_open_read or request.path.startswith(public_prefixes) or is_unrouted:
            return await handler(request)
        if not expected:
            return web.json_response(
                {"error": f"{request.method} {request.path} changes state and this service has no admin token: "
                          "start it with SMARTGEN_ADMIN_TOKEN or SMARTGEN_ADMIN_TOKEN_FILE set"}, status=403)
        scheme, _, sent = request.headers.get("Authorization", "").partition(" ")
        # NOTE: compare_digest takes as long for a near miss as for a wild guess
        if scheme.lower() != "bearer" or not hmac.compare_digest(sent.strip().encode(), expected):
            return web.json_response(
                {"error": f"{request.method} {request.path} needs 'Authorization: Bearer <admin token>', the token "
                          "set by SMARTGEN_ADMIN_TOKEN or SMARTGEN_ADMIN_TOKEN_FILE"},
                status=401, headers={"WWW-Authenticate": 'Bearer realm="smartgen-admin"'})
        return await handler(request)

    return check


def admin_headers(token: str) -> dict[str, str]:
    """Request headers that carry the admin token ({} without one: the server then answers 403)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def admin_token_from_env(env: typing.Mapping[str, str] | None = None) -> str:
    """The admin token a client should send: SMARTGEN_ADMIN_TOKEN, else the file SMARTGEN_ADMIN_TOKEN_FILE, else ""."""
    env = os.environ if env is None else env
    config = ServiceConfig(admin_token=env.get("SMARTGEN_ADMIN_TOKEN", ""),
                           admin_token_file=env.get("SMARTGEN_ADMIN_TOKEN_FILE", ""))
    config.read_secret_files()  # the same reading (and errors) as a service's
    return config.admin_token
