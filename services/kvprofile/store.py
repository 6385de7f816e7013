"""Profiles in a JetStream key-value bucket: they live in the NATS server, so they outlive any kvprofile
process. One key per (model, selector, length bucket); every write carries the next version."""
from __future__ import annotations

from typing import Any

import nats.js.errors

from schemas import Profile, SchemaError, decode, encode


class ProfileStore:
    def __init__(self, kv: Any):
        self.kv = kv  # nats.js.kv.KeyValue

    @classmethod
    async def open(cls, js: Any, bucket: str, replicas: int = 1) -> "ProfileStore":
        """The bucket, created with `replicas` copies if it does not exist yet (an existing one is used as is)."""
        return cls(await js.create_key_value(bucket=bucket, history=5, replicas=replicas))

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
