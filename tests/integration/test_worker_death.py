"""A worker killed mid-request: the client learns at once (within the heartbeat TTL), not after a timeout,
and the surviving worker holds nothing afterwards."""
from __future__ import annotations

import os
import signal
import time

import pytest

from tools.client import open_stream
from tools.nats_server import free_port
from tools.stack import StackSpec, started_stack
from tests.integration.conftest import get_json


@pytest.fixture
def own_stack(tiny_model_path, tmp_path):
    spec = StackSpec(model=str(tiny_model_path), gateway_port=free_port(), log_file=tmp_path / "stack.log",
                     env={"SMARTGEN_KV_CACHE_MB": "32", "SMARTGEN_TORCH_THREADS": "1", "SMARTGEN_WORKER_TTL_S": "2"})
    with started_stack(spec, 120, may_die={"decode-0"}) as stack:  # the test kills the decode worker
        yield stack


def test_decode_killed_mid_stream_ends_the_stream_with_an_error(own_stack):
    """kill -9 of the decode worker while it streams: an error event reaches the client within a few seconds."""
    decode = next(w for w in get_json(own_stack.gateway_url + "/workers")["workers"] if w["role"] == "decode")
    body = {"prompt": "Tell me a long story.", "max_tokens": 3000, "temperature": 0, "stream": True,
            "transfer_mode": "full"}
    chunks, killed_at, error = 0, None, None
    with open_stream(own_stack.gateway_url + "/v1/completions", body, timeout=60) as events:
        for payload in events:
            if not isinstance(payload, dict):  # [DONE]
                continue
            if "error" in payload:
                error = payload["error"]
                break
            chunks += 1
            if chunks == 5:
                os.kill(decode["pid"], signal.SIGKILL)
                killed_at = time.monotonic()
    assert killed_at is not None, "the stream ended before the kill"
    assert error is not None and decode["id"] in error["message"]
    assert time.monotonic() - killed_at < 6
    prefill = next(w for w in get_json(own_stack.gateway_url + "/workers")["workers"] if w["role"] == "prefill")
    stats = get_json(prefill["admin_url"] + "/stats")
    assert stats["active_requests"] == 0 and stats["kv_pages_in_use"] == 0
