"""The stack with `dataplane_agent` on: every model worker's TCP data plane runs in a transfer agent process over
its KV arena in shared memory. Tokens are those of the in-process plane, bytes move on every path, nothing is
left behind, and no agent outlives its worker."""
from __future__ import annotations

import os
import time
from pathlib import Path

from tools.nats_server import free_port
from tools.stack import StackSpec, started_stack
from tests.integration.conftest import NO_FLOOR_ENV, assert_no_leaks, get_json, model_workers, post_json
from tests.integration.test_smartgen import LINK_GBPS, PROMPT


def complete(url: str, **body) -> dict:
    status, reply = post_json(url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, **body},
                              timeout=120)
    assert status == 200, reply
    return reply["smartgen"]


def is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_transfer_agents_move_the_kv_and_go_with_their_workers(tmp_path: Path, tiny8_model_path: Path):
    model = tiny8_model_path
    spec = StackSpec(model=str(model), gateway_port=free_port(), log_file=tmp_path / "stack.log",
                     env={"SMARTGEN_KV_CACHE_MB": "64", "SMARTGEN_TORCH_THREADS": "1", **NO_FLOOR_ENV,
                          "SMARTGEN_LINK_GBPS": str(LINK_GBPS), "SMARTGEN_DATAPLANE_AGENT": "true",
                          "SMARTGEN_BACKGROUND_IF_IT_CAN_FINISH": "false"})
    with started_stack(spec, 180) as stack:
        agents = [get_json(w["admin_url"] + "/stats")["dataplane"]["agent_pid"] for w in model_workers(stack)]
        assert len(agents) == 2 and all(agents) and all(is_running(pid) for pid in agents)
        reference = complete(stack.gateway_url, transfer_mode="colocated", selector="quest", kv_budget=0.1)
        smart = complete(stack.gateway_url, transfer_mode="smartgen", kv_bits=0, selector="quest", kv_budget=0.1)
        assert smart["token_ids"] == reference["token_ids"]
        for path in ("metadata", "proactive", "on_demand", "background"):
            assert smart["kv_bytes"][path] > 0, (path, smart["kv_bytes"])
        full = complete(stack.gateway_url, transfer_mode="full")
        assert full["kv_bytes"]["full"] > 0 and len(full["token_ids"]) == 16
        assert_no_leaks(stack)
        sent = sum(get_json(w["admin_url"] + "/stats")["dataplane"].get("bytes_sent", 0) for w in model_workers(stack))
        assert sent > smart["kv_bytes"]["proactive"]  # the agents' own counters reach the workers' stats
    deadline = time.monotonic() + 10
    while any(is_running(pid) for pid in agents) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(is_running(pid) for pid in agents), "a transfer agent outlived its worker"

