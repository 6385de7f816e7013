"""tools/client.py's `request` against a server whose error is not JSON (a bare 500, a proxy's page): the status and
the text come back as a Reply, not a JSONDecodeError the caller did not expect (it failed a test's retry loop)."""
from __future__ import annotations

import asyncio
import http.server
import threading

from tools.client import get_json, request


class _Bare500(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        body = b"500 Internal Server Error\n\nServer got itself in trouble"
        self.send_response(500)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


async def test_a_non_json_error_body_comes_back_as_its_text():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Bare500)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/profiles"
        reply = await asyncio.to_thread(request, url, timeout=5)
        assert reply.status == 500 and reply.body == {"error": "500 Internal Server Error\n\nServer got itself in trouble"}
        assert (await asyncio.to_thread(get_json, url))["_status"] == 500
    finally:
        server.shutdown()
        server.server_close()
