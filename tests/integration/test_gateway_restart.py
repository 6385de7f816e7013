"""A gateway that stops (SIGTERM) or is only starting loses no request it took: real processes on a real
nats-server, three gateways in front of one prefill and one decode worker (the rolling restart's two losses, #35).

  - stopping: the streams it serves finish with every token; a new request gets 503 `draining` with Retry-After
    and `Connection: close` (so a client's pool does not send its next request on a connection about to close);
    a request whose body was still arriving at the SIGTERM is served, NATS kept until it ends; exit code 0.
  - starting: its HTTP server is up before NATS; a request in between gets 503 `starting`, not a 502.
The tests run in order: each stops one gateway, the last one left checks the workers for leaks."""
from __future__ import annotations

import asyncio
import json
import signal
import socket
import time

import aiohttp
import pytest

from tools.client import request
from tools.leaks import find_leaks
from tools.nats_server import free_port
from tools.stack import StackSpec, started_stack
from tests.integration.conftest import post_json

BODY = {"prompt": "Tell me a long story about a river city and the people who live by it.", "max_tokens": 200,
        "temperature": 0, "ignore_eos": True, "transfer_mode": "full"}
NUM_STREAMS = 4


@pytest.fixture(scope="module")
def stack(tiny_model_path, tmp_path_factory):
    log_file = tmp_path_factory.mktemp("gateway-restart") / "stack.log"
    spec = StackSpec(model=str(tiny_model_path), num_decode=1, num_gateway=3, gateway_port=free_port(),
                     log_file=log_file, env={"SMARTGEN_KV_CACHE_MB": "32", "SMARTGEN_TORCH_THREADS": "1",
                                             "SMARTGEN_WORKER_TTL_S": "2"})
    with started_stack(spec, 180, may_die={"gateway", "gateway-1", "gateway-2"}) as running:
        yield running


@pytest.fixture(scope="module")
def reference(stack) -> list[int]:
    """BODY's greedy tokens, colocated."""
    status, body = post_json(stack.gateway_urls[2] + "/v1/completions", BODY | {"transfer_mode": "colocated"})
    assert status == 200, body
    return body["smartgen"]["token_ids"]


def assert_no_leaks(url: str, admin_token: str) -> None:
    leaks = find_leaks(url, 10.0, admin_token)
    assert not leaks, leaks


async def _stream(session: aiohttp.ClientSession, url: str, seen: list[int], i: int) -> tuple[list[int], bool]:
    """One streamed completion: its token ids (the final `smartgen` object) and whether [DONE] came."""
    final = None
    async with session.post(url + "/v1/completions", json=BODY | {"stream": True}) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if not line.startswith(b"data: "):
                continue
            if line.strip() == b"data: [DONE]":
                return final["smartgen"]["token_ids"] if final else [], True
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            seen[i] += 1
            final = chunk if "smartgen" in chunk else final
    return [], False


def test_a_stopping_gateway_finishes_its_streams_and_closes_connections_it_refuses_on(stack, reference):
    """SIGTERM mid-way through 4 streams: all 4 complete with their tokens; a new request on a pooled keep-alive
    connection gets 503 `draining`, Retry-After and Connection: close; the process exits 0."""
    url, process = stack.gateway_urls[0], stack.processes["gateway"]

    async def scenario() -> tuple[list, aiohttp.ClientResponse, dict]:
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/v1/models") as warm:  # leaves an idle keep-alive connection in the pool
                assert warm.status == 200
            seen = [0] * NUM_STREAMS
            streams = [asyncio.create_task(_stream(session, url, seen, i)) for i in range(NUM_STREAMS)]
            while min(seen) < 10 and not any(s.done() for s in streams):
                await asyncio.sleep(0.02)
            process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            async with session.post(url + "/v1/completions", json=BODY | {"max_tokens": 4}) as refused:
                body = await refused.json()
            assert not any(s.done() for s in streams), "a stream ended before the drain could be seen"
            return await asyncio.gather(*streams), refused, body

    results, refused, body = asyncio.run(scenario())
    assert refused.status == 503 and body["error"]["code"] == "draining", body
    assert refused.headers.get("Retry-After") == "1"
    assert refused.headers.get("Connection", "").lower() == "close", dict(refused.headers)
    for tokens, done in results:
        assert done and tokens == reference
    assert process.wait(30) == 0
    assert_no_leaks(stack.gateway_urls[2], stack.admin_token)


def test_a_request_whose_body_is_still_arriving_at_the_sigterm_is_served(stack, reference):
    """The drain counts a request from its first byte: one admitted only after the SIGTERM (its body was late)
    still runs on a live NATS connection and gets its tokens (before: NATS closed under it, a 5xx)."""
    url, process = stack.gateway_urls[1], stack.processes["gateway-1"]
    port = int(url.rsplit(":", 1)[1])
    payload = json.dumps(BODY | {"max_tokens": 8}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(head + payload[:10])
        time.sleep(0.5)  # the handler is reading the body
        process.send_signal(signal.SIGTERM)
        time.sleep(1.5)  # an idle gateway would have drained and closed NATS by now
        conn.sendall(payload[10:])
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
    status_line, _, rest = reply.partition(b"\r\n")
    assert b" 200 " in status_line, reply[:600]
    body = json.loads(rest.partition(b"\r\n\r\n")[2])
    assert body["smartgen"]["token_ids"] == reference[:8]
    assert process.wait(30) == 0
    assert_no_leaks(stack.gateway_urls[2], stack.admin_token)


def test_a_starting_gateway_answers_503_until_nats_is_up(stack):
    """A gateway whose NATS server does not answer yet serves HTTP (its address goes into NATS) but refuses
    requests with 503 `starting` and Retry-After (before: a 500, a stream a 502 worker_failed: a request run without NATS)."""
    name = "gateway-2"
    url, process = stack.gateway_urls[2], stack.processes[name]
    process.send_signal(signal.SIGTERM)
    assert process.wait(30) == 0
    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never says a word
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        stack.respawn(name, {"SMARTGEN_NATS_URL": f"nats://127.0.0.1:{silent.getsockname()[1]}"})
        try:
            deadline = time.monotonic() + 60
            while True:  # the first request its HTTP server answers
                assert time.monotonic() < deadline, "the new gateway's HTTP server did not start"
                try:
                    reply = request(url + "/v1/completions", BODY | {"max_tokens": 4}, timeout=10)
                    break
                except OSError:
                    time.sleep(0.05)
        finally:
            stack.processes[name].kill()
            stack.processes[name].wait()
    assert reply.status == 503 and reply.body["error"]["code"] == "starting", reply.body
    assert reply.headers.get("Retry-After") == "1"
