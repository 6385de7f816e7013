"""Profiles in a JetStream key-value bucket: they live in the NATS server, so they outlive any kvprofile
process. One key per (model, selector, length bucket); every write carries the next version."""
from __future__ import annotations

from typing import Any

import nats.errors
import nats.js.errors
import structlog

from schemas import Profile, SchemaError, decode, encode
from shared.runtime.rpc import Backoff

log = structlog.get_logger()
# A JetStream cluster that has just started answers nothing, or "unavailable", until it has elected its meta
# leader (seconds): opening the bucket waits that long before kvprofile gives up at start-up
OPEN_TIMEOUT_S = 30.0
NOT_READY = (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError)


class ProfileStore:
    def __init__(self, kv: Any):
        self.kv = kv  # nats.js.kv.KeyValue

    @classmethod
    async def open(cls, js: Any, bucket: str, replicas: int = 1, timeout_s: float = OPEN_TIMEOUT_S) -> "ProfileStore":
        """The bucket, created with `replicas` copies if it does not exist yet (an existing one is used as is).
        While JetStream is not ready (NOT_READY), asked again with backoff for up to `timeout_s`."""
        backoff = Backoff(timeout_s)
        while True:
            try:
                return cls(await js.create_key_value(bucket=bucket, history=5, replicas=replicas))
            except NOT_READY as exc:
                if not backoff.left:
                    raise
                log.warning("jetstream_not_ready", bucket=bucket, error=type(exc).__name__, retry_in_s=backoff.delay)
                await backoff.wait()

    async def keys(self) -> list[str]:
        try:
            return sorted(await self.kv.keys())
        except nats.js.errors.NoKeysError:
            return []

    async def get(self, key: str) -> Profile | None:
        try:
            entry = await self.kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            return None
        if not entry.value:
            return None
        try:
            return decode(Profile, entry.value)
        except SchemaError:
            return None  # written by an incompatible version: treated as missing (and overwritten by the next build)

    async def put(self, profile: Profile) -> None:
        await self.kv.put(profile.key, encode(profile))

    async def delete(self, key: str) -> bool:
        if await self.get(key) is None:
            return False
        await self.kv.delete(key)
        return True
