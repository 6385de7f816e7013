"""kvprofile's bucket against a JetStream that is not ready yet (a cluster still electing its meta leader): asked
again until it answers, within a deadline; any other error at once. The JetStream here is a stand-in that fails
as nats-py does: the retry policy is what is under test (test_nats_cluster.py runs a real cluster)."""
from __future__ import annotations

import nats.errors
import nats.js.errors
import pytest

from services.kvprofile.store import ProfileStore


class Startup:
    """A JetStream whose first `failures` bucket creations fail with `error`."""

    def __init__(self, failures: int, error: Exception):
        self.failures, self.error, self.calls = failures, error, 0

    async def create_key_value(self, **config) -> dict:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return config


@pytest.mark.parametrize("error", [nats.errors.TimeoutError(), nats.errors.NoRespondersError(),
                                   nats.js.errors.ServiceUnavailableError()])
async def test_the_bucket_opens_once_jetstream_is_ready(error):
    js = Startup(2, error)
    store = await ProfileStore.open(js, "profiles", replicas=3, timeout_s=5)
    assert js.calls == 3 and store.kv == {"bucket": "profiles", "history": 5, "replicas": 3}


async def test_a_jetstream_that_never_gets_ready_fails_after_the_deadline_and_other_errors_at_once():
    never = Startup(10**6, nats.errors.TimeoutError())
    with pytest.raises(nats.errors.TimeoutError):
        await ProfileStore.open(never, "profiles", timeout_s=0.5)
    assert 2 <= never.calls <= 5
    refused = Startup(1, nats.js.errors.BadRequestError())
    with pytest.raises(nats.js.errors.BadRequestError):
        await ProfileStore.open(refused, "profiles", timeout_s=5)
    assert refused.calls == 1


async def test_bucket_routes_answer_503_until_the_bucket_is_open():
    """kvprofile serves its admin routes before JetStream has created the bucket (seconds on a fresh NATS cluster):
    until then a bucket route answers a JSON 503 with Retry-After, not a 500 from a failed assertion."""
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from services.kvprofile.service import _bucket_answers

    state = {"open": False}

    async def profiles(_: web.Request) -> web.Response:
        assert state["open"]
        return web.json_response({"profiles": []})

    app = web.Application()
    app.router.add_get("/profiles", _bucket_answers(profiles, lambda: state["open"]))
    async with TestClient(TestServer(app)) as client:
        early = await client.get("/profiles")
        assert early.status == 503 and early.headers["Retry-After"] == "2"
        assert "not open yet" in (await early.json())["error"]
        state["open"] = True
        later = await client.get("/profiles")
        assert later.status == 200 and await later.json() == {"profiles": []}
