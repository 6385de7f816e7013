"""KV-profile service: positional importance profiles per (model, selector, prompt-length bucket).

Life of a profile:
  1. `build` (CLI `smartgen profile build`, or POST /profiles/build): calibrate on the torch thread
     (engine.py), store as version 1 (or the next version) in the JetStream bucket, announce it on
     `smartgen.profile.updated`. Progress goes to the builder's progress subject.
  2. `get` (the broker, per request): the profile of the request's bucket, or `not_found` (the broker then
     falls back to positional).
  3. Online: decode workers publish what each selective request selected (`smartgen.profile.stats`); each
     observation moves the stored profile by at most `online_weight` (where none exists, it moves the positional
     fallback and stores that as an `online` profile), under the next version, announced like a build.
  4. `delete` removes one. Everything stored survives this process: it lives in the NATS server.
"""
from __future__ import annotations

import asyncio
import functools
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import nats.errors
import numpy as np
import structlog
from aiohttp import web
from nats.aio.client import Client
from nats.micro.service import Service as MicroService

from schemas import (SELECTORS, Ack, BuildProfile, ErrorCode, BuildProgress, ListQuery, Profile, ProfileInfo, ProfileKey, ProfileList,
                     ProfileQuery, SelectionStats, encode, from_plain, kv_budget_problem,
                     subjects)
from shared.runtime.profiles import NUM_BLOCKS, bucket_for, importance_of, observed_importance, online_update, profile_key
from shared.runtime.rpc import RequestRefused, endpoint, subscriber
from shared.runtime.service import Service
from shared.runtime.torch_thread import TorchThread
from services.kvprofile.config import KvProfileConfig
from services.kvprofile.engine import ProfileBuilder
from services.kvprofile.store import ProfileStore

log = structlog.get_logger()
PROFILE_KEY = re.compile(r"[A-Za-z0-9_=-]+(\.[A-Za-z0-9_=-]+)*")  # what profile_key() builds: bucket-key tokens
MAX_KEY_CHARS = 255


