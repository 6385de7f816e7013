"""Four transfer bugs a review found, each pinned: a first online observation moves the profile only by the
online weight; an update that races the broker's profile question is not cached over; a failed background
batch is read again instead of stopping the lane for good; an on-demand read counts as pending from the moment
it is issued, so a background read cannot slip in ahead of it."""
from __future__ import annotations

import asyncio

import numpy as np
import torch

from schemas import KvSource, mode_of
from services.broker.profiles import ChosenProfile, ProfileCache
from services.decode import remote_lifecycle
from services.decode.remote import RemoteKv
from services.decode.remote_lifecycle import RemoteKvLifecycle
from services.decode.remote_lifecycle import read_blocks
from services.decode.request import DecodeRequest
from shared.compute.kvstore import layout_for
from shared.dataplane import Lane
from shared.runtime.profiles import online_update, positional_importance
from shared.runtime.registry import WorkerRegistry

LAYOUT = layout_for(num_layers=4, num_kv_heads=2, head_dim=8, page_tokens=16, dtype=torch.float32)
N = 32  # two pages


def test_a_first_online_observation_moves_the_fallback_by_the_weight_only():
    """No stored profile: the positional fallback moves toward the request's selections by ≤ online_weight; the
    one request does not become the profile."""
    observed, seen = np.ones((2, 16), dtype=np.float32), np.ones(16, dtype=bool)
    updated = online_update(None, observed, seen, 0.05)
    start = positional_importance(2, 16)
    assert np.abs(updated - start).max() <= 0.05 + 1e-6
    assert not np.allclose(updated, observed)


async def test_an_update_racing_a_profile_question_is_not_cached_over():
    cache = ProfileCache(WorkerRegistry(5.0), ttl_s=30.0)
    versions = iter(range(1, 10))

    async def ask(key: str, *_args) -> ChosenProfile:
        version = next(versions)
        if version == 1:
            cache.invalidate(key)  # kvprofile announces a new version while this answer is on its way
        return ChosenProfile(np.zeros((2, 4), dtype=np.float32), key, version, "online")

    cache._ask = ask  # type: ignore[method-assign]
    first = await cache.get("m", "quest", 100, 2)
    second = await cache.get("m", "quest", 100, 2)
    third = await cache.get("m", "quest", 100, 2)
    assert (first.version, second.version, third.version) == (1, 2, 2)  # the stale answer was not kept


class FlakyRemote:
    """What _read_background needs of a RemoteKv; its first two reads fail."""

    is_closed = False
    failure = ""

    def __init__(self) -> None:
        self.attempts: list[list[int]] = []

    async def read_blocks(self, blocks: list[int]) -> None:
        self.attempts.append(blocks)
        if len(self.attempts) <= 2:
            raise ConnectionResetError("link reset")


async def test_a_failed_background_batch_is_read_again(monkeypatch):
    monkeypatch.setattr(remote_lifecycle, "BACKGROUND_RETRY_S", (0.001, 0.002))
    monkeypatch.setattr(remote_lifecycle, "read_blocks", lambda remote, blocks: remote.read_blocks(blocks))
    lifecycle = RemoteKvLifecycle(None, "decode-0", "m", LAYOUT, None, lambda request_id: None)  # type: ignore[arg-type]
    state = DecodeRequest("r", mode_of("smartgen"))
    state.remote = FlakyRemote()  # type: ignore[assignment]
    state.progress.backlog = 3
    state.progress.background.put_nowait([1, 2, 3])
    reader = asyncio.create_task(lifecycle._read_background(state))
    for _ in range(200):
        if state.progress.backlog == 0:
            break
        await asyncio.sleep(0.005)
    reader.cancel()
    assert state.remote.attempts == [[1, 2, 3]] * 3 and state.progress.backlog == 0  # type: ignore[union-attr]


