"""A gateway with no workers says so: /health is 503 and a completion is a 503, not a hang."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from tools.nats_server import free_port
from tests.integration.conftest import get_json, post_json


def test_gateway_without_workers_answers_503(nats_server, tiny_model_path):
    """No prefill or decode registered: /health 503 naming what is missing; requests get 503 at once."""
    port = free_port()
    env = {**os.environ, **nats_server.client_env(), "SMARTGEN_MODEL": str(tiny_model_path),
           "SMARTGEN_GATEWAY_PORT": str(port)}
    gateway = subprocess.Popen([sys.executable, "-m", "services.gateway"], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                health = get_json(url + "/health")
                if health["status"] != "nats_disconnected":  # its HTTP port can answer before NATS connects
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline and gateway.poll() is None
            time.sleep(0.2)
        assert health["_status"] == 503 and "no prefill or decode or broker worker" in health["status"]
        started = time.monotonic()
        status, body = post_json(url + "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 503 and body["error"]["code"] == "no_worker"
        assert time.monotonic() - started < 2
    finally:
        gateway.terminate()
        assert gateway.wait(15) == 0


def test_transport_rdma_without_a_device_stops_with_the_fix(nats_server, tiny_model_path):
    """A worker told to use RDMA on a machine without it exits at once with a message naming the fix."""
    env = {**os.environ, **nats_server.client_env(), "SMARTGEN_MODEL": str(tiny_model_path),
           "SMARTGEN_TRANSPORT": "rdma", "SMARTGEN_KV_CACHE_MB": "16"}
    result = subprocess.run([sys.executable, "-m", "services.decode"], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0
    assert "transport 'rdma'" in result.stderr and "tcp" in result.stderr
    assert "Traceback" not in result.stderr
