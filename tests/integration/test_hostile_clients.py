"""Hostile and careless clients beside normal ones (tools/hostile.py, a small run): 4 normal streams alongside 20
slowloris connections, 3 streams whose client never reads and 2 requests with a 100,000-character stop string. The
normal streams finish with every token and no error, each bad request is a 400, every slowloris connection is
closed at the gateway's header timeout (10 s), and nothing leaks (the fixture's check). The never-reading streams
stay below the stack's 8 admission slots with the normal ones: past that, normal requests queue until the write
timeout (30 s) drops them (docs/api.md, Limits)."""
from __future__ import annotations

from tools.hostile import HostileConfig, attack


async def test_normal_streams_are_served_alongside_hostile_clients(clean_stack):
    result = await attack(HostileConfig(clean_stack.gateway_url, normal=4, slowloris=20, never_read=3, long_stop=2,
                                        max_tokens=48, slowloris_s=14))
    assert result["baseline"]["num_ok"] == 4, result["baseline"]
    assert result["normal"]["running_before"] >= 3  # the never-reading streams were there, holding their slots
    normal = result["normal"]
    assert normal["num_ok"] == 4 and not normal["errors"], normal
    assert result["long_stop"]["statuses"] == [400, 400]
    lorises = result["slowloris"]
    assert lorises["num_closed"] == 20 and 8 < lorises["closed_after_max_s"] < 13, lorises
    # the never-reading clients hung up at the end: their 4,000-token streams end at the gateway's next write and
    # the workers are told (then the fixture's leak check finds nothing held)
    assert result["never_read_drained_s"] is not None, "requests of clients that hung up kept running"
