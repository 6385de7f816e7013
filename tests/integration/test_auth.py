"""Authentication and exposure on real processes: the embedded NATS refuses clients without the token, admin
routes that change state want the admin token, no secret reaches a log, /stats or a command line, every
listener of the stack is on loopback, and NATS over TLS works with a CA file and a client certificate."""
from __future__ import annotations

import json
import shutil
import socket
import urllib.request
from pathlib import Path

import nats
import psutil
import pytest

from shared.runtime.admin_auth import admin_headers
from shared.runtime.config import ServiceConfig
from tools.nats_server import NatsServer
from shared.runtime.natsconn import connect_options
from tools.stack import Stack
from tests.certificates import make_certificates
from tests.integration.conftest import get_json, list_workers, model_workers, post_json


def nats_handshake(host: str, port: int, connect: dict) -> tuple[dict, str]:
    """Speak NATS by hand: the server's INFO, then its first answer to CONNECT + PING (PONG or -ERR)."""
    with socket.create_connection((host, port), timeout=5) as sock:
        lines = sock.makefile("rb")
        info = json.loads(lines.readline().decode().removeprefix("INFO "))
        sock.sendall(f"CONNECT {json.dumps({'verbose': False, **connect})}\r\nPING\r\n".encode())
        return info, lines.readline().decode().strip()


def test_embedded_nats_refuses_clients_without_the_token(stack: Stack):
    """The stack's nats-server asks for auth and answers a CONNECT without or with a wrong token with an
    authorization error; the right token gets PONG, and every service is connected with it."""
    assert stack.nats is not None
    info, answer = nats_handshake(stack.nats.host, stack.nats.port, {})
    assert info["auth_required"] is True
    assert "Authorization Violation" in answer
    assert "Authorization Violation" in nats_handshake(stack.nats.host, stack.nats.port, {"auth_token": "wrong"})[1]
    assert nats_handshake(stack.nats.host, stack.nats.port, {"auth_token": stack.nats.token})[1] == "PONG"
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.nats.monitor_port}/connz") as r:
        names = {c.get("name", "").split("-")[0] for c in json.load(r)["connections"]}
    assert names >= {"gateway", "prefill", "decode", "broker", "kvprofile"}


