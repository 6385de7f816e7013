"""A stack of real processes (embedded nats-server + five services) on the tiny model, shared by the
integration tests, and a leak check after every test that uses it."""
from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from tools.leaks import find_leaks, get_json  # noqa: F401 (tests import get_json from here)
from tools.nats_server import free_port
from tools.stack import Stack, StackSpec


def post_json(url: str, body: object, timeout: float = 120.0, headers: dict[str, str] | None = None,
              method: str = "POST") -> tuple[int, dict]:
    """(status, JSON body); `headers` e.g. shared.admin_auth.admin_headers(stack.admin_token) for admin routes."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json", **(headers or {})}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def post_sse(url: str, body: dict, timeout: float = 120.0) -> list[dict]:
    """POST with stream=true; returns the parsed `data:` chunks, checking the stream ends with [DONE]."""
    request = urllib.request.Request(url, json.dumps({**body, "stream": True}).encode(), {"Content-Type": "application/json"})
    chunks, done = [], False
    with urllib.request.urlopen(request, timeout=timeout) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        for raw in r:
            line = raw.decode().strip()
            if not line:
                continue
            assert line.startswith("data: "), line
            if line == "data: [DONE]":
                done = True
                continue
            chunks.append(json.loads(line[6:]))
    assert done, "the stream did not end with data: [DONE]"
    return chunks


def model_workers(stack: Stack) -> list[dict]:
    return [w for w in get_json(stack.gateway_url + "/workers")["workers"] if w["role"] in ("prefill", "decode")]


def assert_no_leaks(stack: Stack, timeout_s: float = 10.0) -> None:
    """Every prefill and decode worker holds no request, no page, no lease and no ticket; the broker holds no
    open transfer plan (tools/leaks.py)."""
    leaks = find_leaks(stack.gateway_url, timeout_s)
    if leaks:
        pytest.fail(f"leak check: workers still hold request state: {leaks}")


@pytest.fixture(scope="session")
def stack(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory):
    """The whole system on the tiny model: NATS, gateway, broker, kvprofile, 1 prefill, 1 decode."""
    log_file = tmp_path_factory.mktemp("logs") / "stack.log"
    spec = StackSpec(model=str(tiny_model_path), gateway_port=free_port(), log_file=log_file,
                     env={"SMARTGEN_KV_CACHE_MB": "64", "SMARTGEN_TORCH_THREADS": "1"})
    with Stack(spec) as running:
        try:
            running.wait_ready(180)
        except Exception:
            print(log_file.read_text()[-5000:])
            raise
        yield running
    if running.dead():
        print(log_file.read_text()[-5000:])


@pytest.fixture
def clean_stack(stack: Stack):
    """The shared stack, checked for leaks after the test."""
    yield stack
    assert not stack.dead(), f"services died: {stack.dead()}"
    assert_no_leaks(stack)
