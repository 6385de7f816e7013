"""The broker's view of the KV-profile service: profiles asked for by (model, selector, length bucket),
cached until kvprofile says one changed (or `ttl_s` passes), and the positional fallback when none is
stored or kvprofile does not answer — logged, never a failure."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import structlog
from nats.aio.client import Client

from schemas import Profile, ProfileInfo, ProfileQuery, subjects
from shared.runtime.profiles import NUM_BLOCKS, POSITIONAL, bucket_for, importance_of, positional_importance, profile_key
from shared.runtime.registry import WorkerRegistry
from shared.runtime.rpc import RemoteError, call, subscriber

log = structlog.get_logger()
ASK_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class ChosenProfile:
    importance: np.ndarray  # (num_layers, num_blocks)
    key: str  # the key asked for
    version: int  # 0 for the fallback
    source: str  # calibration, online, or positional

    @property
    def label(self) -> tuple[str, int, str]:
        return self.key, self.version, self.source


class ProfileCache:
    def __init__(self, registry: WorkerRegistry, ttl_s: float):
        self.registry, self.ttl_s = registry, ttl_s
        self._cache: dict[str, tuple[float, ChosenProfile]] = {}
        # NOTE: bumped by every update of a key; an answer asked for before an update is not cached after it
        self._generation: dict[str, int] = {}
        self.nc: Client | None = None
        self.num_fallbacks = 0

    async def follow(self, nc: Client) -> None:
        self.nc = nc

        async def on_updated(info: ProfileInfo) -> None:
            self.invalidate(info.key)

        await nc.subscribe(subjects.PROFILE_UPDATED, cb=subscriber(ProfileInfo, on_updated))

    async def get(self, model: str, selector: str, num_tokens: int, num_layers: int) -> ChosenProfile:
        key = profile_key(model, selector, bucket_for(num_tokens))
        hit = self._cache.get(key)
        if hit and time.monotonic() - hit[0] < self.ttl_s and hit[1].importance.shape[0] == num_layers:
            return hit[1]
        generation = self._generation.get(key, 0)
        chosen = await self._ask(key, model, selector, num_tokens, num_layers)
        if self._generation.get(key, 0) == generation:  # no update raced the question
            self._cache[key] = (time.monotonic(), chosen)
        return chosen

    def invalidate(self, key: str) -> None:
        """The profile stored under `key` changed (or was deleted): forget it, and any answer still on its way."""
        self._generation[key] = self._generation.get(key, 0) + 1
        self._cache.pop(key, None)

    async def _ask(self, key: str, model: str, selector: str, num_tokens: int, num_layers: int) -> ChosenProfile:
        worker = self.registry.pick("kvprofile")
        why = "no kvprofile service is registered"
        if worker is not None and self.nc is not None:
            try:
                profile = await call(self.nc, subjects.worker("kvprofile", worker.worker_id, "get"),
                                     ProfileQuery(model, selector, num_tokens), Profile, ASK_TIMEOUT_S)
                if profile.num_layers == num_layers:
                    return ChosenProfile(importance_of(profile), profile.key, profile.version, profile.source)
                why = f"the stored profile has {profile.num_layers} layers, the model {num_layers}"
            except RemoteError as exc:
                why = exc.message
        self.num_fallbacks += 1
        log.info("profile_missing", key=key, fallback=POSITIONAL, reason=why)
        return ChosenProfile(positional_importance(num_layers, NUM_BLOCKS), key, 0, POSITIONAL)
