"""A worker killed mid-request: the client learns at once (within the heartbeat TTL), not after a timeout,
and the surviving worker holds nothing afterwards."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tools.client import list_workers, open_stream
from tools.nats_server import free_port
from tools.stack import StackSpec, started_stack
from tests.integration.conftest import get_json, post_json


# NOTE: full mode under recompute (the whole answer equal to colocated's, through two kills): test_migration.py
@pytest.mark.parametrize("mode", ["smartgen"])
def test_under_recompute_a_request_outlives_its_decode_worker(tiny_model_path, tmp_path, mode):
    """failure_policy `recompute`, two decode workers, kill -9 of the one streaming: the client sees one
    continuous stream with every token, and the response names the worker it lost; nothing stays held on the
    workers left. Dense (full), the tokens are colocated decoding's greedy tokens; with a selector the new worker
    replays the streamed tokens densely in one forward, so only the tokens before the kill must be the selective
    run's (services/decode: DecodeEngine.recompute)."""
    from tests.integration.conftest import NO_FLOOR_ENV, assert_no_leaks

    spec = StackSpec(model=str(tiny_model_path), num_decode=2, gateway_port=free_port(), log_file=tmp_path / "stack.log",
                     env={"SMARTGEN_KV_CACHE_MB": "32", "SMARTGEN_TORCH_THREADS": "1", "SMARTGEN_WORKER_TTL_S": "2",
                          **NO_FLOOR_ENV})
    with started_stack(spec, 120, may_die={"decode-0", "decode-1"}) as stack:
        url = stack.gateway_url
        body = {"prompt": "Tell me a long story about a river city. " * 6, "max_tokens": 120, "ignore_eos": True,
                "temperature": 0, "transfer_mode": mode, "failure_policy": "recompute"}
        if mode == "smartgen":
            body |= {"selector": "quest", "kv_budget": 0.25, "kv_bits": 0}  # exact KV: colocated's tokens
        _, reference = post_json(url + "/v1/completions", {k: v for k, v in body.items() if k != "kv_bits"}
                                 | {"transfer_mode": "colocated", "stream": False})
        tokens, final, killed = [], None, None
        with open_stream(url + "/v1/completions", body, timeout=120) as events:
            for payload in events:
                if not isinstance(payload, dict):
                    break
                assert "error" not in payload, payload["error"]
                if payload["choices"] and payload["choices"][0].get("finish_reason") is None:
                    tokens.append(payload)
                final = payload.get("smartgen", final)
                if len(tokens) == 20 and killed is None:
                    killed = next(w for w in list_workers(url, stack.admin_token)  # asked now, not from heartbeats
                                  if w["role"] == "decode" and get_json(w["admin_url"] + "/stats")["active_requests"])
                    os.kill(killed["pid"], signal.SIGKILL)
        assert killed is not None and final is not None
        expected = reference["smartgen"]["token_ids"]
        assert len(final["token_ids"]) == 120 and final["token_ids"][:20] == expected[:20]
        if mode == "full":
            assert final["token_ids"] == expected
        assert final["resumed_from"] == [killed["id"]] and final["recomputed"]
        assert final["decode_worker_id"] != killed["id"]
        assert_no_leaks(stack)


def test_under_recompute_a_decode_worker_lost_between_open_and_generate_is_replaced(tiny_model_path, tmp_path):
    """failure_policy `recompute`: the decode worker that reserved the request's KV dies while the prefill runs
    (the prefill is held with SIGSTOP so the kill lands there), so nobody answers `generate`; the request starts
    over on the other decode worker, colocated, with colocated's greedy tokens, and nothing is left held."""
    from tests.integration.conftest import assert_no_leaks

    spec = StackSpec(model=str(tiny_model_path), num_decode=2, gateway_port=free_port(), log_file=tmp_path / "stack.log",
                     env={"SMARTGEN_KV_CACHE_MB": "32", "SMARTGEN_TORCH_THREADS": "1", "SMARTGEN_WORKER_TTL_S": "2"})
    with started_stack(spec, 120, may_die={"decode-0", "decode-1"}) as stack:
        url = stack.gateway_url
        body = {"prompt": "Tell me a long story about a river city. " * 6, "max_tokens": 40, "ignore_eos": True,
                "temperature": 0, "transfer_mode": "full", "failure_policy": "recompute"}
        _, reference = post_json(url + "/v1/completions", body | {"transfer_mode": "colocated"})
        workers = list_workers(url, stack.admin_token)
        prefill = next(w for w in workers if w["role"] == "prefill")
        broker = next(w for w in workers if w["role"] == "broker")
        decodes = [w for w in workers if w["role"] == "decode"]
        os.kill(prefill["pid"], signal.SIGSTOP)
        try:
            asking, answer = ask_in_background(url, body)
            reserved = decode_holding_a_reservation(decodes)
            wait_until(lambda: plan_opened(broker), 10, "the broker opened the plan (decode's open was answered)")
            os.kill(reserved["pid"], signal.SIGKILL)
        finally:
            os.kill(prefill["pid"], signal.SIGCONT)
        asking.join(60)
        assert answer.get("status") == 200, answer
        final = answer["body"]["smartgen"]
        assert final["token_ids"] == reference["smartgen"]["token_ids"]
        assert final["resumed_from"] == [reserved["id"]] and final["recomputed"]
        assert final["decode_worker_id"] != reserved["id"]
        assert_no_leaks(stack)


