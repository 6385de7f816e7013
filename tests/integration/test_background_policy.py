"""Path 3 only when it can finish (decode setting `background_if_it_can_finish`), through the real stack: on a
link too slow for the rest of the KV to arrive before the completion ends, no background read is made; on one
fast enough, the request becomes all-local as before."""
from __future__ import annotations

from pathlib import Path

import pytest

from tools.client import wait_for_broker_pacing
from tools.nats_server import free_port
from tools.stack import StackSpec, started_stack
from tests.integration.conftest import NO_FLOOR_ENV, assert_no_leaks, post_json
from tests.integration.fault_helpers import pace

# ~600 tokens of an 8-layer tiny model: 1.2 MB of KV, ~2.4 s at 4 Mbit/s; a decode step takes a few ms here
PROMPT = "The history of the city begins with a small settlement on the river, where traders met. " * 33


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny8_model_path: Path):
    model = tiny8_model_path
    spec = StackSpec(model=str(model), gateway_port=free_port(), log_file=tmp_path_factory.mktemp("logs") / "stack.log",
                     env={"SMARTGEN_KV_CACHE_MB": "64", "SMARTGEN_TORCH_THREADS": "1", **NO_FLOOR_ENV,
                          "SMARTGEN_LINK_GBPS": "0.004", "SMARTGEN_BACKGROUND_IF_IT_CAN_FINISH": "true"})
    with started_stack(spec, 180) as running:
        yield running


def smartgen(stack, max_tokens: int) -> dict:
    status, reply = post_json(stack.gateway_url + "/v1/completions",
                              {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                               "transfer_mode": "smartgen", "selector": "quest", "kv_budget": 0.1}, timeout=120)
    assert status == 200, reply
    return reply["smartgen"]


def test_background_waits_for_a_link_that_can_finish(stack):
    """5 tokens cannot wait for ~1.2 s of KV (a step here takes ~0.1–0.2 s: its own on-demand reads cross the
    slow link too): declined, none of the broker's blocks read in the background (what moved on that lane are ranked
    reads only: the latest query's likely entries, which do not wait for the rest to fit). With the link 250×
    faster the rest arrives in ~5 ms: read, and the request ends all-local, with the same tokens."""
    slow = smartgen(stack, 5)
    assert slow["plan"]["background"] and slow["background_declined"]
    assert slow["kv_bytes"]["background"] == slow["reads"]["ranked_bytes"] and slow["all_local_step"] is None
    pace(stack, "prefill", 1.0)
    wait_for_broker_pacing(stack.gateway_url, 1.0, stack.admin_token)
    fast = smartgen(stack, 64)
    assert not fast["background_declined"] and fast["kv_bytes"]["background"] > 0
    assert fast["all_local_step"] is not None
    assert fast["token_ids"][:5] == slow["token_ids"]
    assert_no_leaks(stack)
