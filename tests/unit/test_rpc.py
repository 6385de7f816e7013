"""shared/runtime/rpc.py over a real nats-server: a `concurrent` endpoint reads its next message while a long handler
still runs (a prefill waiting its turn must be seen by the service, not sit unread in NATS); a plain one
handles them one after another."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import nats
import pytest
from nats.micro import add_service
from nats.micro.service import ServiceConfig

from schemas import Ack
from shared.runtime.rpc import call, endpoint


@dataclass(frozen=True, slots=True)
class Hold:
    request_id: str


@pytest.mark.parametrize("concurrent", [True, False])
async def test_a_concurrent_endpoint_reads_the_next_message_during_a_long_handler(nats_server, concurrent):
    nc = await nats.connect(**nats_server.connect_options())
    started: list[str] = []
    release = asyncio.Event()

    async def handler(message: Hold) -> Ack:
        started.append(message.request_id)
        await release.wait()
        return Ack()

    service = await add_service(nc, ServiceConfig(name="rpc-test", version="0.0.1"))
    await service.add_endpoint(name="hold", subject="test.hold", handler=endpoint(Hold, handler, concurrent))
    try:
        calls = [asyncio.create_task(call(nc, "test.hold", Hold(rid), Ack, 10.0)) for rid in ("a", "b")]
        await asyncio.sleep(0.5)
        assert started == (["a", "b"] if concurrent else ["a"])
        release.set()
        assert await asyncio.gather(*calls) == [Ack(), Ack()]
    finally:
        await service.stop()
        await nc.close()
