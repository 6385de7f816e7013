"""The gateway killed mid-stream (kill -9: it can abort nothing): the decode worker notices that the gateway's heartbeats
stopped and aborts the request within its gateway TTL, freeing its slab, its ticket and the prefill's lease, long
before the request's max_tokens would have been reached (services/decode/gateway_watch.py)."""
from __future__ import annotations

import os
import signal
import time
import urllib.request

from tools.client import get_json, list_workers, open_stream
from tools.nats_server import free_port
from tools.stack import StackSpec, started_stack
from tests.integration.conftest import NO_FLOOR_ENV

GATEWAY_TTL_S = 2.0


def holdings(admin_url: str) -> dict:
    stats = get_json(admin_url + "/stats")
    return {"active": stats["active_requests"], "pages": stats["kv_pages_in_use"], "leases": stats["leases_open"],
            "tickets": stats["dataplane"]["grants"]}


def test_decode_aborts_a_request_whose_gateway_died_and_frees_everything(tiny_model_path, tmp_path):
    spec = StackSpec(model=str(tiny_model_path), gateway_port=free_port(), log_file=tmp_path / "stack.log",
                     env={"SMARTGEN_KV_CACHE_MB": "32", "SMARTGEN_TORCH_THREADS": "1",
                          "SMARTGEN_GATEWAY_TTL_S": str(GATEWAY_TTL_S), **NO_FLOOR_ENV})
    with started_stack(spec, 120, may_die={"gateway"}) as stack:
        workers = {w["role"]: w for w in list_workers(stack.gateway_url, stack.admin_token)}
        decode, prefill = workers["decode"], workers["prefill"]
        # partial: the prefill keeps the KV under a lease that decode renews while it runs, so the lease's end
        # shows decode let go (an expiry would take lease_s, 30 s)
        body = {"prompt": "Tell me a long story about a river city. " * 6, "max_tokens": 4000, "ignore_eos": True,
                "temperature": 0, "stream": True, "transfer_mode": "partial", "selector": "quest", "kv_budget": 0.25}
        started, count, killed_at = time.monotonic(), 0, None
        try:
            with open_stream(stack.gateway_url + "/v1/completions", body, timeout=60) as events:
                for payload in events:
                    if isinstance(payload, dict) and payload.get("choices"):
                        count += 1
                    if count == 40:
                        assert holdings(prefill["admin_url"])["leases"] == 1  # the request holds a lease meanwhile
                        os.kill(stack.processes["gateway"].pid, signal.SIGKILL)
                        killed_at = time.monotonic()
                        break
        except OSError:  # the connection died with the gateway
            pass
        assert killed_at is not None, "the stream ended before the gateway could be killed"
        rate = count / (killed_at - started)  # tokens per second, prefill included: an underestimate
        held = None
        while time.monotonic() - killed_at < 20:
            held = [holdings(decode["admin_url"]), holdings(prefill["admin_url"])]
            if all(not any(h.values()) for h in held):
                break
            time.sleep(0.2)
        freed_after = time.monotonic() - killed_at
        assert all(not any(h.values()) for h in held), f"still held {freed_after:.1f} s after the kill: {held}"
        assert freed_after < GATEWAY_TTL_S + 4, freed_after  # the TTL, a check period and the release
        left_s = (body["max_tokens"] - count) / rate
        assert freed_after < left_s / 3, (freed_after, left_s)  # long before max_tokens would have been reached
        with urllib.request.urlopen(decode["admin_url"] + "/metrics", timeout=5) as reply:
            assert 'smartgen_requests_total{status="abort"} 1' in reply.read().decode()  # aborted, not finished
