"""Hostile and careless clients beside normal ones (tools/hostile.py, a small run): 4 normal streams alongside 20
slowloris connections, 12 streams whose client never reads (more than the stack's 8 admission slots), 2 requests
with a 100,000-character stop string and 2 with `echo` and `logprobs` 20 on a 4,000-token prompt, the hostile
clients from another loopback address (127.0.0.2): another client. The never-readers hold their client's share of
the slots (half) and the rest of them wait their turn, so the normal streams start at once and finish with every
token and no error; each bad request is a 400 naming its parameter; every slowloris connection is closed at the
gateway's header timeout (10 s), and nothing leaks (the fixture's check)."""
from __future__ import annotations

from tools.hostile import HostileConfig, attack


async def test_normal_streams_are_served_alongside_hostile_clients(clean_stack):
    result = await attack(HostileConfig(clean_stack.gateway_url, normal=4, slowloris=20, never_read=12, long_stop=2,
                                        echo=2, echo_tokens=4000, echo_logprobs=20, max_tokens=48, slowloris_s=14))
    assert result["baseline"]["num_ok"] == 4, result["baseline"]
    normal = result["normal"]
    # the never-readers hold half the 8 slots, their client's cap; the other 8 wait for their client's turn
    assert (normal["running_before"], normal["waiting_before"], normal["waiting_client_cap_before"]) == (4, 8, 8), normal
    assert normal["num_ok"] == 4 and not normal["errors"], normal
    assert result["long_stop"]["statuses"] == [400, 400]
    echoes = result["echo"]["outcomes"]  # their log-probabilities would not fit one NATS message: a 400 at once
    assert [(e["status"], e["param"]) for e in echoes] == [(400, "echo")] * 2 and max(e["s"] for e in echoes) < 5, echoes
    lorises = result["slowloris"]
    assert lorises["num_closed"] == 20 and 8 < lorises["closed_after_max_s"] < 13, lorises
    # the never-reading clients hung up at the end: their 4,000-token streams end at the gateway's next write and
    # the workers are told, the waiting ones leave the queue (then the fixture's leak check finds nothing held)
    drained_s = result["never_read_drained_s"]
    assert drained_s is not None and drained_s < 5, f"requests of clients that hung up kept running ({drained_s} s)"
