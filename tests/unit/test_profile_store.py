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
