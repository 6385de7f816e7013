"""The prefill's lease on a selective request's KV, on a whole stack of real processes (tiny 4-layer model: a push per
layer, each frame held 2 s; 4 layers, not 8, halve the wait and still break the old rule)."""
from __future__ import annotations

from tests.integration.conftest import NO_FLOOR_ENV, assert_no_leaks, list_workers
from tests.integration.test_smartgen import complete
from tools.nats_server import free_port
from tools.stack import StackSpec, started_stack
from tools.tiny_model import make_tiny_model


def test_the_lease_starts_when_the_last_push_has_left(tmp_path, real_model_path):
    """The prefill's lease on a selective request's KV runs from when its last push has left, not from its prefill's
    end: the decode node can keep the lease only once its steps run, which wait for the push. Here every push frame
    is held 2 s (fault injection) and the lease is 1 s: the request completes (on the old rule the lease expired
    while the push was still leaving, the prefill freed the KV, and the decode waited for a push that never came)."""
    from tests.integration.fault_helpers import admin_post

    model = make_tiny_model(tmp_path / "tiny4", tokenizer_from=real_model_path, num_layers=4)
    spec = StackSpec(model=str(model), gateway_port=free_port(), log_file=tmp_path / "stack.log",
                     env={"SMARTGEN_KV_CACHE_MB": "64", "SMARTGEN_TORCH_THREADS": "1", **NO_FLOOR_ENV,
                          "SMARTGEN_FAULT_INJECTION": "1", "SMARTGEN_LEASE_S": "1", "SMARTGEN_KV_TIMEOUT_S": "20"})
    with started_stack(spec, 180) as stack:
        prefill = next(w for w in list_workers(stack.gateway_url, stack.admin_token) if w["role"] == "prefill")
        admin_post(stack, prefill, "/fault", {"kind": "delay", "delay_s": 2, "lanes": ["push"]})
        reply = complete(stack, transfer_mode="smartgen", selector="quest", kv_budget=0.1, ablate=["background"])
        assert len(reply["token_ids"]) == 16 and not reply["recomputed"]
        assert_no_leaks(stack)
