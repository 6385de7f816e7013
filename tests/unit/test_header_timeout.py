"""Slowloris: a client that trickles its request headers is cut off `header_timeout_s` after it connected, however
steadily the bytes come, while a client that sends a whole request is answered (the server every service runs,
shared/runtime/service.py http_runner, on a real socket)."""
from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web

from shared.runtime.config import ConfigError, ServiceConfig
from shared.runtime.service import Service, http_runner

HEADER_TIMEOUT_S = 0.6


class Bare(Service):
    role = "test"


async def serve() -> tuple[web.AppRunner, int]:
    runner = http_runner(Bare(ServiceConfig(header_timeout_s=HEADER_TIMEOUT_S)))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


async def test_a_client_trickling_its_headers_is_closed_after_the_header_timeout():
    runner, port = await serve()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        started = time.monotonic()
        writer.write(b"GET /live HTTP/1.1\r\nHost: x\r\n")
        closed_after = None
        for i in range(40):  # a header line every 0.1 s, never the blank line that ends them: 4 s if not cut off
            try:
                writer.write(b"X-Slow-%d: y\r\n" % i)
                await writer.drain()
                if await asyncio.wait_for(reader.read(1), 0.1) == b"":  # EOF: the server closed it
                    closed_after = time.monotonic() - started
                    break
            except asyncio.TimeoutError:
                continue
            except ConnectionError:
                closed_after = time.monotonic() - started
                break
        writer.close()
        assert closed_after is not None, "the server kept a connection whose headers never ended"
        assert HEADER_TIMEOUT_S * 0.8 < closed_after < HEADER_TIMEOUT_S + 1.0, closed_after
    finally:
        await runner.cleanup()


async def test_a_whole_request_is_answered_and_bad_settings_are_refused():
    runner, port = await serve()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 200") and b'"live": true' in answer
    finally:
        await runner.cleanup()
    with pytest.raises(ConfigError, match="header_timeout_s"):
        ServiceConfig(header_timeout_s=0).validate()