async def test_nats_clients_need_the_token(stack: Stack):
    """nats-py without the token cannot connect; with the stack's options (the shared helper) it can."""
    with pytest.raises(Exception):
        await nats.connect(stack.nats_url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
    nc = await nats.connect(**stack.nats_options(), allow_reconnect=False, connect_timeout=2)
    try:
        assert nc.is_connected
    finally:
        await nc.close()


def test_admin_routes_that_change_state_need_the_admin_token(clean_stack: Stack):
    """POST /link without a token, with a wrong one or another scheme is 401 and leaves the link unpaced; with
    the stack's token it paces; kvprofile's DELETE and POST are guarded too; GETs and /v1 stay open."""
    worker = next(w for w in model_workers(clean_stack) if w["role"] == "decode")
    link_gbps = lambda: get_json(worker["admin_url"] + "/stats")["dataplane"]["link_gbps"]  # noqa: E731
    assert link_gbps() == 0
    for headers in ({}, admin_headers("wrong-token"), {"Authorization": f"Basic {clean_stack.admin_token}"}):
        status, body = post_json(worker["admin_url"] + "/link", {"gbps": 3.0}, headers=headers)
        assert status == 401 and "SMARTGEN_ADMIN_TOKEN" in body["error"], (status, body)
    assert link_gbps() == 0
    try:
        status, body = post_json(worker["admin_url"] + "/link", {"gbps": 3.0}, headers=admin_headers(clean_stack.admin_token))
        assert status == 200 and link_gbps() == 3.0, body
    finally:
        post_json(worker["admin_url"] + "/link", {"gbps": 0}, headers=admin_headers(clean_stack.admin_token))
    assert link_gbps() == 0
    kvprofile = next(w for w in list_workers(clean_stack.gateway_url, clean_stack.admin_token) if w["role"] == "kvprofile")
    assert post_json(kvprofile["admin_url"] + "/profiles/no-such-key", b"", method="DELETE")[0] == 401
    assert post_json(kvprofile["admin_url"] + "/profiles/build", {"selector": "quest"})[0] == 401
    assert post_json(kvprofile["admin_url"] + "/profiles/no-such-key", b"", method="DELETE",
                     headers=admin_headers(clean_stack.admin_token))[0] == 404  # past the check: no such profile
    assert get_json(kvprofile["admin_url"] + "/profiles").get("_status") is None
    status, _ = post_json(clean_stack.gateway_url + "/v1/completions", {"prompt": "Hi", "max_tokens": 1})
    assert status == 200


def test_no_secret_in_logs_stats_or_command_lines(stack: Stack):
    """Neither the NATS token nor the admin token appears in the stack's log (which does have each service's
    service_started line), the nats-server log, any /stats, or any process's command line."""
    assert stack.nats is not None and stack.spec.log_file is not None
    tokens = (stack.nats.token, stack.admin_token)
    log = stack.spec.log_file.read_text()
    started = [json.loads(line) for line in log.splitlines() if '"event": "service_started"' in line]
    assert len(started) >= 5 and all(s["nats_auth"] == "token" and s["admin_token_set"] for s in started)
    texts = [log, stack.nats.log_path.read_text()]
    for w in list_workers(stack.gateway_url, stack.admin_token):
        texts.append(json.dumps(get_json(w["admin_url"] + "/stats")))
    for p in [*stack.processes.values(), stack.nats.process]:
        texts.append(" ".join(psutil.Process(p.pid).cmdline()))
    for text in texts:
        assert not any(t in text for t in tokens), text[:300]


def test_every_listener_binds_loopback(stack: Stack):
    """Every listening socket of the stack's processes (gateway API, admin ports, data planes, NATS and its
    monitor) is on 127.0.0.1, and each of those listeners is there."""
    assert stack.nats is not None
    pids = [p.pid for p in stack.processes.values()] + [stack.nats.process.pid]
    listening = [c.laddr for pid in pids for c in psutil.Process(pid).net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN]
    assert all(addr.ip in ("127.0.0.1", "::1") for addr in listening), listening
    expected = {stack.spec.gateway_port, stack.nats.port, stack.nats.monitor_port}
    for w in list_workers(stack.gateway_url, stack.admin_token):
        expected.add(int(w["admin_url"].rsplit(":", 1)[1]))
        if w["dataplane_addr"]:
            expected.add(int(w["dataplane_addr"].rsplit(":", 1)[1]))
    assert len(expected) >= 9  # gateway, 4 admin ports, 2 data planes, NATS client and monitor
    assert expected <= {addr.port for addr in listening}


async def test_nats_over_tls_with_a_ca_and_a_client_certificate(tmp_path: Path):
    """Against a nats-server that wants TLS and client certificates, the shared connect options (CA file, client
    pair, token) connect; without the client pair the server refuses."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make test certificates")
    pem = make_certificates(tmp_path)
    args = ["--tlsverify", "--tlscert", str(pem["server.pem"]), "--tlskey", str(pem["server.key"]),
            "--tlscacert", str(pem["ca.pem"])]
    with NatsServer(args=args) as server:
        config = ServiceConfig(nats_url=server.url, nats_token=server.token, nats_tls_ca=str(pem["ca.pem"]),
                               nats_tls_cert=str(pem["client.pem"]), nats_tls_key=str(pem["client.key"]))
        config.validate()
        nc = await nats.connect(**connect_options(config), name="tls-client", allow_reconnect=False, connect_timeout=3)
        try:
            await nc.flush()
            with urllib.request.urlopen(f"http://127.0.0.1:{server.monitor_port}/connz") as r:
                connections = json.load(r)["connections"]
            assert [c.get("tls_version") for c in connections if c.get("name") == "tls-client"][0]
        finally:
            await nc.close()
        no_pair = ServiceConfig(nats_url=server.url, nats_token=server.token, nats_tls_ca=str(pem["ca.pem"]))
        with pytest.raises(Exception):
            await nats.connect(**connect_options(no_pair), allow_reconnect=False, max_reconnect_attempts=0,
                               connect_timeout=3)


def test_workers_needs_the_admin_token(stack: Stack):
    """GET /workers shows pids and internal addresses: without the admin token (or with a wrong one) it is a 401,
    with it the list."""
    for headers in ({}, admin_headers("not-the-token")):
        assert get_json(stack.gateway_url + "/workers", headers=headers)["_status"] == 401
    assert {w["role"] for w in list_workers(stack.gateway_url, stack.admin_token)} >= {"prefill", "decode"}


def test_the_api_key_guards_v1_and_nothing_else(tiny_model_path: Path, tmp_path: Path):
    """A stack whose gateway has an API key (from a file, as docker secrets give it): /v1 without it or with a
    wrong one is OpenAI's 401 with `invalid_api_key`; the openai SDK with the key completes; /health and
    /openapi.json stay open. Refusals count in /metrics, aiohttp's own 413 (a body past max_body_mb) too."""
    import openai

    from tools.nats_server import free_port
    from tools.stack import StackSpec, started_stack

    key_file = tmp_path / "api-key"
    key_file.write_text("sk-test-123\n")
    key_file.chmod(0o600)
    spec = StackSpec(model=str(tiny_model_path), gateway_port=free_port(), log_file=tmp_path / "stack.log",
                     env={"SMARTGEN_KV_CACHE_MB": "32", "SMARTGEN_TORCH_THREADS": "1",
                          "SMARTGEN_API_KEY_FILE": str(key_file)})
    with started_stack(spec, 120) as keyed:
        url = keyed.gateway_url
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "Basic sk-test-123"}):
            reply = get_json(url + "/v1/models", headers=headers)
            assert reply["_status"] == 401 and reply["error"]["code"] == "invalid_api_key", reply
        status, body = post_json(url + "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert status == 401 and body["error"]["type"] == "invalid_request_error"
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-test-123")
        assert client.completions.create(model=client.models.list().data[0].id, prompt="Hi", max_tokens=2,
                                         temperature=0).choices[0].text is not None
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong").models.list()
        assert get_json(url + "/health").get("status") == "ok" and "paths" in get_json(url + "/openapi.json")
        too_large = b'{"prompt": "' + b"x" * (4 << 20) + b'", "max_tokens": 1}'  # past max_body_mb (4 MB): aiohttp's 413
        status, body = post_json(url + "/v1/completions", too_large, headers={"Authorization": "Bearer sk-test-123"})
        assert status == 413, body
        metrics = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
        assert 'smartgen_api_refusals_total{code="invalid_api_key",status="401"} 5.0' in metrics, metrics[-2000:]
        assert 'smartgen_api_refusals_total{code="413",status="413"} 1.0' in metrics, metrics[-2000:]
        assert "sk-test-123" not in (tmp_path / "stack.log").read_text()