class KvProfileService(Service):
    role = "kvprofile"
    config: KvProfileConfig

    def __init__(self, config: KvProfileConfig):
        super().__init__(config)
        self.store: ProfileStore | None = None
        self.builder = ProfileBuilder(config.model, config.device, config.dtype, config.page_tokens, config.torch_threads,
                                      config.kv_dtype)
        # NOTE: calibration runs torch on this one thread; handlers never call torch directly
        self.torch_thread = TorchThread()
        self._locks: dict[str, asyncio.Lock] = {}
        self.builds_running = 0
        self.is_learning_online = config.online_updates  # benchmarks freeze profiles while they measure
        self.online_updates = self.metrics.counter("smartgen_profile_online_updates_total",
                                                   "Selection statistics applied to stored profiles")
        self.online_skipped = self.metrics.counter("smartgen_profile_online_skipped_total",
                                                   "Selection statistics dropped while online updates were off")
        self.builds = self.metrics.counter("smartgen_profile_builds_total", "Profile builds by outcome", ["status"])

    async def start(self, nc: Client, micro: MicroService) -> None:
        self.store = await ProfileStore.open(nc.jetstream(), self.config.bucket, self.config.bucket_replicas)
        await self.add_endpoints(micro, get=endpoint(ProfileQuery, self.get), list=endpoint(ListQuery, self.list),
                                 show=endpoint(ProfileKey, self.show), build=endpoint(BuildProfile, self.build),
                                 delete=endpoint(ProfileKey, self.delete))
        await nc.subscribe(subjects.PROFILE_STATS, cb=subscriber(SelectionStats, self.on_stats))

    # --- handlers ------------------------------------------------------------------------
    async def get(self, query: ProfileQuery) -> Profile:
        if query.num_tokens < 1:
            raise RequestRefused(ErrorCode.BAD_REQUEST, "num_tokens must be positive")
        return await self.show(ProfileKey(profile_key(query.model, query.selector, bucket_for(query.num_tokens))))

    async def show(self, query: ProfileKey) -> Profile:
        assert self.store
        _check_key(query.key)
        profile = await self.store.get(query.key)
        if profile is None:
            raise RequestRefused(ErrorCode.NOT_FOUND, f"no profile {query.key!r}: build one with `smartgen profile build`")
        return profile

    async def list(self, query: ListQuery) -> ProfileList:
        assert self.store
        return ProfileList(self.config.bucket, [k for k in await self.store.keys() if k.startswith(query.prefix)])

    async def delete(self, query: ProfileKey) -> Ack:
        assert self.store
        _check_key(query.key)
        if not await self.store.delete(query.key):
            raise RequestRefused(ErrorCode.NOT_FOUND, f"no profile {query.key!r}")
        log.info("profile_deleted", key=query.key)
        await self._announce(ProfileInfo(query.key, 0, "", deleted=True))
        return Ack()

    async def build(self, req: BuildProfile) -> ProfileInfo:
        assert self.store and self.nc
        if req.selector not in SELECTORS:
            raise RequestRefused(ErrorCode.BAD_REQUEST, f"selector {req.selector!r} is not one of {', '.join(SELECTORS)}")
        if not (16 <= req.prompt_tokens and 1 <= req.num_prompts <= 64 and 1 <= req.decode_steps <= 512):
            raise RequestRefused(ErrorCode.BAD_REQUEST, "a build needs prompt_tokens ≥ 16, 1–64 prompts and 1–512 decode steps")
        if problem := kv_budget_problem(req.kv_budget):
            raise RequestRefused(ErrorCode.BAD_REQUEST, problem)
        loop = asyncio.get_running_loop()
        nc = self.nc

        def on_progress(done: int, total: int, stage: str) -> None:  # torch thread
            if req.progress_subject:
                loop.call_soon_threadsafe(asyncio.ensure_future,
                                          nc.publish(req.progress_subject, encode(BuildProgress(done, total, stage))))

        started = time.monotonic()
        self.builds_running += 1
        try:
            importance, num_prompts = await self.torch_thread.run(
                self.builder.build, req.selector, req.prompt_tokens, req.num_prompts, req.decode_steps, req.kv_budget,
                NUM_BLOCKS, on_progress)
        except (ValueError, FileNotFoundError) as exc:  # unknown selector, missing preparation or model
            self.builds.inc(status="refused")
            raise RequestRefused(ErrorCode.BAD_REQUEST, str(exc)) from None
        finally:
            self.builds_running -= 1
        model = await self.torch_thread.run(lambda: self.builder.model_name)  # NOTE: loads the model if need be
        key = profile_key(model, req.selector, bucket_for(req.prompt_tokens))
        async with self._lock(key):
            old = await self.store.get(key)
            profile = Profile(key, model, req.selector, bucket_for(req.prompt_tokens), (old.version if old else 0) + 1,
                              importance.shape[0], importance.shape[1], importance.astype(np.float32).tobytes(),
                              "calibration", num_prompts, 0, time.time())
            await self.store.put(profile)
        self.builds.inc(status="ok")
        log.info("profile_built", key=key, version=profile.version, prompts=num_prompts,
                 build_s=round(time.monotonic() - started, 1))
        info = _info(profile)
        await self._announce(info)
        return info

    async def on_stats(self, stats: SelectionStats) -> None:
        """Online profiling: fold one request's selections into its bucket's profile, bounded by online_weight."""
        assert self.store
        if not self.is_learning_online:
            self.online_skipped.inc()
            return
        problem = _stats_problem(stats)
        if problem:
            log.warning("bad_selection_stats", error=problem)
            return
        selected = np.frombuffer(stats.selected, dtype=np.float32).reshape(stats.num_layers, stats.num_blocks)
        offered = np.frombuffer(stats.offered, dtype=np.float32)
        if not (np.isfinite(selected).all() and np.isfinite(offered).all() and (selected >= 0).all()
                and (offered >= 0).all()):  # counts: NaN or negative ones would poison the stored profile
            log.warning("bad_selection_stats", error="selected and offered must be finite counts ≥ 0")
            return
        observed, seen = observed_importance(selected, offered)
        key = profile_key(stats.model, stats.selector, bucket_for(stats.num_tokens))
        async with self._lock(key):
            old = await self.store.get(key)
            if old is not None and (old.num_layers, old.num_blocks) != selected.shape:
                log.warning("selection_stats_mismatch", key=key, stored=(old.num_layers, old.num_blocks),
                            got=selected.shape)
                return
            importance = online_update(importance_of(old) if old else None, observed, seen, self.config.online_weight)
            if old is None:
                version, source, prompts, updates = 1, "online", 0, 1
            else:
                version, source, prompts, updates = old.version + 1, old.source, old.num_prompts, old.num_updates + 1
            profile = Profile(key, stats.model, stats.selector, bucket_for(stats.num_tokens), version,
                              stats.num_layers, stats.num_blocks, importance.astype(np.float32).tobytes(), source,
                              prompts, updates, time.time())
            await self.store.put(profile)
        self.online_updates.inc()
        await self._announce(_info(profile))

    # --- internals -------------------------------------------------------------------------
    def _lock(self, key: str) -> asyncio.Lock:
        return self._locks.setdefault(key, asyncio.Lock())

    async def _announce(self, info: ProfileInfo) -> None:
        if self.nc is not None:
            await self.nc.publish(subjects.PROFILE_UPDATED, encode(info))

    def is_ready(self) -> bool:
        return super().is_ready() and self.store is not None

    async def stop(self) -> None:
        self.torch_thread.close()

    # --- admin -----------------------------------------------------------------------------
    def admin_routes(self) -> list[web.RouteDef]:
        async def profiles(_: web.Request) -> web.Response:
            assert self.store
            listed = [await self.store.get(k) for k in await self.store.keys()]
            return web.json_response({"bucket": self.config.bucket,
                                      "profiles": [vars_of(_info(p)) for p in listed if p is not None]})

        async def show(request: web.Request) -> web.Response:
            try:
                profile = await self.show(ProfileKey(request.match_info["key"]))
            except RequestRefused as exc:
                return web.json_response({"error": exc.message}, status=404)
            rows = importance_of(profile)
            return web.json_response({**vars_of(_info(profile)), "model": profile.model, "selector": profile.selector,
                                      "bucket": profile.bucket, "num_layers": profile.num_layers,
                                      "num_blocks": profile.num_blocks,
                                      "importance": [[round(float(x), 5) for x in row] for row in rows]})

        async def build(request: web.Request) -> web.Response:
            try:
                req = from_plain(BuildProfile, await request.json())
                info = await self.build(req)
            except ValueError as exc:  # not JSON, or not a BuildProfile (SchemaError names the field)
                return web.json_response({"error": f"bad build request: {exc}"}, status=400)
            except RequestRefused as exc:
                return web.json_response({"error": exc.message}, status=400)
            return web.json_response(vars_of(info))

        async def delete(request: web.Request) -> web.Response:
            try:
                await self.delete(ProfileKey(request.match_info["key"]))
            except RequestRefused as exc:
                return web.json_response({"error": exc.message}, status=404)
            return web.json_response({"deleted": request.match_info["key"]})

        async def online(request: web.Request) -> web.Response:
            """POST /online {"enabled": bool}: refresh profiles from served requests, or freeze them."""
            try:
                enabled = (await request.json())["enabled"]
                if not isinstance(enabled, bool):
                    raise TypeError
            except (ValueError, KeyError, TypeError):
                return web.json_response({"error": 'send {"enabled": true} or {"enabled": false}'}, status=400)
            self.is_learning_online = enabled
            log.info("online_updates", enabled=enabled)
            return web.json_response({"enabled": enabled})

        def is_open() -> bool:
            return self.store is not None

        return [web.get("/profiles", _bucket_answers(profiles, is_open)),
                web.get("/profiles/{key}", _bucket_answers(show, is_open)),
                web.post("/profiles/build", _bucket_answers(build, is_open)),
                web.delete("/profiles/{key}", _bucket_answers(delete, is_open)), web.post("/online", online)]

    def stats(self) -> dict[str, Any]:
        return {"bucket": self.config.bucket, "ready": self.is_ready(), "builds_running": self.builds_running,
                "online_updates": self.online_updates.value(), "online_weight": self.config.online_weight,
                "online_learning": self.is_learning_online, "online_skipped": self.online_skipped.value()}


