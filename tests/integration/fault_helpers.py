"""The fault tests' stack settings, their workers and their requests (test_faults.py; other tests pause, pace
and break workers with admin_post, worker and pace too). Every check adds a row to the fault matrix (MATRIX)."""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

from shared.runtime.admin_auth import admin_headers
from tools.client import list_workers, open_stream, post_json, request
from tools.leaks import find_leaks
from tools.stack import Stack
from tests.integration.conftest import NO_FLOOR_ENV, get_json

# ~200 tokens: 1 KiB of KV per token on the tiny model, ~1.6 s to push on a link paced to 1 Mbit/s
PROMPT = "The history of the city begins with a small settlement on the river, where traders met. " * 11
SLOW_GBPS = 0.001
TTL_S = 3.0  # the gateway's and broker's heartbeat TTL here
LEASE_S = 1.0  # the prefill's lease here (decode keeps it every third of that)
ENV = {"SMARTGEN_KV_CACHE_MB": "1", "SMARTGEN_TORCH_THREADS": "1", "SMARTGEN_FAULT_INJECTION": "1",
       "SMARTGEN_HEARTBEAT_S": "0.5", "SMARTGEN_WORKER_TTL_S": str(TTL_S), "SMARTGEN_LEASE_S": str(LEASE_S),
       "SMARTGEN_KV_TIMEOUT_S": "30", "SMARTGEN_REQUEST_TIMEOUT_S": "30", "SMARTGEN_PUSH_TIMEOUT_S": "20", **NO_FLOOR_ENV,
       # a full-mode push here moves the whole prompt (test_prefill_killed_mid_transfer kills the prefill while it
       # crawls; a decode-side hit left 3.5 KB to push and the kill came late); that cache: test_decode_prefix_cache.py
       "SMARTGEN_DECODE_PREFIX_CACHE_MB": "0"}
# exact KV (kv_bits 0; smartgen moves K8V8 codes by default), so the tokens are colocated selective's, bit for bit
SELECTIVE = {"transfer_mode": "smartgen", "kv_bits": 0, "selector": "quest", "kv_budget": 0.1, "ablate": ["proactive", "background"]}
MATRIX: list[dict] = []
KILLED: set[str] = set()  # services a test killed and left dead on purpose



def worker(stack: Stack, role: str, timeout_s: float = 10.0) -> dict:
    """The gateway's entry for the worker of `role` (waiting for it: one paused by a test before may not have
    heartbeated again yet)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = [w for w in list_workers(stack.gateway_url, stack.admin_token) if w["role"] == role]
        if found or time.monotonic() > deadline:
            assert found, f"no {role} worker listed"
            return found[0]
        time.sleep(0.1)


def admin_post(stack: Stack, w: dict, path: str, body: dict) -> dict:
    """POST `body` to a worker's admin route with the stack's admin token: the reply (RuntimeError unless 2xx)."""
    status, reply = post_json(w["admin_url"] + path, body, 10, admin_headers(stack.admin_token))
    if not 200 <= status < 300:
        raise RuntimeError(f"POST {path} to {w['id']}: {status} {reply}")
    return reply


def pace(stack: Stack, role: str, gbps: float) -> None:
    """Pace `role`'s data plane (0 = unpaced): full-mode pushes then crawl, so a fault lands mid-transfer."""
    admin_post(stack, worker(stack, role), "/link", {"gbps": gbps})


def wait_forgotten(stack: Stack, worker_id: str) -> None:
    """Until the gateway has dropped a killed worker (its heartbeats stopped a TTL ago)."""
    deadline = time.monotonic() + TTL_S + 5
    while any(w["id"] == worker_id for w in list_workers(stack.gateway_url, stack.admin_token)):
        assert time.monotonic() < deadline, f"the gateway still lists {worker_id}"
        time.sleep(0.1)


def wait_healthy(stack: Stack, timeout_s: float = 30.0) -> None:
    """Until the gateway sees a worker of every role again (a paused worker is forgotten until it heartbeats)."""
    deadline = time.monotonic() + timeout_s
    while get_json(stack.gateway_url + "/health").get("status") != "ok":
        assert time.monotonic() < deadline, f"the stack did not recover: {get_json(stack.gateway_url + '/health')}"
        time.sleep(0.1)


def check_after(stack: Stack, fault: str, outcomes: list[tuple[str, float | None]]) -> None:
    """The leak check (and that no service died but those killed on purpose), then one matrix row per outcome."""
    if not KILLED:
        wait_healthy(stack)
    leaks = find_leaks(stack.gateway_url, 15.0, stack.admin_token)
    dead = sorted(set(stack.dead()) - KILLED)
    for saw, time_to_error_s in outcomes:
        row = {"fault": fault, "client_saw": saw,
               "time_to_error_s": None if time_to_error_s is None else round(time_to_error_s, 2),
               "leaks": leaks or "none"}
        MATRIX.append(row)
        print(f"FAULT MATRIX | {fault} | {saw} | {row['time_to_error_s']} | {row['leaks']}")
    assert not leaks, f"leak check after {fault}: {leaks}"
    assert not dead, f"services died after {fault}: {dead}"