def test_under_fail_a_decode_worker_lost_during_the_prefill_is_told_at_once(tiny_model_path, tmp_path):
    """failure_policy `fail`: the decode worker holding the reservation dies while the prompt is still being
    prefilled (held 20 s by fault injection, the prefill alive and heartbeating): the client's error names it
    within the heartbeat TTL, not after the prefill, and the prefill's KV is freed."""
    from tests.integration.conftest import assert_no_leaks
    from tests.integration.fault_helpers import admin_post

    spec = StackSpec(model=str(tiny_model_path), num_decode=2, gateway_port=free_port(), log_file=tmp_path / "stack.log",
                     env={"SMARTGEN_KV_CACHE_MB": "32", "SMARTGEN_TORCH_THREADS": "1", "SMARTGEN_WORKER_TTL_S": "2",
                          "SMARTGEN_FAULT_INJECTION": "1"})
    with started_stack(spec, 120, may_die={"decode-0", "decode-1"}) as stack:
        url = stack.gateway_url
        workers = list_workers(url, stack.admin_token)
        prefill = next(w for w in workers if w["role"] == "prefill")
        decodes = [w for w in workers if w["role"] == "decode"]
        admin_post(stack, prefill, "/fault", {"kind": "slow_prefill", "delay_s": 20})
        body = {"prompt": "Tell me a story.", "max_tokens": 8, "temperature": 0, "transfer_mode": "full"}
        asking, answer = ask_in_background(url, body)
        # NOTE: once the prefill holds the request, the decode worker's `open` has been answered: a kill before that
        # reply is another case (test_a_decode_worker_lost_before_answering_open_is_passed_over_at_once)
        wait_until(lambda: get_json(prefill["admin_url"] + "/stats")["active_requests"] > 0, 10, "the prefill began")
        reserved = decode_holding_a_reservation(decodes)
        os.kill(reserved["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        asking.join(30)
        told_after = time.monotonic() - killed_at
        assert answer.get("status") == 502 and reserved["id"] in answer["body"]["error"]["message"], answer
        assert told_after < 6, told_after  # the TTL is 2 s; the prefill still had ~20 s to go
        admin_post(stack, prefill, "/fault", {"kind": "clear"})
        assert_no_leaks(stack)


def test_a_decode_worker_lost_before_answering_open_is_passed_over_at_once(tiny_model_path, tmp_path):
    """The decode worker dies after reserving the request's KV but before its `open` reply (held there by fault
    injection): the gateway notices within the heartbeat TTL, not its 10 s open timeout, and the request completes
    on the other decode worker."""
    from tests.integration.conftest import assert_no_leaks
    from tests.integration.fault_helpers import admin_post

    spec = StackSpec(model=str(tiny_model_path), num_decode=2, gateway_port=free_port(), log_file=tmp_path / "stack.log",
                     env={"SMARTGEN_KV_CACHE_MB": "32", "SMARTGEN_TORCH_THREADS": "1", "SMARTGEN_WORKER_TTL_S": "2",
                          "SMARTGEN_FAULT_INJECTION": "1"})
    with started_stack(spec, 120, may_die={"decode-0", "decode-1"}) as stack:
        url = stack.gateway_url
        decodes = [w for w in list_workers(url, stack.admin_token) if w["role"] == "decode"]
        for decode in decodes:
            admin_post(stack, decode, "/fault", {"kind": "slow_open", "delay_s": 30})
        body = {"prompt": "Tell me a story.", "max_tokens": 8, "temperature": 0, "transfer_mode": "full"}
        asking, answer = ask_in_background(url, body)
        reserved = decode_holding_a_reservation(decodes)
        other = next(w for w in decodes if w["id"] != reserved["id"])
        os.kill(reserved["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        admin_post(stack, other, "/fault", {"kind": "clear"})  # the gateway asks it only once the TTL has passed
        asking.join(30)
        answered_after = time.monotonic() - killed_at
        assert answer.get("status") == 200, answer
        assert answer["body"]["smartgen"]["decode_worker_id"] == other["id"]
        assert answered_after < 6, answered_after  # the TTL is 2 s; the open call's timeout is 10 s
        assert_no_leaks(stack)


def ask_in_background(url: str, body: dict) -> tuple[threading.Thread, dict]:
    """POST a completion from a thread; the dict gets its `status` and `body` when it answers."""
    answer: dict = {}
    asking = threading.Thread(target=lambda: answer.update(
        zip(("status", "body"), post_json(url + "/v1/completions", body, timeout=60))))
    asking.start()
    return asking, answer


def plan_opened(broker: dict) -> bool:
    """The broker holds a live plan: the gateway asked it after the decode worker answered `open` (a decode
    killed before that answer is a different case: the gateway passes it over for another decode worker)."""
    return bool(get_json(broker["admin_url"] + "/transfers")["live"])


def wait_until(ready, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(0.05)


def decode_holding_a_reservation(decodes: list[dict], timeout_s: float = 10) -> dict:
    """The decode worker (of `decodes`, from /workers) that has opened a request, asked of each directly."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for w in decodes:
            if get_json(w["admin_url"] + "/stats")["active_requests"]:
                return w
        time.sleep(0.05)
    raise AssertionError("no decode worker reserved the request's KV")

