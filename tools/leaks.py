"""The stack's leak check, asked of a running gateway: after every request has ended, each prefill and decode
worker holds no request, no KV page, no lease and no data-plane ticket, and the broker holds no open transfer
plan. Used after each integration test (tests/integration/conftest.py) and after `smartgen loadtest`.
"""
from __future__ import annotations

import time

from tools.client import get_json, list_workers


def leaks_now(gateway_url: str, admin_token: str = "") -> dict[str, dict]:
    """Worker id → what it still holds, for every worker that holds anything (empty = clean)."""
    leaks: dict[str, dict] = {}
    for w in list_workers(gateway_url, admin_token):
        if w["role"] in ("prefill", "decode"):
            s = get_json(w["admin_url"] + "/stats")
            held = s.get("prefix_cache", {}).get("pages_held", 0)  # prefix cache pages a request still holds
            if s["active_requests"] or s["kv_pages_in_use"] or s["leases_open"] or s["dataplane"]["grants"] or held:
                leaks[w["id"]] = {k: s[k] for k in ("active_requests", "kv_pages_in_use", "leases_open", "request_ids")}
                leaks[w["id"]]["tickets"] = s["dataplane"]["grants"]
                leaks[w["id"]]["prefix_cache_pages_held"] = held
        elif w["role"] == "broker":
            live = get_json(w["admin_url"] + "/transfers")["live"]
            if live:
                leaks[w["id"]] = {"live_plans": [(p["request_id"], p["state"]) for p in live]}
    return leaks


def find_leaks(gateway_url: str, timeout_s: float = 10.0, admin_token: str = "") -> dict[str, dict]:
    """`leaks_now`, asked again every 0.1 s until it is empty or `timeout_s` has passed (aborts and releases
    are asynchronous: a worker may still be freeing a request that ended a moment ago)."""
    deadline = time.monotonic() + timeout_s
    while True:
        leaks = leaks_now(gateway_url, admin_token)
        if not leaks or time.monotonic() > deadline:
            return leaks
        time.sleep(0.1)
