"""The OpenAI API's key (GatewayConfig.api_key, SMARTGEN_API_KEY or SMARTGEN_API_KEY_FILE, --api-key): when set,
every request under /v1 needs `Authorization: Bearer <key>` (what the openai SDK sends as its api_key), compared
in constant time, or gets OpenAI's 401 body. The rest of the gateway's port (/health, /metrics, /openapi.json)
stays open; /workers needs the admin token (shared/runtime/admin_auth.py)."""
from __future__ import annotations

import hmac
from collections.abc import Callable

from aiohttp import web

API_PREFIX = "/v1"


def unauthorized(message: str) -> web.Response:
    """OpenAI's answer to a missing or wrong key."""
    return web.json_response({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                        "code": "invalid_api_key"}}, status=401,
                             headers={"WWW-Authenticate": 'Bearer realm="smartgen"'})


def require_api_key(key: str) -> Callable:
    """aiohttp middleware: /v1 requests need the bearer `key` ("" = no key: open)."""
    expected = key.encode()

    @web.middleware
    async def check(request: web.Request, handler) -> web.StreamResponse:
        if not expected or not (request.path == API_PREFIX or request.path.startswith(API_PREFIX + "/")):
            return await handler(request)
        scheme, _, sent = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not sent.strip():
            return unauthorized("You didn't provide an API key: send it as 'Authorization: Bearer <key>' (the "
                                "openai SDK's api_key).")
        # NOTE: compare_digest takes as long for a near miss as for a wild guess
        if not hmac.compare_digest(sent.strip().encode(), expected):
            return unauthorized("Incorrect API key provided.")
        return await handler(request)

    return check
