"""`smartgen loadtest` against the tiny-model stack: many streams at once, cut off at a deadline."""
from __future__ import annotations

from tests.integration.conftest import list_workers
from tools.loadtest import LoadConfig, run


def test_loadtest_serves_streams_measures_memory_and_leaves_nothing_behind(clean_stack, monkeypatch):
    """4 streams for 4 s, cut off at the deadline: all finished requests succeed, RSS is measured, nothing leaks."""
    monkeypatch.setenv("SMARTGEN_ADMIN_TOKEN", clean_stack.admin_token)  # as `smartgen loadtest` gets it: /workers needs it
    result = run(LoadConfig(url=clean_stack.gateway_url, concurrency=4, duration_s=4, max_tokens=8, prompt_tokens=64,
                            transfer_modes=["full", "smartgen"], grace_s=0, progress=False))
    assert result["num_ok"] > 0 and result["num_errors"] == 0, result["errors"]
    assert result["num_aborted"] <= 4  # at most one request per client was cut off
    assert result["latency_s"]["ttst"]["n"] == result["num_ok"] and result["latency_s"]["e2e"]["p50"] > 0
    assert set(result["by_mode"]) == {"full", "smartgen"} and all(m["num_ok"] for m in result["by_mode"].values())
    workers = list_workers(clean_stack.gateway_url, clean_stack.admin_token)
    assert {w["role"] for w in workers} >= {"gateway", "prefill", "decode", "broker", "kvprofile"}
    for name in [w["id"] for w in workers] + ["nats-server"]:
        rss = result["memory"][name]
        assert rss["start_mib"] > 0 and rss["warm_mib"] > 0 and rss["max_mib"] >= rss["start_mib"] and rss["end_mib"] > 0, \
            (name, rss)
    assert result["memory_timeline"] and result["memory_timeline"][-1][1] > 0
    assert result["leaks"] == {}


def test_loadtest_holds_every_completion_to_its_reference(clean_stack, monkeypatch):
    """--check-tokens: prompts from a pool, each answered alone in colocated mode first; under 4 streams of full
    and smartgen (steps batched together), every completion has exactly its reference's tokens. The check can
    fail: with the references scrambled, every completion is counted wrong — unless the reference was a near-tie
    where they first differ, which is counted apart."""
    from tools import loadtest

    monkeypatch.setenv("SMARTGEN_ADMIN_TOKEN", clean_stack.admin_token)
    cfg = LoadConfig(url=clean_stack.gateway_url, concurrency=4, duration_s=3, max_tokens=12, prompt_tokens=64,
                     transfer_modes=["full", "smartgen"], grace_s=5, progress=False, check_tokens=3)
    result = run(cfg)
    assert result["num_checked"] >= 4 and result["num_errors"] == 0, result["errors"]

    original = loadtest.Load.reference

    margin = float("inf")

    async def scrambled(self, session, index, selective):
        tokens = await original(self, session, index, selective)
        self.references[(index, selective)] = [t + 1 for t in tokens]
        self.margins[(index, selective)] = [margin] * len(tokens)
        return self.references[(index, selective)]

    monkeypatch.setattr(loadtest.Load, "reference", scrambled)
    bad = run(cfg)
    assert bad["num_checked"] > 0 and bad["errors"].get(loadtest.WRONG_TOKENS) == bad["num_checked"], bad["errors"]
    # where the reference was a near-tie at the first difference, the flip is counted apart, not as wrong
    margin = loadtest.NEAR_TIE_NATS / 2
    ties = run(cfg)
    assert ties["num_errors"] == 0 and ties["num_checked"] > 0
    assert len(ties["mismatches"]) == ties["num_checked"] and all(m["near_tie"] for m in ties["mismatches"])
