"""A decode worker releasing a request's lease while its prefill worker is between NATS servers (nobody answers
on its subjects yet): the request ends at once, and the release is asked again in the background until the
prefill answers, instead of leaving its KV held until the lease runs out. A real nats-server; the prefill side is
a bare subscriber on its `release` subject."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import nats

from schemas import Ack, KvSource, KvLayout, Release, decode, encode, mode_of, subjects
from services.decode.remote_lifecycle import RemoteKvLifecycle
from services.decode.request import DecodeRequest
from tools.nats_server import NatsServer


async def test_a_release_nobody_answers_is_asked_again_until_the_prefill_is_back():
    with NatsServer() as server:
        nc = await nats.connect(**server.connect_options())
        try:
            lifecycle = RemoteKvLifecycle(nc, "decode-1", "m", KvLayout(2, 1, 4, 16, "float32", 64), None, lambda rid: None)
            state = DecodeRequest("r1", mode_of("smartgen"))
            state.req = SimpleNamespace(source=KvSource("prefill-1", "127.0.0.1:1", 1, 0, 16, 30.0))
            started = time.monotonic()
            await asyncio.wait_for(lifecycle.end(state, "length"), 10)  # nobody answers: the end does not wait
            assert time.monotonic() - started < 2
            released: list[Release] = []

            async def answer(msg) -> None:  # the prefill worker, back on NATS
                released.append(decode(Release, msg.data))
                await msg.respond(encode(Ack()))
            await nc.subscribe(subjects.worker("prefill", "prefill-1", "release"), cb=answer)
            deadline = time.monotonic() + 10
            while not released:
                assert time.monotonic() < deadline, "the release was never asked again"
                await asyncio.sleep(0.05)
            assert released[0].request_id == "r1" and released[0].reason == "length"
        finally:
            await nc.close()
