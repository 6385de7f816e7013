"""The gateway's admission queue on a real stack: a decode worker that takes one request at a time, a queue of
one. Three requests at once: one runs, one waits its turn and completes (its wait reported), one is told to
come back (429 with Retry-After) without touching a worker; /metrics shows the queue."""
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
