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


async def test_a_reply_too_large_for_nats_comes_back_as_an_error_at_once(nats_server):
    """A handler whose reply exceeds the server's max_payload: the caller gets an error naming the size right
    away (before, the publish failed outside the handler's try and the caller waited for its timeout)."""
    from schemas import ErrorCode, WorkerList
    from shared.runtime.rpc import RemoteError

    nc = await nats.connect(**nats_server.connect_options())
    big = "x" * (nc.max_payload + 10)

    async def handler(message: Hold) -> WorkerList:
        return WorkerList([big])  # type: ignore[list-item]

    service = await add_service(nc, ServiceConfig(name="rpc-big", version="0.0.1"))
    await service.add_endpoint(name="big", subject="test.big", handler=endpoint(Hold, handler))
    try:
        started = asyncio.get_running_loop().time()
        with pytest.raises(RemoteError) as caught:
            await call(nc, "test.big", Hold("a"), WorkerList, 10.0)
        assert caught.value.code is ErrorCode.INTERNAL and "could not be sent" in caught.value.message
        assert asyncio.get_running_loop().time() - started < 5
    finally:
        await service.stop()
        await nc.close()


def test_the_echo_limit_is_conservative_and_exact_enough():
    """echo_problem allows a prompt only when the prefill's reply with its log-probabilities fits max_payload, and
    allows at least 80% of the prompt tokens that would fit (it does not refuse prompts that fit by much)."""
    from schemas import PrefillDone, TokenLogprobs, encode
    from services.gateway.logprobs import echo_problem

    max_payload = 1 << 20
    for k in (0, 1, 5, 20):
        most = next(n for n in range(40000, 0, -1) if not echo_problem(n, k, max_payload))
        reply = PrefillDone("cmpl-" + "x" * 24, 1, "prefill-12345678", most, 1.0, None, 0,
                            TokenLogprobs(-1.5, list(range(k)), [-1.2345] * k),
                            [TokenLogprobs(-0.123456789, [49151 - i for i in range(k)], [-12.3456789] * k)
                             for _ in range(most - 1)])
        size = len(encode(reply))
        assert size <= max_payload, k
        assert most >= 0.8 * max_payload / (size / most), k
        assert echo_problem(most + 1, k, max_payload), k
