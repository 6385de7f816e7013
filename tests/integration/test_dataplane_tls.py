"""Data-plane TLS through the command users run: the whole stack with SMARTGEN_DATAPLANE_TLS_* set, KV crossing
from prefill to decode through mutual TLS, the same tokens as colocated, and both workers saying so."""
from __future__ import annotations

from pathlib import Path

from tools.nats_server import free_port
from tools.stack import StackSpec, started_stack
from tests.certificates import make_certificates
from tests.integration.conftest import assert_no_leaks, get_json, model_workers, post_json


def test_the_stack_moves_kv_through_mutual_tls(tiny_model_path: Path, tmp_path: Path):
    pem = make_certificates(tmp_path)
    spec = StackSpec(model=str(tiny_model_path), gateway_port=free_port(), log_file=tmp_path / "stack.log",
                     env={"SMARTGEN_KV_CACHE_MB": "64", "SMARTGEN_TORCH_THREADS": "1",
                          "SMARTGEN_DATAPLANE_TLS_CA": str(pem["ca.pem"]),
                          "SMARTGEN_DATAPLANE_TLS_CERT": str(pem["peer.pem"]),
                          "SMARTGEN_DATAPLANE_TLS_KEY": str(pem["peer.key"])})
    with started_stack(spec, 180) as stack:
        answers = {}
        for mode in ("colocated", "full", "smartgen"):
            body = {"prompt": "The river town grew around its market. " * 20, "max_tokens": 8, "temperature": 0,
                    "ignore_eos": True, "transfer_mode": mode}
            status, reply = post_json(stack.gateway_url + "/v1/completions", body, timeout=60)
            assert status == 200, (mode, reply)
            answers[mode] = reply["smartgen"]
        assert answers["full"]["token_ids"] == answers["colocated"]["token_ids"]
        assert sum(answers["full"]["kv_bytes"].values()) > 0  # the check is not vacuous: KV crossed the link
        assert answers["smartgen"]["kv_bytes"].get("proactive", 0) + answers["smartgen"]["kv_bytes"].get("metadata", 0) > 0
        for worker in model_workers(stack):
            plane = get_json(worker["admin_url"] + "/stats")["dataplane"]
            assert plane["tls"] and plane["peers_refused"] == 0, (worker["role"], plane)
        assert_no_leaks(stack)
    started = [line for line in spec.log_file.read_text().splitlines() if '"dataplane_started"' in line]
    assert len(started) == 2 and all('"tls": true' in line for line in started)
