"""A task cancelled in the very turn of the loop in which what it waits for arrives stops: the cancellation is not
dropped. asyncio.wait_for on Python 3.11 returns the inner result instead (test_completion_cancel.py has the
gateway's token wait); each test here sets what a task waits for and cancels the task in one go, as an abort or
a close landing beside the event would, and fails on wait_for."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from schemas import Sampling
from services.decode.batcher import StepBatcher
from services.decode.kv_loader import KvLoader
from services.gateway.utility import read_json
from shared.dataplane.rdma import RdmaDataPlane

GIVE_UP_S = 2.0


async def _cancel_as_it_arrives(task: asyncio.Task, arrive) -> None:
    await asyncio.sleep(0.05)  # the task waits
    arrive()
    task.cancel()
    await asyncio.wait([task], timeout=GIVE_UP_S)


async def test_a_client_that_leaves_as_its_body_arrives_is_not_served():
    """The gateway's body read: a handler cancelled (its client left) as the body arrives goes no further."""
    body = asyncio.get_running_loop().create_future()
    request = SimpleNamespace(read=lambda: body)
    served = []

    async def handler() -> None:
        served.append(await read_json(request))  # then admission, the workers, max_tokens for nobody

    task = asyncio.create_task(handler())
    await _cancel_as_it_arrives(task, lambda: body.set_result(b"{}"))
    assert task.cancelled() and not served


async def test_a_decode_request_aborted_as_its_kv_lands_stops():
    """Decode's KV wait: a request task aborted as the last pushed byte lands does not go on to decode."""
    loader = KvLoader(None, None, None, None, SimpleNamespace(kv_timeout_s=10.0), None)  # type: ignore[arg-type]
    state = SimpleNamespace(req=SimpleNamespace(prefill_worker_id="prefill-1"),
                            push=SimpleNamespace(landed=asyncio.Event(), failure=""))
    decoded = []

    async def receive() -> None:
        await loader._wait_for_kv(state)  # type: ignore[arg-type]
        decoded.append(True)  # then the cache, and every step to max_tokens

    task = asyncio.create_task(receive())
    await _cancel_as_it_arrives(task, state.push.landed.set)
    assert task.cancelled() and not decoded


async def test_the_step_batcher_closed_as_a_request_leaves_stops():
    """The batcher's loop, cancelled by close while it gathers a batch and a member leaves, ends (close returns)."""
    async def in_torch(_step, rows):
        return [(7, None)] * len(rows)

    batcher = StepBatcher(None, in_torch, max_batch=8, gather_s=10.0)  # type: ignore[arg-type]
    assert await batcher.step("a", 1, Sampling(), 1) == (7, None)  # "a" is now in the last batch
    second = asyncio.create_task(batcher.step("b", 1, Sampling(), 1))  # the loop waits for "a" to ask again
    loop_task = batcher._task
    assert loop_task is not None
    await _cancel_as_it_arrives(loop_task, lambda: batcher.leave("a"))
    try:
        assert loop_task.done(), "the batcher's loop went on after it was cancelled: close() would wait forever"
    finally:
        await batcher.close()
        await asyncio.gather(second, return_exceptions=True)


class _Wakeup(asyncio.Event):
    """An event that counts its waits."""

    num_waits = 0

    async def wait(self) -> bool:
        self.num_waits += 1
        return await super().wait()


async def test_the_rdma_poll_loop_cancelled_as_it_is_woken_stops():
    """RDMA's completion poller, cancelled by close as a pump wakes it, ends (close awaits it)."""
    plane = RdmaDataPlane.__new__(RdmaDataPlane)  # no device here: only what the poll loop touches
    plane.cq = SimpleNamespace(poll=lambda _max: (0, []))
    plane._pending, plane._poll_wakeup = {}, _Wakeup()
    task = asyncio.create_task(plane._poll_loop())
    while not plane._poll_wakeup.num_waits:  # NOTE: just into its 2 ms wait, not as that times out
        await asyncio.sleep(0)
    plane.wake_poller()
    task.cancel()
    await asyncio.wait([task], timeout=GIVE_UP_S)
    try:
        assert task.done(), "the poll loop went on after it was cancelled: close() would wait forever"
    finally:
        task.cancel()
