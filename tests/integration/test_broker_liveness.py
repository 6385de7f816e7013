"""The broker ends a plan whose decode worker is gone, and never brings back one that ended. A decode worker can die
after the answer's last token but before its `released` event: the gateway has its answer and ends nothing, so
the broker must see it itself (heartbeats stop, or a new process under the same worker id). And a heartbeat built
before a plan's final event can arrive after it: it must not restore the plan. A real broker on a real NATS
server; the decode workers are their heartbeats on the wire."""
from __future__ import annotations

import asyncio

import nats
import numpy as np
import nats.micro

from schemas import PlanEvent, PlanRegistration, PlanState, TransferPlan, WorkerInfo, encode, pack_bits, subjects
from services.broker.config import BrokerConfig
from services.broker.service import BrokerService

TTL_S = 0.6
BROKER = "broker-t"


def registration(request_id: str, decode_worker_id: str) -> PlanRegistration:
    """A live `full` plan of 32 tokens over 2 layers of 16-token pages, all of it on the decode node."""
    plan = TransferPlan(request_id, "full", BROKER, num_pages=2)
    return PlanRegistration(plan, PlanState.ALL_LOCAL, "m", "", "prefill-t", decode_worker_id, 32, 2, 16,
                            pack_bits(np.ones((2, 2), dtype=bool)))


async def beat(nc, worker_id: str, pid: int, plans: list[PlanRegistration]) -> None:
    info = WorkerInfo("decode", worker_id, pid, "h", "", "v", started_unix=1000.0 + pid, plans=plans)
    await nc.publish(subjects.heartbeat("decode"), encode(info))
    await nc.flush()


async def until(condition, timeout_s: float) -> bool:
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return True
        await asyncio.sleep(0.02)
    return condition()


def ended_as(broker: BrokerService, request_id: str) -> tuple[str, str] | None:
    """(final state, reason) of an ended plan in the broker's history."""
    return next(((p["state"], p["reason"]) for p in broker.book.history if p["request_id"] == request_id), None)


async def test_plans_of_a_lost_decode_worker_fail_and_an_ended_plan_stays_ended(nats_server):
    nc = await nats.connect(**nats_server.connect_options(), max_reconnect_attempts=0)
    broker = BrokerService(BrokerConfig(nats_url=nats_server.url, worker_id=BROKER, worker_ttl_s=TTL_S))
    micro = await nats.micro.add_service(nc, name="smartgen-broker-test", version="0.0.0")
    await broker.start(nc, micro)
    try:
        # heartbeats stop: the plan fails about TTL_S later, long before plan_ttl_s (60 s) would expire it
        await beat(nc, "decode-a", 1, [registration("r-stopped", "decode-a")])
        assert await until(lambda: broker.book.get("r-stopped") is not None, 2)
        assert await until(lambda: broker.book.get("r-stopped") is None, TTL_S + 2)
        state, reason = ended_as(broker, "r-stopped")
        assert state == PlanState.FAILED and "sent no heartbeat" in reason

        # a new process takes the worker id (supervisor restart, faster than the TTL): its first heartbeat fails
        # what the old process held, whatever its own plans are
        await beat(nc, "decode-b", 2, [registration("r-restarted", "decode-b")])
        assert await until(lambda: broker.book.get("r-restarted") is not None, 2)
        await beat(nc, "decode-b", 3, [registration("r-new", "decode-b")])
        assert await until(lambda: ended_as(broker, "r-restarted") is not None, 1)
        assert ended_as(broker, "r-restarted") == (PlanState.FAILED, "its decode worker restarted")
        assert await until(lambda: broker.book.get("r-new") is not None, 1)

        # a heartbeat built before the plan's `released` arrives after it: the plan stays ended
        await nc.publish(subjects.worker("broker", BROKER, "event"), encode(PlanEvent("r-new", PlanState.RELEASED)))
        assert await until(lambda: broker.book.get("r-new") is None, 1)
        restored = broker.plans_restored.value()
        for _ in range(3):
            await beat(nc, "decode-b", 3, [registration("r-new", "decode-b")])
        await asyncio.sleep(0.2)
        assert broker.book.get("r-new") is None and broker.plans_restored.value() == restored
        assert ended_as(broker, "r-new")[0] == PlanState.RELEASED
    finally:
        await broker.stop()
        await nc.close()
