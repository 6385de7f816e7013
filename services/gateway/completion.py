"""One request's trip through the system, seen from the gateway. The calls that start it (steps 1 and 3) are in
dispatch.py, what it does when a worker is lost mid-request (step 5) in migration.py; both are mixed into
CompletionRun.

  1. Pick a decode worker (and, unless colocated, a prefill worker and the broker): least loaded first; in full
     mode, the decode worker holding the prompt's longest cached prefix, unless it is much busier (routing.py).
     A decode worker without room for the request's pages refuses (`overloaded`); the next one is asked,
     and only when every live one has refused is the answer a 429 (a 503 if some were gone rather than full).
  2. Subscribe to the request's stream subject before anything can be published on it.
  3. Disaggregated modes: `decode.open` reserves the slab (and its aux area) and returns the KvHandle →
     `broker.open` returns the TransferPlan (resolving `auto`) → `prefill.prefill` runs the prompt, pushing
     what the plan says straight to those pages, and returns token 1 (and, for partial and smartgen, the
     KvSource of what stayed behind) → `decode.generate` continues from it.
     colocated: `decode.generate` does both phases itself.
  4. Tokens arrive on the stream; each is stamped on arrival here (what a client sees). A worker that stops
     heartbeating, or a reply or token events lost in a NATS reconnect, fails the request at once
     (liveness.py) instead of after a long timeout; so does a gap in the stream's token indices.
  5. failure_policy `recompute`: a prefill that fails before token 1 is left behind and the decode worker
     runs the prefill itself (Generate with `first_token` -1); a prefill that dies later is reported to the
     decode worker (`transfer_failed`), which recomputes if the KV stops coming; a decode worker that dies
     mid-request is replaced: the request resumes on another one, colocated. The response says so.
  6. `close()` always runs: if the request did not finish (client gone, stop string, error), both workers
     get `abort` and the broker hears the plan failed, so nothing stays allocated.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import structlog
from nats.aio.client import Client

from schemas import (ErrorCode, PlanState, Abort, Ack, PlanEvent, ResendTokens, Sampling, SchemaError, TokenBacklog,
                     TokenEvent, TokenLogprobs, TransferPlan, WorkerInfo, decode, mode_of, subjects)
from schemas.modes import ModeName
from shared.runtime.rpc import RemoteError, call, publish
from shared.runtime.registry import WorkerRegistry
from services.gateway.dispatch import BROKER_WAIT_S, CONTROL_TIMEOUT_S, Dispatch
from services.gateway.liveness import DecodeLost, EventsLost, Liveness, RequestFailed
from services.gateway.migration import Migration
from services.gateway.requests import ApiError, CompletionJob
from services.gateway.routing import PrefixRoutes

__all__ = ["CompletionRun", "RequestFailed"]
log = structlog.get_logger()
T = TypeVar("T")
LIVENESS_POLL_S = 0.5  # while waiting on a worker, how often to check that its heartbeats still come
_background: set[asyncio.Task[None]] = set()  # aborts sent to workers that stopped heartbeating (see _abort)


@dataclass
class CompletionRun(Dispatch, Migration):
    """One request's trip; the calls that start it are in dispatch.py, what it does when a worker fails in
    migration.py."""
    nc: Client
    registry: WorkerRegistry
    job: CompletionJob
    stop_token_ids: list[int]
    timeout_s: float
    gateway_id: str = ""  # this gateway's worker id, in every Generate: decode aborts the request if it dies
    routes: PrefixRoutes | None = None  # KV-aware routing of full-mode requests (routing.py); None: by load only
    prefill_routes: PrefixRoutes | None = None  # … and of every prefill to the worker whose prefix cache holds the most
    token_ids: list[int] = field(default_factory=list)
    token_times_s: list[float] = field(default_factory=list)
    finish_reason: str = ""
    kv_bytes: dict[str, int] = field(default_factory=dict)
    kv_wait_s: float = 0.0
    selected_share: float = 1.0
    final: TokenEvent | None = None  # the stream's last event (transfer figures)
    prefill_s: float | None = None  # the prefill's compute, plus step 1 where the prefill node ran it (exact push)
    prefill_step1_s: float = 0.0  # of prefill_s, step 1 run on the prefill node before token 1 (PrefillDone.step_one_s)
    exact_from_layer: int = 0  # PrefillDone.exact_from_layer: the first layer that pushed step 1's exact selection
    num_cached_tokens: int = 0  # PrefillDone.num_cached_tokens: prompt tokens the prefill took from its prefix cache
    decode_cached_tokens: int = 0  # KvHandle.cached_tokens: prompt tokens the decode worker had cached (not pushed)
    page_tokens: int = 0  # KvHandle.layout.page_tokens: the decode worker's page size (0: no handle)
    prefill: WorkerInfo | None = None
    decode: WorkerInfo | None = None
    broker: WorkerInfo | None = None
    plan: TransferPlan | None = None
    mode: str = ""  # the mode that ran (auto resolved)
    selector: str = ""  # the selector that ran ("" = dense)
    kv_bits: int = 0  # the code width that ran (auto: the plan's; 0 = exact KV)
    decode_layers: int = 0  # from the KvHandle, to report the plan's block count
    recompute_reason: str = ""  # failure_policy recompute: why the decode worker recomputed the prefill
    queue_s: float = 0.0  # time spent in the gateway's admission queue before it started
    client_gone: bool = False  # the client disconnected before the end (counted apart from failures)
    migrated_from: list[str] = field(default_factory=list)  # decode workers that died while streaming this request
    token_logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # per token, when the job asks (logprobs ≥ 0)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # prompt tokens 1…N-1 (echo with logprobs)
    _liveness: Liveness | None = None
    # Whether the prefill's death matters now: "push" until decode's first event (decode may wait on its pushes),
    # then "reads" to the end in partial and smartgen modes (decode reads the rest of the KV from it), else "".
    _watch_prefill: str = ""
    _next_index: int = 0  # the index the next token event must have
    _aborted: set[str] = field(default_factory=set)  # workers already told to abort
    _plan_asked: bool = False  # broker.open was sent: the broker may hold a plan even if its reply never came
    _sub: Any = None
    _closed: bool = False

    async def tokens(self) -> AsyncIterator[int]:
        """Yield completion token ids as they arrive. Raises ApiError before the first token, RequestFailed after."""
        job = self.job
        self.mode, self.selector, self.kv_bits = job.transfer_mode, job.selector or "", job.kv_bits
        self._liveness = Liveness(self.nc, self.registry, job.request_id)
        by_kv = self.routes is not None and job.transfer_mode == ModeName.FULL  # KV-aware routing (routing.py)
        self.decode = self._pick("decode", self.routes.cached_tokens(job.prompt_ids) if by_kv else None)
        disaggregated = mode_of(job.transfer_mode).is_disaggregated
        prefill_hit = 0  # the prompt tokens prefill_routes expects the picked prefill worker to hold (OpenPlan)
        if disaggregated:
            held = self.prefill_routes.cached_tokens(job.prompt_ids) if self.prefill_routes is not None else {}
            self.prefill, self.broker = self._pick("prefill", held), await self._pick_within("broker", BROKER_WAIT_S)
            prefill_hit = held.get(self.prefill.worker_id, 0)
        self._sub = await self.nc.subscribe(subjects.stream(job.request_id))
        sampling = Sampling(job.temperature, job.seed, top_p=job.top_p, top_k=job.top_k,
                            presence_penalty=job.presence_penalty, frequency_penalty=job.frequency_penalty,
                            repetition_penalty=job.repetition_penalty, logit_bias=job.logit_bias, logprobs=job.logprobs,
                            echo=job.echo and job.logprobs >= 0, min_p=job.min_p, min_tokens=job.min_tokens,
                            end_ids=list(self.stop_token_ids), grammar=job.structure.grammar)
        first, done = -1, None
        try:
            if not disaggregated:
                await self._on_some_decode(lambda: self._generate(first, None, sampling))
            else:
                handle = await self._open(prefill_hit)
                done = await self._run_prefill(handle, sampling)
                if done is not None:
                    first, self.prefill_s = done.first_token, done.prefill_s + done.step_one_s
                    self.prefill_step1_s = done.step_one_s
                    self.exact_from_layer = done.exact_from_layer
                    self.num_cached_tokens = done.num_cached_tokens
                    self.prompt_logprobs = done.prompt_logprobs
                    self._remember_prefill()
                try:
                    await self._generate(first, done, sampling)
                except (RemoteError, DecodeLost) as exc:
                    # NOTE: the decode worker that reserved the KV died after `open`: nobody answers `generate`, or
                    # it stopped its heartbeats. Under recompute the request starts over on another one, colocated,
                    # from its prompt.
                    if getattr(exc, "code", ErrorCode.UNAVAILABLE) is not ErrorCode.UNAVAILABLE or job.failure_policy != "recompute":
                        raise
                    await self._migrate(f"decode worker {self.decode.worker_id} did not answer generate", sampling)
                    first, done = -1, None
        except RemoteError as exc:
            status = 429 if exc.code.is_busy else {ErrorCode.UNAVAILABLE: 503, ErrorCode.BAD_REQUEST: 400}.get(exc.code, 502)
            raise ApiError(status, f"{exc.message}", code=ErrorCode.OVERLOADED if exc.code.is_busy else exc.code) from None
        self._watch_prefill = "push" if done is not None else ""
        self._next_index = 0 if first < 0 else 1
        if first >= 0:
            yield self._stamp(first, done.first_logprobs if done is not None else None)
        while True:
            try:
                async for event in self._events():
                    if event.prompt_logprobs:  # colocated: the prefill ran on the decode worker
                        self.prompt_logprobs = event.prompt_logprobs
                    if event.token_id >= 0:
                        yield self._stamp(event.token_id, event.logprobs)
                    if event.finish_reason:
                        self.final = event
                        self.kv_bytes, self.kv_wait_s, self.selected_share = event.kv_bytes, event.kv_wait_s, event.selected_share
                        self.recompute_reason = self.recompute_reason or event.recompute_reason
                        if event.finish_reason == "error":
                            raise RequestFailed(f"decode worker {self.decode.worker_id}: {event.error}")
                        self.finish_reason = event.finish_reason
                        self._remember_kv()
                        return
            except DecodeLost as exc:
                if await self._outlive_lost_decode(exc, sampling):  # it died after the last token: the answer stands
                    return

    def _remember_kv(self) -> None:
        """A full-mode request finished: its decode worker's prefix cache now holds its prompt's full pages (what
        the decode worker keeps: services/decode/service.py)."""
        if self.routes is not None and self.mode == ModeName.FULL and self.page_tokens and self.decode is not None:
            self.routes.record(self.decode.worker_id, self.job.prompt_ids, self.page_tokens)

    def _remember_prefill(self) -> None:
        """A prefill finished: its worker's prefix cache, where it has one, now holds the prompt's full pages
        (services/prefill keeps them after its reply; the pool may evict them later: an estimate)."""
        if self.prefill_routes is not None and self.prefill is not None and self.prefill.prefix_cache_mb and self.page_tokens:
            self.prefill_routes.record(self.prefill.worker_id, self.job.prompt_ids, self.page_tokens)

    async def _events(self) -> AsyncIterator[TokenEvent]:
        """The decode worker's token events, in order, each once. Events lost on the way (NATS is at most once: a
        reconnect, or a server that died with them) are asked for again (`resend`) and given in their place."""
        assert self.decode
        while True:
            also = [self.prefill] if self._watch_prefill and self.prefill else []
            try:
                # NOTE: not wait_for: on Python 3.11 it returns the result, and drops the cancellation, when a token
                # arrives as the request is cancelled (a client that left): the run went on to max_tokens
                async with asyncio.timeout(self.timeout_s):
                    msg = await self._wait(self._sub.next_msg(timeout=None), self.decode, "decoding", also)
            except asyncio.TimeoutError:
                raise RequestFailed(f"no token from decode worker {self.decode.worker_id} within {self.timeout_s:g} s") from None
            except EventsLost as exc:  # the last events (the final one at least) never came
                async for event in self._resent(str(exc)):
                    yield event
                    if event.finish_reason:
                        return
                continue
            if self._watch_prefill == "push":
                self._watch_prefill = "reads" if mode_of(self.mode).keeps_source else ""
            try:
                event = decode(TokenEvent, msg.data)
            except SchemaError as exc:
                log.warning("bad_token_event", error=str(exc))
                continue
            counted = event.token_id >= 0 or event.finish_reason in ("length", "stop")  # these carry an index
            if counted and event.index > self._next_index:  # a gap: the events before this one were lost
                async for resent in self._resent(f"expected token index {self._next_index}, got {event.index}"):
                    yield resent
                    if resent.finish_reason:
                        return
            if event.token_id >= 0 and event.index < self._next_index:
                continue  # already given (resent)
            if event.token_id >= 0:
                self._next_index += 1
            yield event

    async def _resent(self, why: str) -> AsyncIterator[TokenEvent]:
        """Ask the decode worker for the tokens from `_next_index` on (and the last event, if it is out), and give
        them as the events that were lost. RequestFailed if it cannot say."""
        assert self.decode and self._liveness
        log.warning("token_events_lost", why=why, from_index=self._next_index)
        try:
            backlog = await call(self.nc, subjects.worker("decode", self.decode.worker_id, "resend"),
                                 ResendTokens(self.job.request_id, self._next_index), TokenBacklog, CONTROL_TIMEOUT_S)
        except (RemoteError, asyncio.TimeoutError) as exc:
            raise RequestFailed(f"token events from decode worker {self.decode.worker_id} were lost ({why}) and could "
                                f"not be asked for again: {exc}") from None
        self._liveness.heard()
        for offset, token in enumerate(backlog.token_ids):
            if backlog.from_index + offset == self._next_index:
                self._next_index += 1
                yield TokenEvent(self.job.request_id, backlog.from_index + offset, token)
        if backlog.final is not None:
            yield backlog.final

    async def _wait(self, awaitable: Awaitable[T], awaited: WorkerInfo, what: str,
                    also: list[WorkerInfo] | None = None, is_listed: bool = True) -> T:
        """Await `awaitable` (a reply or the next token from `awaited`), but fail at once, within the heartbeat
        TTL, if `awaited` or a worker in `also` dies meanwhile or (`is_listed`: `awaited` lists the request in its
        heartbeats) what we wait for was lost in a NATS reconnect, instead of waiting out a long timeout. Under failure_policy `recompute` a dead prefill in `also` is
        reported to the decode worker instead, which carries on without it."""
        assert self._liveness
        task = asyncio.ensure_future(awaitable)
        also = list(also or [])
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=LIVENESS_POLL_S)
                if done:
                    self._liveness.heard()  # something came: the worker still had the request
                    return task.result()
                for worker in self._liveness.dead([awaited, *also]):
                    # NOTE: once decoding, the decode worker decides: it fails (or recomputes) only if it still
                    # needs KV from the dead prefill; a request already all local completes.
                    if worker is awaited or (self.job.failure_policy != "recompute" and self._watch_prefill != "reads"):
                        lost = DecodeLost if worker is awaited and worker.role == "decode" else RequestFailed
                        raise lost(f"{worker.role} worker {worker.worker_id} stopped sending heartbeats during {what}")
                    also.remove(worker)
                    await self._report_prefill_lost(worker)
                if is_listed:
                    self._liveness.check_not_lost(awaited, what)
        finally:
            if not task.done():
                task.cancel()

    def _stamp(self, token_id: int, logprobs: TokenLogprobs | None) -> int:
        self.token_ids.append(token_id)
        self.token_logprobs.append(logprobs)
        self.token_times_s.append(time.monotonic() - self.job.arrival)
        return token_id

    def stop_early(self, reason: str) -> None:
        """The gateway ended the stream itself (a stop string): close() will abort the workers."""
        self.finish_reason = reason

    async def close(self) -> None:
        """Unsubscribe, and abort the workers if the request did not finish on its own. Idempotent."""
        if self._closed:
            return
        self._closed = True
        unfinished = not self.finish_reason or self.finish_reason == "stop_string"
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception as exc:  # NATS closing or reconnecting: the aborts below matter more
                log.warning("unsubscribe_failed", error=str(exc))
        if unfinished:
            reason = self.finish_reason or "client_gone"
            for worker in (self.prefill, self.decode):  # the writer stops first, then the slab it writes to is freed
                if worker is not None:
                    await self._abort(worker, reason)
            broker_id = self.plan.broker_worker_id if self.plan else self.broker.worker_id if self.broker else ""
            if self._plan_asked and broker_id:
                try:
                    await publish(self.nc, subjects.worker("broker", broker_id, "event"),
                                  PlanEvent(self.job.request_id, PlanState.FAILED, f"aborted: {reason}"))
                except Exception as exc:  # NATS closing: the broker expires the plan instead
                    log.warning("plan_event_failed", error=str(exc))
        if self.finish_reason == "stop_string":
            self.finish_reason = "stop"

    async def _abort(self, worker: WorkerInfo, reason: str, wait: bool = True) -> None:
        """Tell `worker` to drop the request (once). A worker that stopped heartbeating gets it in the background:
        it may be paused rather than dead, and must not hold up the client's answer."""
        if worker.worker_id in self._aborted:
            return
        self._aborted.add(worker.worker_id)

        async def abort() -> None:
            try:
                await call(self.nc, subjects.worker(worker.role, worker.worker_id, "abort"),
                           Abort(self.job.request_id, reason), Ack, CONTROL_TIMEOUT_S)
            except Exception as exc:  # RemoteError, or NATS closing: the worker's own timeouts free the request
                log.warning("abort_failed", worker_id=worker.worker_id, error=str(exc))

        if wait and self.registry.is_alive(worker.worker_id):
            await abort()
        else:
            task = asyncio.create_task(abort())
            _background.add(task)
            task.add_done_callback(_background.discard)
