"""A stack of real processes (embedded nats-server + five services) on the tiny model, shared by the
integration tests, and a leak check after every test that uses it."""
from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest

from shared.nats_server import free_port
from shared.stack import Stack, StackSpec


def get_json(url: str, timeout: float = 5.0) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.load(r)
    except urllib.error.HTTPError as exc:
        return {"_status": exc.code, **json.load(exc)}


def post_json(url: str, body: object, timeout: float = 120.0) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
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
    open transfer plan."""
    deadline = time.monotonic() + timeout_s
    while True:
        leaks = {}
        for w in model_workers(stack):
            s = get_json(w["admin_url"] + "/stats")
            if s["active_requests"] or s["kv_pages_in_use"] or s["leases_open"] or s["dataplane"]["grants"]:
                leaks[w["id"]] = {k: s[k] for k in ("active_requests", "kv_pages_in_use", "leases_open", "request_ids")}
                leaks[w["id"]]["tickets"] = s["dataplane"]["grants"]
        for w in get_json(stack.gateway_url + "/workers")["workers"]:
            if w["role"] == "broker":
                live = get_json(w["admin_url"] + "/transfers")["live"]
                if live:
                    leaks[w["id"]] = {"live_plans": [(p["request_id"], p["state"]) for p in live]}
        if not leaks:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"leak check: workers still hold request state: {leaks}")
        time.sleep(0.1)


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
