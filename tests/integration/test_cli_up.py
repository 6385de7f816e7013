"""`smartgen up` as a user runs it: replicas come up, the API answers, Ctrl-C stops everything cleanly."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from tools.nats_server import free_port
from tools.stack import REPO_ROOT
from tests.integration.conftest import get_json, list_workers, post_json

ADMIN_TOKEN = "cli-test-admin-token"  # `smartgen up` takes SMARTGEN_ADMIN_TOKEN as its stack's; GET /workers needs it


def start_up(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    # NOTE: `python -m tools.cli` from this checkout, not the `smartgen` script: that one runs the installed copy
    # (another worktree's code). A process group of its own, as a shell gives a foreground job: Ctrl-C signals the
    # whole group
    # (and without the suite's fork server: `smartgen up` as a user runs it, each service a fresh interpreter)
    cold = {k: v for k, v in os.environ.items() if k != "SMARTGEN_FORKSERVER"}
    return subprocess.Popen([sys.executable, "-m", "tools.cli", "up", *args], cwd=REPO_ROOT,
                            env={**cold, "SMARTGEN_ADMIN_TOKEN": ADMIN_TOKEN, **env}, stdout=log.open("wb"),
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def wait_for_workers(url: str, roles: dict[str, int], proc: subprocess.Popen, log: Path, timeout_s: float = 120) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            workers = list_workers(url, ADMIN_TOKEN)
            if all(sum(w["role"] == r for w in workers) >= n for r, n in roles.items()) \
                    and get_json(url + "/health").get("status") == "ok":
                return workers
        except OSError:
            pass
        time.sleep(0.3)
    pytest.fail(f"stack not up in {timeout_s} s: {log.read_text()[-3000:]}")


def interrupt_and_check_clean_exit(proc: subprocess.Popen, log: Path) -> None:
    """Ctrl-C in the terminal: SIGINT to the foreground process group, not only to `smartgen up` (when it reached
    every process at once, NATS went first and each service's drain failed: exit 1 after a 10 s timeout)."""
    children = psutil.Process(proc.pid).children(recursive=True)
    assert len(children) >= 5
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(60) == 0, log.read_text()[-3000:]
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"left running after Ctrl-C: {alive}"
    text = log.read_text()
    assert '"stack_stopped"' in text and "Traceback" not in text, text[-3000:]


def test_up_with_replicas_serves_and_stops_cleanly(tiny_model_path, tmp_path):
    """`smartgen up --prefill 2 --decode 1` on an embedded NATS: both prefill replicas register, requests
    are spread over them; then `smartgen up` killed outright leaves nothing running. (SIGINT's clean exit: the
    other tests here.)"""
    port = free_port()
    log = tmp_path / "up.log"
    proc = start_up(["--prefill", "2", "--decode", "1", "--model", str(tiny_model_path), "--port", str(port)],
                    {"SMARTGEN_KV_CACHE_MB": "32", "SMARTGEN_NATS_URL": ""}, log)
    try:
        url = f"http://127.0.0.1:{port}"
        workers = wait_for_workers(url, {"prefill": 2, "decode": 1, "broker": 1, "kvprofile": 1}, proc, log)
        assert sum(w["role"] == "prefill" for w in workers) == 2
        warmed = {w["id"]: get_json(w["admin_url"] + "/stats")["prefill_rates"] for w in workers if w["role"] == "prefill"}
        assert all(len(rates) == 1 and rates[0][1] > 0 for rates in warmed.values()), warmed  # the warm-up's
        used = set()
        for _ in range(4):
            status, body = post_json(url + "/v1/completions", {"prompt": "Hi there", "max_tokens": 3, "temperature": 0})
            assert status == 200, body
            worker_id = body["smartgen"]["prefill_worker_id"]
            if worker_id not in used:  # its first plan: made with the rate the worker measured at start
                assert body["smartgen"]["plan"]["prefill_tokens_per_s"] == pytest.approx(warmed[worker_id][0][1]), \
                    body["smartgen"]
            used.add(worker_id)
        assert len(used) == 2, "the gateway should spread requests over both prefill workers"
        check_concurrent_smartgen(url)
        check_short_chat_is_dense(url)
        secrets = check_exported_secrets(log, workers)
        assert not any(secret in log.read_text() for secret in secrets), "a token reached the output"
        check_a_killed_up_leaves_nothing_running(proc)
    finally:
        if proc.poll() is None:
            proc.kill()


def check_a_killed_up_leaves_nothing_running(proc: subprocess.Popen) -> None:
    """`smartgen up` killed outright (SIGKILL: no chance to stop its children): its services and its NATS server
    still exit (each was started to die with its parent), so nothing keeps the ports or the KV memory."""
    children = psutil.Process(proc.pid).children(recursive=True)
    assert len(children) >= 7  # NATS and the five services, two of them prefill replicas
    proc.kill()
    proc.wait()
    _, alive = psutil.wait_procs(children, timeout=20)
    assert not alive, f"left running after smartgen up was killed: {[p.cmdline()[:3] for p in alive]}"


def check_exported_secrets(log: Path, workers: list[dict]) -> list[str]:
    """`smartgen up` prints where this run's tokens are (files of mode 0600), not the tokens; the admin token
    from that file paces a worker's link. Returns the tokens."""
    from shared.runtime.admin_auth import admin_headers

    exported = next(e for e in map(json.loads, log.read_text().splitlines()) if e["event"] == "stack_client_env")["env"]
    files = [Path(exported["SMARTGEN_NATS_TOKEN_FILE"]), Path(exported["SMARTGEN_ADMIN_TOKEN_FILE"])]
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in files)
    secrets = [f.read_text() for f in files]
    prefill = next(w for w in workers if w["role"] == "prefill")
    for gbps in (5.0, 0):
        status, body = post_json(prefill["admin_url"] + "/link", {"gbps": gbps}, headers=admin_headers(secrets[1]))
        assert status == 200, body
    return secrets


