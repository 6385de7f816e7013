"""Reads of remote KV never outlive the slab they write into, and a failed speculative read costs a fetch, not
the step (issue #34's review: a cancelled read's reply still lands; close() went on with reads pending; a failed
speculation failed the whole step)."""
from __future__ import annotations

import asyncio
import time

import numpy as np
import torch

from schemas import KvSource
from services.decode.remote_lifecycle import read_blocks
from services.decode.remote import RemoteKv
from shared.compute.kvstore import layout_for
from shared.dataplane import DataPlaneError, Lane

LAYOUT = layout_for(num_layers=4, num_kv_heads=2, head_dim=8, page_tokens=16, dtype=torch.float32)
N = 32  # two pages


class LateReplyPlane:
    """A data plane whose read replies land only when `release` is set, and land even if the caller stopped
    waiting (as a TCP link's do: the reply's bytes go into the region whoever awaits them). `cut_links` fails the
    replies still to come, as a cut link does. `writes` records when each reply's bytes reached the region."""

    address = "fake:0"

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.writes: list[float] = []
        self.replies: list[tuple[asyncio.Task[None], asyncio.Future[None]]] = []
        self.num_cuts = 0

    async def read(self, _addr: str, _ticket: int, _segments, lane: Lane, _whole_frames: bool = False) -> None:
        done = asyncio.get_running_loop().create_future()

        async def reply() -> None:
            await self.release.wait()
            self.writes.append(time.monotonic())
            done.set_result(None)

        self.replies.append((asyncio.ensure_future(reply()), done))
        await done

    async def read_gather(self, addr: str, ticket: int, _gather, lane: Lane, _whole_frames: bool = False) -> None:
        await self.read(addr, ticket, [], lane)

    def cut_links(self, reason: str = "", peer: str | None = None) -> int:
        self.num_cuts += 1
        for task, done in self.replies:
            task.cancel()
            if not done.done():
                done.set_exception(DataPlaneError(f"link cut: {reason}"))
        return 1


class FailingSpeculationPlane:
    """Every read works but the first, a speculative one, which fails."""

    address = "fake:0"

    def __init__(self) -> None:
        self.num_reads = 0

    async def read(self, _addr: str, _ticket: int, _segments, lane: Lane, _whole_frames: bool = False) -> None:
        self.num_reads += 1
        if self.num_reads == 1:
            raise DataPlaneError("link reset")

    async def read_gather(self, addr: str, ticket: int, _gather, lane: Lane, _whole_frames: bool = False) -> None:
        await self.read(addr, ticket, [], lane)


def remote_over(plane, loop: asyncio.AbstractEventLoop) -> RemoteKv:
    pages = N // LAYOUT.page_tokens
    source = KvSource("p", plane.address, 1, 0, N, 30.0)
    return RemoteKv(plane, loop, source, LAYOUT, 1 << 20, N, N,  # type: ignore[arg-type]
                    np.zeros((LAYOUT.num_layers, pages), dtype=bool))


async def test_close_waits_for_a_cancelled_reads_reply_before_the_slab_can_be_freed():
    """A path-3 task cancelled at the request's end leaves its read's reply on the way: close() returns only once
    that reply has landed, so freeing the slab after it cannot be overwritten by it."""
    plane = LateReplyPlane()
    remote = remote_over(plane, asyncio.get_running_loop())
    background = asyncio.create_task(read_blocks(remote, [2 * (N // LAYOUT.page_tokens)]))
    await asyncio.sleep(0.01)
    background.cancel()  # as RemoteKvLifecycle._release_remote does with the request's helpers
    await asyncio.gather(background, return_exceptions=True)
    asyncio.get_running_loop().call_later(0.1, plane.release.set)
    await remote.close(timeout_s=5.0)
    closed_at = time.monotonic()
    assert plane.writes and plane.writes[-1] <= closed_at  # the reply landed before close() returned
    assert plane.num_cuts == 0


async def test_close_cuts_the_link_of_a_read_that_never_settles_so_nothing_lands_after_it():
    """A reply that does not come within the timeout: close() cuts its link and returns only once the read has
    failed; nothing lands in the slab afterwards."""
    plane = LateReplyPlane()
    remote = remote_over(plane, asyncio.get_running_loop())
    background = asyncio.create_task(read_blocks(remote, [2 * (N // LAYOUT.page_tokens)]))
    await asyncio.sleep(0.01)
    background.cancel()
    await asyncio.gather(background, return_exceptions=True)
    await remote.close(timeout_s=0.1)
    plane.release.set()
    await asyncio.sleep(0.05)
    assert plane.num_cuts == 1 and plane.writes == []


async def test_a_failed_speculative_read_falls_back_to_a_fetch():
    """The speculative read of a layer fails: the layer's fetch reads what it needs itself, and the step goes on."""
    plane = FailingSpeculationPlane()
    remote = remote_over(plane, asyncio.get_running_loop())
    idx = torch.tensor([[0, 1], [2, 3]])
    remote.speculate(2, idx)
    pending = await asyncio.to_thread(remote.fetch, 2, idx)  # on another thread, as attention calls it
    assert pending is not None
    await asyncio.to_thread(pending.wait)
    assert plane.num_reads == 2 and remote.presence.present[2, 0, [0, 1]].all() and remote.presence.present[2, 1, [2, 3]].all()
