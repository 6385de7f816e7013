"""Decode workers SIGKILLed under load lose no request (issue #35's chaos goal): `smartgen chaos`'s short run, real
processes on a real nats-server. 8 streams under `recompute`, one gateway, one prefill and two decode workers; decode-0
then decode-1 SIGKILLed 5 s apart (the second once the first serves again), each started again by the supervisor:
every request completes with its colocated reference tokens, each killed worker serves again within 30 s, nothing
leaks. The full run (a kill every 2 minutes
for 10 minutes) is the command in docs/results/chaos-2026-12-05/README.md."""
from __future__ import annotations

from tools.chaos import ChaosConfig, run


def test_decode_workers_killed_under_eight_streams_lose_no_request(tiny_model_path, tmp_path):
    """Two SIGKILLs, one per decode worker: no request lost or wrong, both back within 30 s, no leak."""
    cfg = ChaosConfig(model=str(tiny_model_path), streams=8, max_tokens=24, kill_every_s=5.0, duration_s=15.0,
                      log_file=str(tmp_path / "stack.log"))
    result = run(cfg)
    assert [k["name"] for k in result["kills"]] == ["decode-0", "decode-1"], result["kills"]
    assert all(k["exit_code"] == -9 for k in result["kills"]), result["kills"]
    assert result["num_requests"] >= cfg.streams * 2
    assert result["num_lost"] == 0, (result["outcomes"], result.get("log_tail"))
    assert result["num_migrations"] >= 1 and result["num_resumed"] >= 1, result  # the kills hit requests mid-stream
    assert result["all_back_within"], result["kills"]
    assert not result["leaks"], result["leaks"]
    assert result["passed"]
