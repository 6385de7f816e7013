"""A gateway run whose request is cancelled (its client left) just as a token event arrives stops there: the
cancellation is not dropped. asyncio.wait_for on Python 3.11 returns the inner result instead when both happen
in one turn of the loop; the run then went on to max_tokens, holding its admission slot and its decode worker."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from schemas import TokenEvent
from schemas.codec import encode
from services.gateway.completion import CompletionRun
from services.gateway.requests import CompletionJob

CANCEL_AT = 3  # the token event during whose arrival the client leaves


class Events:
    """A stream subscription whose token events are always there already (a fast decode worker)."""

    def __init__(self):
        self.num_given = 0

    async def next_msg(self, timeout=None):
        self.num_given += 1
        i = self.num_given - 1
        await asyncio.sleep(0)
        return SimpleNamespace(data=encode(TokenEvent("r", i, 7)))


async def test_a_run_cancelled_as_a_token_arrives_stops():
    """Cancelled while its token event is being taken, the run stops at the next one."""
    job = CompletionJob("r", "completion", [1, 2, 3], 1000, 0.0, 0, [], True, "full", "", 0.0)
    run = CompletionRun(None, None, job, [], 10.0)  # type: ignore[arg-type]
    run.decode, run._sub = SimpleNamespace(worker_id="decode-1"), Events()
    consumer: asyncio.Task | None = None

    def heard() -> None:  # the liveness check's "a message came": the client leaves at that very moment
        if run._sub.num_given == CANCEL_AT:
            consumer.cancel()

    run._liveness = SimpleNamespace(heard=heard, dead=lambda workers: [], check_not_lost=lambda *_: None)

    async def consume() -> int:
        num = 0
        async for _ in run._events():
            num += 1
        return num

    consumer = asyncio.create_task(consume())
    await asyncio.wait([consumer], timeout=2)
    assert consumer.done() and consumer.cancelled(), \
        f"the run went on after its client left: {run._sub.num_given} token events taken"
    assert run._sub.num_given <= CANCEL_AT + 1
    consumer.cancel()
