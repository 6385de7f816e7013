"""The decode worker's verdict on a request's gateway (services/decode/gateway_watch.py): a request is an orphan
once its gateway has not been heard for the TTL, counted from when the watch first saw the request; never while
the worker itself is cut off from NATS or within a TTL of its reconnect; each orphan once; requests without a
gateway id never."""
from __future__ import annotations

import time
from types import SimpleNamespace

from schemas import Generate, Sampling, WorkerInfo
from services.decode.gateway_watch import GatewayWatch

TTL_S = 0.2


def running(gateway_id: str) -> SimpleNamespace:
    return SimpleNamespace(req=Generate("r", "colocated", [1], -1, 4, [], Sampling(), "s", gateway_id=gateway_id))


def test_orphans_are_found_after_the_ttl_and_never_while_cut_off():
    nc = SimpleNamespace(is_connected=True, stats={"reconnects": 0})
    watch = GatewayWatch(nc, TTL_S, 0.1)  # type: ignore[arg-type]
    watch.gateways.update(WorkerInfo("gateway", "gw-1", 1, "h", "", "v"))
    requests = {"a": running("gw-1"), "b": running(""), "c": SimpleNamespace(req=None)}
    assert watch.orphans(requests) == []  # heard just now
    time.sleep(TTL_S * 1.5)
    nc.is_connected = False
    assert watch.orphans(requests) == []  # cut off: no verdict
    nc.is_connected, nc.stats["reconnects"] = True, 1
    assert watch.orphans(requests) == []  # back: a TTL for heartbeats to return
    time.sleep(TTL_S * 1.5)
    watch.gateways.update(WorkerInfo("gateway", "gw-1", 1, "h", "", "v"))  # it is alive after all
    assert watch.orphans(requests) == []
    time.sleep(TTL_S * 1.5)
    assert watch.orphans(requests) == [("a", "gw-1")]
    assert watch.orphans(requests) == []  # told once
    requests["d"] = running("gw-1")
    assert watch.orphans(requests) == []  # a request first seen now gets its own TTL
    time.sleep(TTL_S * 1.5)
    assert watch.orphans(requests) == [("d", "gw-1")]
    del requests["a"], requests["d"]
    watch.orphans(requests)
    assert watch.first_seen == {} and watch.told == set()  # nothing kept for requests that left