def _bucket_answers(handler: Callable[[web.Request], Awaitable[web.Response]],
                    is_open: Callable[[], bool]) -> Callable[[web.Request], Awaitable[web.Response]]:
    """A route over the JetStream bucket answers 503 (JSON, saying why) while the bucket is not open yet (the
    service starts its admin routes first; a fresh NATS cluster may take seconds to create it) or cannot be reached,
    e.g. while a NATS cluster elects a new leader, instead of a bare 500."""
    @functools.wraps(handler)
    async def answer(request: web.Request) -> web.Response:
        if not is_open():
            return web.json_response({"error": "the profiles bucket is not open yet (JetStream is starting); try again"},
                                     status=503, headers={"Retry-After": "2"})
        try:
            return await handler(request)
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            log.warning("profiles_bucket_unreachable", error=repr(exc))
            return web.json_response({"error": f"the profiles bucket cannot be reached now ({exc!r}); try again"},
                                     status=503, headers={"Retry-After": "2"})
    return answer


def _check_key(key: str) -> None:
    if len(key) > MAX_KEY_CHARS or not PROFILE_KEY.fullmatch(key):
        raise RequestRefused(ErrorCode.BAD_REQUEST, f"{key[:60]!r} is not a profile key (model.selector.bucket, as "
                                            "`smartgen profile list` shows them)")


def _stats_problem(stats: SelectionStats) -> str:
    """Why a SelectionStats cannot be folded into a profile ("" when it can); checked before any array is made."""
    if stats.selector not in SELECTORS or stats.num_tokens < 1:
        return f"selector {stats.selector!r}, {stats.num_tokens} tokens"
    if stats.num_layers < 1 or stats.num_blocks != NUM_BLOCKS:
        return f"{stats.num_layers} layers × {stats.num_blocks} blocks; profiles have ≥ 1 × {NUM_BLOCKS}"
    if len(stats.selected) != 4 * stats.num_layers * stats.num_blocks or len(stats.offered) != 4 * stats.num_blocks:
        return "selected and offered must be float32 (num_layers, num_blocks) and (num_blocks,)"
    return ""


def _info(profile: Profile) -> ProfileInfo:
    return ProfileInfo(profile.key, profile.version, profile.source, profile.num_prompts, profile.num_updates,
                       profile.updated_unix)


def vars_of(info: ProfileInfo) -> dict[str, Any]:
    return {f: getattr(info, f) for f in info.__slots__}  # type: ignore[attr-defined]