class GatedPlane:
    """A data plane whose on-demand reads wait for `release`; it records the lane of every read in order."""

    address = "fake:0"

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.lanes: list[Lane] = []

    async def read(self, _addr: str, _ticket: int, _segments, lane: Lane, _whole_frames: bool = False) -> None:
        self.lanes.append(lane)
        if lane is Lane.ON_DEMAND:
            await self.release.wait()

    async def read_gather(self, _addr: str, _ticket: int, _gather, lane: Lane, _whole_frames: bool = False) -> None:
        await self.read(_addr, _ticket, [], lane)


async def test_an_issued_on_demand_read_goes_before_a_background_read():
    """fetch (here on the loop's own thread, the tightest interleaving) marks the read pending at once: a
    background read started right after it waits until it has settled."""
    plane = GatedPlane()
    pages = N // LAYOUT.page_tokens
    source = KvSource("p", plane.address, 1, 0, N, 30.0)
    remote = RemoteKv(plane, asyncio.get_running_loop(), source, LAYOUT, 1 << 20, N, N,  # type: ignore[arg-type]
                      np.zeros((LAYOUT.num_layers, pages), dtype=bool))
    pending = remote.fetch(2, torch.tensor([[0, 1], [2, 3]]))
    assert pending is not None and remote.is_on_demand_busy
    background = asyncio.create_task(read_blocks(remote, [3 * pages]))  # layer 3, page 0
    await asyncio.sleep(0.05)
    assert plane.lanes == [Lane.ON_DEMAND]
    plane.release.set()
    await asyncio.to_thread(pending.wait)
    await background
    assert plane.lanes == [Lane.ON_DEMAND, Lane.BACKGROUND] and not remote.is_on_demand_busy


def test_background_runs_only_when_the_rest_can_arrive_in_time():
    """Path 3's policy: the remote bytes at the link rate against the steps left at the step time; unknown rates
    never decline."""
    from services.decode.remote_lifecycle import background_can_finish

    mb = 1 << 20
    assert background_can_finish(40 * mb, 1.0, steps_left=63, step_s=0.1)  # 0.34 s of link, 6.3 s of decode
    assert not background_can_finish(40 * mb, 0.01, steps_left=63, step_s=0.1)  # 34 s of link
    assert not background_can_finish(40 * mb, 1.0, steps_left=3, step_s=0.1)  # too few steps left
    assert background_can_finish(40 * mb, 0.0, steps_left=1, step_s=0.1)  # unpaced or unknown link
    assert background_can_finish(0, 0.01, steps_left=0, step_s=0.1)  # nothing left to move


def test_the_exact_push_holds_back_by_the_links_backlog_not_by_late_acks():
    """`Transfer.holds_back` asks when the plan's link would have sent every push queued so far (`link_free_at`), not how
    many bytes are unacked: a push is acked only once all of it has landed, so acks lag the link (by acks the
    rule once held back from layer 13 of 30 where the link was free before the prefill's end)."""
    import time

    from schemas import TransferPlan
    from services.prefill.pushes import EXACT_AFTER_S, Transfer

    plan = TransferPlan("r", "smartgen", "b", 8, link_gbps=0.008, exact_push=True)  # 1 MB/s
    now = time.perf_counter()
    # layer 9 of 30 stored after 1 s: 2 s of prefill left; 20 MB pushed and none acked yet
    transfer = Transfer(None, None, mode_of("smartgen"), plan, exact=True, prefill_started=now - 1.0,
                        layer_push_bytes=[2_000_000] * 10 + [0] * 20)
    transfer.link_free_at = now + 1.5  # the link is free 0.5 s before the prefill ends: push now
    assert not transfer.holds_back(9, 0.0)
    transfer.link_free_at = now + 2.0 + EXACT_AFTER_S + 0.3  # busy past the prefill's end and step 1: hold back
    assert transfer.holds_back(9, 0.0)
    assert not Transfer(None, None, mode_of("smartgen"), plan, exact=False, prefill_started=now - 1.0,
                        layer_push_bytes=[0] * 30, link_free_at=now + 9).holds_back(9, 0.0)  # exact_push off
    assert not transfer.holds_back(9, 0.5)  # the optional guard (exact_from_share): not before layer 15
