"""The gateway's admission queue on a real stack: a decode worker that takes one request at a time, a queue of
one. Three requests at once: one runs, one waits its turn and completes (its wait reported), one is told to
come back (429 with Retry-After) without touching a worker; /metrics shows the queue. And a stream nobody reads
frees its slot when its generation ends, not when its text is finally read."""
from __future__ import annotations

import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.integration.conftest import assert_no_leaks, get_json, post_json
from tools.client import request
from tools.nats_server import free_port
from tools.stack import StackSpec, started_stack


def test_requests_beyond_capacity_queue_in_order_and_beyond_the_queue_get_429(tiny_model_path: Path, tmp_path: Path):
    spec = StackSpec(model=str(tiny_model_path), gateway_port=free_port(), log_file=tmp_path / "stack.log",
                     env={"SMARTGEN_KV_CACHE_MB": "32", "SMARTGEN_MAX_ACTIVE_REQUESTS": "1",
                          "SMARTGEN_MAX_WAITING": "1", "SMARTGEN_QUEUE_TIMEOUT_S": "60"})
    with started_stack(spec, 180) as stack:
        url = stack.gateway_url
        assert get_json(url + "/stats")["capacity"] == 1  # what the decode worker says it takes
        body = {"prompt": "Tell me about rivers. " * 20, "max_tokens": 400, "ignore_eos": True, "temperature": 0,
                "transfer_mode": "colocated"}

        def send(delay: float):
            import time
            time.sleep(delay)
            return post_json(url + "/v1/completions", body, timeout=120)

        with ThreadPoolExecutor(3) as pool:
            first, second = pool.submit(send, 0.0), pool.submit(send, 0.1)
            third = request(url + "/v1/completions", body, timeout=30) if not wait_for_waiting(url) else None
            results = [first.result(), second.result()]
        assert third is not None and third.status == 429, third
        assert third.headers.get("Retry-After") == "1" and third.body["error"]["code"] == "overloaded"
        (s1, r1), (s2, r2) = results
        assert s1 == s2 == 200, (r1, r2)
        # the second waited for the whole of the first, less the 0.1 s it was sent later
        assert r1["smartgen"]["queue_s"] < 0.05 and r2["smartgen"]["queue_s"] > 0.3, \
            (r1["smartgen"]["queue_s"], r2["smartgen"]["queue_s"])
        with urllib.request.urlopen(url + "/metrics") as reply:
            metrics = reply.read().decode()
        assert "smartgen_queue_seconds_count 2.0" in metrics and "smartgen_requests_waiting 0.0" in metrics
        assert_no_leaks(stack)


def wait_for_waiting(url: str) -> bool:
    """Until one request waits in the gateway's queue (False), or 10 s pass (True: it never did)."""
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if get_json(url + "/stats")["waiting"] == 1:
            return False
        time.sleep(0.02)
    return True


def test_a_stream_nobody_reads_gives_its_slot_back_when_its_generation_ends(tiny_model_path: Path, tmp_path: Path):
    """Capacity one. A stream whose client reads nothing (a 4 KB receive window, ~500 KB of logprobs chunks: the
    gateway's writes block long before the end) finishes generating and gives the slot back at once; a second
    request then runs without waiting for the unread text, and the first stream is still whole when read later."""
    import json
    import socket
    import time
    from urllib.parse import urlparse

    spec = StackSpec(model=str(tiny_model_path), gateway_port=free_port(), log_file=tmp_path / "stack.log",
                     env={"SMARTGEN_KV_CACHE_MB": "32", "SMARTGEN_MAX_ACTIVE_REQUESTS": "1",
                          "SMARTGEN_MAX_WAITING": "1", "SMARTGEN_QUEUE_TIMEOUT_S": "60"})
    with started_stack(spec, 180) as stack:
        url = stack.gateway_url
        where = urlparse(url)
        body = json.dumps({"prompt": "Tell me about rivers.", "max_tokens": 600, "ignore_eos": True, "temperature": 0,
                           "logprobs": 20, "stream": True, "transfer_mode": "colocated"}).encode()
        reader = socket.socket()
        # before connect: a small window, and small segments, so the gateway's kernel does not size its send buffer
        # for loopback's 64 KB segments (it would take the whole ~0.6 MB answer)
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        reader.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
        reader.connect((where.hostname, where.port))
        reader.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
        try:
            # its generation ends while nobody reads, and its slot is free well before sse.py's write timeout (30 s)
            # would drop the reader (which is what freed it before the slot covered generation only)
            deadline, stats = time.monotonic() + 15, {}
            while time.monotonic() < deadline and (stats := get_json(url + "/stats"))["running"] != 0:
                time.sleep(0.1)
            assert stats["running"] == 0 and stats["waiting"] == 0, stats
            status, second = post_json(url + "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0,
                                                                  "transfer_mode": "colocated"}, timeout=60)
            assert status == 200 and second["smartgen"]["queue_s"] < 0.5, second
            reader.settimeout(30)
            received = b""
            while chunk := reader.recv(1 << 16):
                received += chunk
        finally:
            reader.close()
        assert len(received) > 200_000, len(received)  # far more than the buffers between gateway and reader hold
        head, _, rest = received.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"chunked" in head.lower(), head
        text = b""
        while (size := int(rest.split(b"\r\n", 1)[0], 16)) > 0:  # the chunked body, de-chunked
            text += rest.split(b"\r\n", 1)[1][:size]
            rest = rest.split(b"\r\n", 1)[1][size + 2:]
        events = [json.loads(line[6:]) for line in text.decode().splitlines() if line.startswith("data: {")]
        tokens = [t for e in events for c in e.get("choices", []) for t in (c.get("logprobs") or {}).get("tokens", [])]
        assert len(tokens) == 600 and text.rstrip().endswith(b"data: [DONE]"), (len(tokens), text[-200:])
        assert_no_leaks(stack)