# --- requests ------------------------------------------------------------------------------------------------
def complete(stack: Stack, timeout_s: float = 60.0, **body) -> tuple[int, dict, dict]:
    """POST /v1/completions (not streamed): (status, body, headers)."""
    reply = request(stack.gateway_url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, **body},
                    timeout=timeout_s)
    return reply.status, reply.body, reply.headers


class Stream(threading.Thread):
    """One streamed completion, read in the background: its `data:` items with their arrival times."""

    def __init__(self, stack: Stack, **body):
        super().__init__(daemon=True)
        self.url = stack.gateway_url + "/v1/completions"
        self.body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, **body, "stream": True}
        self.items: list[tuple[float, dict | str]] = []
        self.status: int | None = None
        self.http_error: dict | None = None
        self.failure: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            with open_stream(self.url, self.body, timeout=60) as events:
                self.status = events.status  # the headers go out with token 1
                for item in events:
                    self.items.append((time.monotonic(), item))
                    if item == "[DONE]":
                        break
        except urllib.error.HTTPError as exc:
            self.status, self.http_error = exc.code, json.load(exc)
        except BaseException as exc:  # noqa: BLE001 (reported by the test)
            self.failure = exc

    def wait_started(self, timeout_s: float = 30.0) -> None:
        """Until the response has begun, which the gateway does at token 1 (its text may still be empty): the
        prefill has answered and the decode worker has the request."""
        deadline = time.monotonic() + timeout_s
        while self.status is None:
            assert self.is_alive() and time.monotonic() < deadline, f"the stream did not start: {self.failure!r}"
            time.sleep(0.005)

    def wait_for(self, chunks: int, timeout_s: float = 30.0) -> None:
        """Until `chunks` token chunks have arrived."""
        deadline = time.monotonic() + timeout_s
        while sum(isinstance(i, dict) and "choices" in i for _, i in list(self.items)) < chunks:
            assert self.is_alive() and time.monotonic() < deadline, f"{chunks} chunks did not stream: {self.items[-2:]}"
            time.sleep(0.005)

    def result(self, timeout_s: float) -> "Stream":
        self.join(timeout_s)
        assert not self.is_alive(), f"the stream did not end within {timeout_s} s (a hang)"
        assert self.failure is None, f"the stream broke: {self.failure!r}"
        return self

    @property
    def error(self) -> tuple[float, dict] | None:
        """(arrival, error object) of the stream's error event, or of the HTTP error."""
        if self.http_error is not None:
            return time.monotonic(), self.http_error["error"]
        return next(((t, i["error"]) for t, i in self.items if isinstance(i, dict) and "error" in i), None)

    @property
    def smartgen(self) -> dict | None:
        return next((i["smartgen"] for _, i in reversed(self.items) if isinstance(i, dict) and "smartgen" in i), None)

    @property
    def is_done(self) -> bool:
        return bool(self.items) and self.items[-1][1] == "[DONE]"


def outcome_of(stream: Stream, since: float, expected: list[int] | None = None) -> tuple[str, float | None]:
    """What the client saw, in words, and how long after `since` an error arrived (None: it did not fail)."""
    error = stream.error
    if error is not None:
        at, err = error
        return f"{stream.status}, error event: {err['message'][:160]}", at - since
    sg = stream.smartgen or {"token_ids": []}
    saw = f"{stream.status}, completed: {len(sg['token_ids'])} tokens"
    if expected is not None and sg["token_ids"] == expected:
        saw += " = colocated"
    if sg.get("recomputed"):
        saw += f", recomputed ({sg['recompute_reason'][:120]})"
    return saw, None


def assert_error_event(stream: Stream, *words: str) -> None:
    """An error event naming the cause, then [DONE]."""
    assert stream.error is not None, f"no error event: {stream.items[-3:]}"
    message = stream.error[1]["message"]
    assert any(w in message for w in words), message
    assert stream.is_done, "the stream did not end with [DONE]"


def assert_recomputed(stream: Stream, expected: list[int]) -> None:
    """Completed, with the colocated tokens, and saying it recomputed."""
    assert stream.error is None, stream.error
    sg = stream.smartgen
    assert sg is not None and sg["token_ids"] == expected, (sg and sg["token_ids"], expected)
    assert sg["recomputed"] is True and sg["recompute_reason"] and sg["failure_policy"] == "recompute"


