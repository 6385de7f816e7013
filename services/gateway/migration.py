"""Step 5 of a request's trip (completion.py): a worker lost mid-request. Mixed into CompletionRun. (A decode
worker that refuses or is gone before the request runs there is passed over in dispatch.py, `_on_some_decode`.)

  - A decode worker that dies mid-request: if the tokens already end the answer, it stands; under failure_policy
    `recompute` the request resumes on another decode worker, colocated, replaying the tokens streamed so far on a
    stream subject of its own (`_migrate`, at most MAX_MIGRATIONS times); otherwise it fails. Either way the lost
    worker, the prefill's KV kept for its reads and the plan are let go of.
  - A prefill worker that dies is reported to the decode worker (`transfer_failed`), which recomputes or fails.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import structlog

from schemas import PlanState, Accepted, Generate, PlanEvent, Sampling, TransferFailed, WorkerInfo, subjects
from schemas.modes import ModeName
from shared.runtime.rpc import RemoteError, call, publish
from services.gateway.dispatch import CONTROL_TIMEOUT_S
from services.gateway.liveness import DecodeLost, RequestFailed

if TYPE_CHECKING:
    from services.gateway.completion import CompletionRun

log = structlog.get_logger()
MAX_MIGRATIONS = 2  # failure_policy recompute: decode workers a request may outlive before it fails


class Migration:
    async def _outlive_lost_decode(self: CompletionRun, exc: DecodeLost, sampling: Sampling) -> bool:
        """The decode worker streaming the request died (or froze). True: the tokens here already end the answer,
        which stands as it is. False: the request resumed on another decode worker (failure_policy `recompute`, at
        most MAX_MIGRATIONS times). Otherwise `exc` is raised again: the request fails."""
        assert self.decode is not None
        if reason := self._answer_complete():
            log.warning("decode_lost_after_last_token", decode_worker_id=self.decode.worker_id)
            await self._let_go_of_lost_decode(f"{exc} after the answer's last token")
            self.finish_reason = reason
            return True
        if self.job.failure_policy != "recompute" or len(self.migrated_from) >= MAX_MIGRATIONS:
            raise exc
        await self._migrate(str(exc), sampling)
        return False

    def _answer_complete(self: CompletionRun) -> str:
        """"length" or "stop" when the tokens here already end the answer (max_tokens, or an end id last), else ""."""
        if len(self.token_ids) >= self.job.max_tokens:
            return "length"
        return "stop" if self.token_ids and self.token_ids[-1] in self.stop_token_ids else ""

    async def _let_go_of_lost_decode(self: CompletionRun, why: str) -> None:
        """The decode worker died (or froze): abort it in case it was only frozen, free the prefill's KV held for its
        reads, and end the transfer plan it was fed by."""
        assert self.decode is not None
        await self._abort(self.decode, why, wait=False)
        if self.prefill is not None:
            await self._abort(self.prefill, "its decode worker died", wait=False)
        self._watch_prefill = ""
        if self._plan_asked and self.plan is not None:
            await publish(self.nc, subjects.worker("broker", self.plan.broker_worker_id, "event"),
                          PlanEvent(self.job.request_id, PlanState.FAILED, why))

    async def _migrate(self: CompletionRun, why: str, sampling: Sampling) -> None:
        """failure_policy `recompute`, the decode worker died mid-request: move the request to another decode
        worker, which recomputes the prompt, replays the tokens already streamed and goes on from there, in
        colocated mode (its greedy tokens are colocated's), on a stream subject of its own (a worker that was
        only frozen must not interleave late tokens). The client sees one stream. RequestFailed if none is left."""
        job, lost = self.job, self.decode
        assert lost is not None
        self.migrated_from.append(lost.worker_id)
        log.warning("decode_lost_resuming", decode_worker_id=lost.worker_id, tokens_so_far=len(self.token_ids))
        await self._let_go_of_lost_decode(f"{why}; resumed colocated")
        self.decode = self.registry.pick("decode", exclude=set(self.migrated_from))
        if self.decode is None:
            raise RequestFailed(f"{why}, and no other decode worker is registered to resume on")
        await self._sub.unsubscribe()
        subject = f"{subjects.stream(job.request_id)}.resume{len(self.migrated_from)}"
        self._sub = await self.nc.subscribe(subject)
        self.recompute_reason = f"{why}; resumed on decode worker {self.decode.worker_id} after {len(self.token_ids)} tokens"
        self.mode, self.kv_bits = ModeName.COLOCATED, 0
        resume = Generate(job.request_id, ModeName.COLOCATED, job.prompt_ids, -1, job.max_tokens, self.stop_token_ids,
                          sampling, subject, self.selector, job.kv_budget if self.selector else None,
                          failure_policy=job.failure_policy, resume_tokens=list(self.token_ids), gateway_id=self.gateway_id)
        try:
            await self._on_some_decode(lambda: call(self.nc, subjects.worker("decode", self.decode.worker_id, "generate"),
                                                    resume, Accepted, CONTROL_TIMEOUT_S))
        except RemoteError as exc:
            raise RequestFailed(f"{why}; resuming on decode worker {self.decode.worker_id} failed: {exc}") from None

    async def _report_prefill_lost(self: CompletionRun, prefill: WorkerInfo) -> None:
        """Tell the decode worker that this prefill's pushes or on-demand reads will not be served: under failure
        policy recompute it recomputes; while decoding, it fails the request only if it still needs that KV."""
        assert self.decode
        phase, self._watch_prefill = self._watch_prefill, ""
        log.warning("prefill_lost", prefill_worker_id=prefill.worker_id, failure_policy=self.job.failure_policy,
                    phase=phase)
        failed = TransferFailed(self.job.request_id, f"prefill worker {prefill.worker_id} stopped sending heartbeats")
        await publish(self.nc, subjects.worker("decode", self.decode.worker_id, "transfer_failed"), failed)