def check_concurrent_smartgen(url: str) -> None:
    """Three smartgen requests at once: one decode worker serves them together, each with its own plan and
    prefill worker, and each gives the tokens of the same selector with all KV local."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [f"Request {i}: the river city grew from a settlement where traders met. " * 20 for i in range(3)]
    body = {"max_tokens": 8, "temperature": 0, "selector": "quest", "kv_budget": 0.1}
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda p: post_json(url + "/v1/completions", body | {"prompt": p, "transfer_mode": "smartgen"}),
                                prompts))
    for prompt, (status, reply) in zip(prompts, results):
        assert status == 200, reply
        _, local = post_json(url + "/v1/completions", body | {"prompt": prompt, "transfer_mode": "colocated"})
        assert reply["smartgen"]["token_ids"] == local["smartgen"]["token_ids"]
    assert len({r["smartgen"]["prefill_worker_id"] for _, r in results}) == 2


def check_short_chat_is_dense(url: str) -> None:
    """Under the budget floor a short chat decodes densely in every mode: the same tokens as colocated dense
    attention (a 10% budget of a 38-token context is 4 tokens, which once answered garbage)."""
    body = {"messages": [{"role": "user", "content": "Write a haiku about slow networks."}], "max_tokens": 12,
            "temperature": 0}
    _, dense = post_json(url + "/v1/chat/completions", body | {"transfer_mode": "colocated"})
    for mode in ("colocated", "partial", "smartgen"):
        status, reply = post_json(url + "/v1/chat/completions", body | {"transfer_mode": mode, "selector": "quest"})
        assert status == 200, reply
        assert reply["smartgen"]["token_ids"] == dense["smartgen"]["token_ids"], mode
        assert reply["smartgen"]["selected_share"] == 1.0, mode


def test_up_uses_an_existing_nats_server(tiny_model_path, tmp_path, nats_server):
    """With SMARTGEN_NATS_URL set, `smartgen up` starts no NATS of its own and every service joins that one."""
    port = free_port()
    log = tmp_path / "up.log"
    proc = start_up(["--model", str(tiny_model_path), "--port", str(port)],
                    {"SMARTGEN_KV_CACHE_MB": "32", **nats_server.client_env()}, log)
    try:
        wait_for_workers(f"http://127.0.0.1:{port}", {"prefill": 1, "decode": 1}, proc, log)
        with urllib.request.urlopen(f"http://127.0.0.1:{nats_server.monitor_port}/connz") as r:
            names = {c.get("name", "") for c in json.load(r)["connections"]}
        assert {n.split("-")[0] for n in names if n} >= {"gateway", "prefill", "decode", "broker", "kvprofile"}
        assert not any(p.name() == "nats-server" for p in psutil.Process(proc.pid).children(recursive=True))
        interrupt_and_check_clean_exit(proc, log)
    finally:
        if proc.poll() is None:
            proc.kill()


def service_process(proc: subprocess.Popen, role: str) -> psutil.Process:
    return next(p for p in psutil.Process(proc.pid).children(recursive=True)
                if f"services.{role}" in " ".join(p.cmdline()))


def test_up_restarts_a_dead_worker_while_the_rest_keep_serving(tiny_model_path, tmp_path):
    """`kill -9` of one of two decode workers: `smartgen up` says so and starts it again after its backoff; the
    gateway serves meanwhile from the other replica, both are back afterwards, the new process counts its
    restart in /metrics, and Ctrl-C still stops everything with exit code 0."""
    port = free_port()
    log = tmp_path / "up.log"
    proc = start_up(["--decode", "2", "--model", str(tiny_model_path), "--port", str(port)],
                    {"SMARTGEN_KV_CACHE_MB": "32", "SMARTGEN_NATS_URL": ""}, log)
    try:
        url = f"http://127.0.0.1:{port}"
        workers = wait_for_workers(url, {"prefill": 1, "decode": 2, "broker": 1, "kvprofile": 1}, proc, log)
        victim = service_process(proc, "decode")
        victim.kill()
        deadline = time.monotonic() + 30
        while "restarting it in" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "exited (killed by SIGKILL)" in log.read_text(), log.read_text()[-3000:]
        for _ in range(3):  # whatever the registry knows yet, requests keep being answered
            status, body = post_json(url + "/v1/completions", {"prompt": "Hi there", "max_tokens": 3, "temperature": 0})
            assert status == 200 or "decode" in json.dumps(body), body
        before = {w["id"] for w in workers if w["role"] == "decode"}
        deadline = time.monotonic() + 60
        while True:  # until the replacement has registered and the dead one has left the registry
            after = wait_for_workers(url, {"decode": 2}, proc, log)
            restarted = [w for w in after if w["role"] == "decode" and w["id"] not in before]
            if restarted and sum(w["role"] == "decode" for w in after) == 2:
                break
            assert time.monotonic() < deadline, f"the dead decode worker was not replaced: {after}"
            time.sleep(0.5)
        status, body = post_json(url + "/v1/completions", {"prompt": "Hi there", "max_tokens": 3, "temperature": 0})
        assert status == 200, body
        with urllib.request.urlopen(restarted[0]["admin_url"] + "/metrics") as r:
            assert "smartgen_service_restarts 1.0" in r.read().decode()
        interrupt_and_check_clean_exit(proc, log)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_up_gives_up_on_a_service_that_keeps_dying_at_start(tiny_model_path, tmp_path):
    """A setting that kills the model workers at start-up: `smartgen up` restarts them a few times, then stops
    the stack with exit code 1 and a message naming the service and its exit code, and leaves nothing running."""
    log = tmp_path / "up.log"
    proc = start_up(["--model", str(tiny_model_path), "--port", str(free_port())],
                    {"SMARTGEN_KV_CACHE_MB": "-1", "SMARTGEN_NATS_URL": "", "SMARTGEN_RESTART_BACKOFF_S": "0.5,1"}, log)
    try:
        assert proc.wait(120) == 1, log.read_text()[-3000:]
        text = log.read_text()
        assert "giving up" in text and "3 times in a row" in text and "exit code" in text, text[-3000:]
        assert "no prefill replica is left" in text or "no decode replica is left" in text, text[-3000:]
        assert "restarting it in 0.5 s (restart 1)" in text and "restarting it in 1 s (restart 2)" in text
        assert '"stack_stopped"' in text and "Traceback" not in text, text[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
