"""The OpenAI-compatible HTTP API: request parsing, JSON and SSE responses.

POST /v1/completions, POST /v1/chat/completions (stream or not), GET /workers, GET /openapi.json (openapi.py: what
all of these take and answer); utility.py: GET /v1/models(/{id}), POST /tokenize, /detokenize, GET /version.
Every response (and the last SSE chunk) carries a `smartgen` object with the request's latency and
transfer figures. Bad requests get a 400 with an OpenAI-style error body and touch no worker;
429 and 503 carry a Retry-After header.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Protocol

import structlog
from aiohttp import web
from nats.aio.client import Client

from services.gateway.admission import Admission, Slot, client_of
from services.gateway.completion import CompletionRun, RequestFailed
from services.gateway.errors import error_response as _error
from services.gateway.logprobs import chat_logprobs, completion_logprobs, echo_problem
from services.gateway.openapi import openapi_document
from services.gateway.report import summary
from services.gateway.sse import REQUEST_ID_HEADER, stream, usage
from services.gateway.structured import tool_calls
from services.gateway.requests import ApiError, CompletionJob, parse_jobs
from services.gateway.config import GatewayConfig
from services.gateway.textstream import TextStream
from services.gateway.utility import read_json, utility_routes
from shared.runtime import tracing
from shared.runtime.registry import WorkerRegistry
from services.gateway.routing import PrefixRoutes


class Gateway(Protocol):
    """What the routes need of the gateway service (service.py implements it)."""

    config: GatewayConfig
    nc: Client | None
    registry: WorkerRegistry
    routes: PrefixRoutes  # which decode worker holds a prompt's longest cached prefix
    prefill_routes: PrefixRoutes  # … and which prefill worker
    tokenizer: Any  # a transformers tokenizer
    model_id: str
    max_positions: int
    started_unix: float
    stop_token_ids: list[int]
    worker_id: str
    draining: bool
    is_started: bool  # NATS connected and workers followed (the HTTP server starts first)

    admission: Admission

    def record(self, run: CompletionRun) -> None:
        """Count a finished request in /metrics."""

log = structlog.get_logger()
# REQUEST_ID_HEADER: a client's id for its request, used as the request id and echoed in the reply


def routes(gw: Gateway) -> list[web.RouteDef]:
    async def completions(request: web.Request) -> web.StreamResponse:
        return await _serve(gw, request, "completion")

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        return await _serve(gw, request, "chat")

    async def workers(_: web.Request) -> web.Response:
        return web.json_response({"workers": [
            {"role": w.role, "id": w.worker_id, "pid": w.pid, "host": w.host, "admin_url": w.admin_url,
             "dataplane_addr": w.dataplane_addr, "active_requests": w.active_requests,
             "kv_pages_free": w.kv_pages_free, "kv_pages_total": w.kv_pages_total}
            for w in gw.registry.alive()]})

    document = openapi_document(gw.model_id, gw.max_positions, len(gw.tokenizer))

    async def openapi(_: web.Request) -> web.Response:
        return web.json_response(document)

    return [web.post("/v1/completions", completions), web.post("/v1/chat/completions", chat_completions),
            web.get("/workers", workers), web.get("/openapi.json", openapi), *utility_routes(gw)]


async def _serve(gw: Gateway, request: web.Request, kind: str) -> web.StreamResponse:
    if gw.draining:  # stopping: the requests in progress finish, new ones go to another gateway (or come back)
        return _error(ApiError(503, "this gateway is stopping; try again shortly", code="draining", retry_after_s=1))
    if not gw.is_started:  # the HTTP server is up before NATS (its address is registered there)
        return _error(ApiError(503, "this gateway is starting; try again shortly", code="starting", retry_after_s=1))
    try:
        body = await read_json(request)
    except ApiError as exc:
        return _error(exc)
    try:
        default_max = gw.config.max_tokens_default if kind == "completion" else gw.config.chat_max_tokens_default
        jobs = parse_jobs(body, kind, gw.tokenizer, gw.max_positions, gw.model_id, gw.config.transfer_mode,
                          default_max, gw.config.default_selector, request.headers.get(REQUEST_ID_HEADER))
    except ApiError as exc:
        response = _error(exc)
        if exc.param != REQUEST_ID_HEADER and REQUEST_ID_HEADER in request.headers:  # a valid id: echo it
            response.headers[REQUEST_ID_HEADER] = request.headers[REQUEST_ID_HEADER]
        return response
    max_payload = gw.nc.max_payload if gw.nc is not None else 1 << 20
    for one in jobs:
        if one.echo and one.logprobs >= 0 and (problem := echo_problem(len(one.prompt_ids), one.logprobs, max_payload)):
            return _error(ApiError(400, problem, "echo"))
    if len(jobs) > 1 and jobs[0].stream:
        return await _stream_several(gw, request, jobs, request.headers.get(REQUEST_ID_HEADER), body.get("n") or 1)
    if len(jobs) > 1:
        return await _serve_several(gw, request, jobs, request.headers.get(REQUEST_ID_HEADER), body.get("n") or 1)
    job = jobs[0]
    with structlog.contextvars.bound_contextvars(request_id=job.request_id), _traced(request, job):
        log.info("request_received", kind=kind, prompt_tokens=len(job.prompt_ids), max_tokens=job.max_tokens,
                 transfer_mode=job.transfer_mode, stream=job.stream, **job.noted)
        try:
            async with gw.admission.slot(_client(gw, request)) as slot:
                return await _run(gw, request, job, slot)
        except ApiError as exc:  # the admission queue is full, or the wait ran out
            log.info("request_not_admitted", status=exc.status, reason=exc.message)
            response = _error(exc)
            response.headers[REQUEST_ID_HEADER] = job.request_id
            return response


async def _run(gw: Gateway, request: web.Request, job: CompletionJob, slot: Slot) -> web.StreamResponse:
    """One admitted request, answered as a JSON body or a stream. A stream gives its admission slot back as soon as
    its generation ends: the slot covers generation, not a slow reader (the rest of its text is written meanwhile,
    under sse.py's write timeout)."""
    run = _new_run(gw, job, slot.waited_s)

    @contextlib.asynccontextmanager
    async def generating(_run: CompletionRun):
        try:
            yield
        finally:
            slot.release()

    try:
        if job.stream:
            try:
                streamed = await stream(gw, request, [run], 1, job.request_id, generating)
                if not streamed.prepared:  # an error answered before the stream began
                    streamed.headers[REQUEST_ID_HEADER] = job.request_id
                return streamed
            except ConnectionResetError:  # the client left mid-stream; `close()` below aborts the workers
                log.info("client_gone", tokens=len(run.token_ids))
                run.client_gone = True
                return web.Response(status=499)  # aiohttp ignores the write to the closed connection
        response = await _respond(gw, run)
        response.headers[REQUEST_ID_HEADER] = job.request_id
        return response
    except asyncio.CancelledError:  # the client disconnected (handler cancellation): `close()` aborts the workers
        log.info("client_gone", tokens=len(run.token_ids))
        run.client_gone = True
        raise
    finally:
        await run.close()
        gw.record(run)


def _new_run(gw: Gateway, job: CompletionJob, queue_s: float) -> CompletionRun:
    """An admitted job's run (after `queue_s` seconds in the admission queue)."""
    end_ids = sorted({*([] if job.ignore_eos else gw.stop_token_ids), *job.stop_token_ids})  # EOS unless ignored
    run = CompletionRun(gw.nc, gw.registry, job, end_ids, gw.config.request_timeout_s, gw.worker_id, gw.routes,
                        gw.prefill_routes)
    run.queue_s = queue_s
    return run


async def _respond(gw: Gateway, run: CompletionRun) -> web.Response:
    try:
        return web.json_response(await _complete(gw, run))
    except ApiError as exc:
        return _error(exc)


async def _complete(gw: Gateway, run: CompletionRun) -> dict[str, Any]:
    """Run the request to its end: the JSON body, or ApiError."""
    text = TextStream(gw.tokenizer, run.job.stop, run.job.include_stop_str_in_output)
    try:
        async for token in run.tokens():
            text.add(token)
            if text.is_stopped:
                run.stop_early("stop_string")
                break
    except RequestFailed as exc:
        raise ApiError(502, f"the request failed in a worker: {exc}", code="worker_failed") from None
    text.flush()
    await run.close()  # so the body reports the final finish_reason
    return _final_body(gw, run, text.emitted)


async def _serve_several(gw: Gateway, request: web.Request, jobs: list[CompletionJob], client_id: str | None,
                         n: int) -> web.Response:
    """A body that asks for several choices (several prompts, `n` answers each): each runs as a request of its own
    (admitted, queued and counted alone), all at once; the answer has the choices in order, each with its own
    `smartgen` figures (the top-level `smartgen` is the first's), and the usage: every prompt's tokens once, every
    choice's completion tokens. The first failure answers for all."""
    runs: list[CompletionRun] = []

    async def one(job: CompletionJob) -> dict[str, Any]:
        with structlog.contextvars.bound_contextvars(request_id=job.request_id), _traced(request, job):
            log.info("request_received", kind=job.kind, prompt_tokens=len(job.prompt_ids), max_tokens=job.max_tokens,
                     transfer_mode=job.transfer_mode, stream=False, batch=len(jobs), **job.noted)
            async with gw.admission.slot(_client(gw, request)) as slot:
                run = _new_run(gw, job, slot.waited_s)
                runs.append(run)
                try:
                    return await _complete(gw, run)
                finally:
                    await run.close()
                    gw.record(run)

    bodies = await asyncio.gather(*(one(job) for job in jobs), return_exceptions=True)
    for outcome in bodies:
        if isinstance(outcome, ApiError):
            return _error(outcome)
        if isinstance(outcome, BaseException):
            raise outcome
    choices = [{**body["choices"][0], "index": i, "smartgen": body["smartgen"]} for i, body in enumerate(bodies)]
    runs.sort(key=lambda run: jobs.index(run.job))  # (admitted in any order) choice p·n + j answers prompt p
    batch_id = client_id or jobs[0].request_id.rsplit("-", 1)[0]  # the jobs' ids are <batch_id>-<i>
    response = web.json_response({**bodies[0], "id": batch_id, "choices": choices, "usage": usage(runs, n)})
    response.headers[REQUEST_ID_HEADER] = batch_id
    return response


async def _stream_several(gw: Gateway, request: web.Request, jobs: list[CompletionJob], client_id: str | None,
                          n: int) -> web.StreamResponse:
    """Several choices streamed (sse.stream): each is a request of its own (admitted, queued and counted alone)."""
    runs = [_new_run(gw, job, 0.0) for job in jobs]
    batch_id = client_id or jobs[0].request_id.rsplit("-", 1)[0]  # the jobs' ids are <batch_id>-<i>

    @contextlib.asynccontextmanager
    async def admitted(run: CompletionRun):
        with structlog.contextvars.bound_contextvars(request_id=run.job.request_id), _traced(request, run.job):
            log.info("request_received", kind=run.job.kind, prompt_tokens=len(run.job.prompt_ids),
                     max_tokens=run.job.max_tokens, transfer_mode=run.job.transfer_mode, stream=True, batch=len(jobs),
                     **run.job.noted)
            try:
                async with gw.admission.slot(_client(gw, request)) as slot:
                    run.queue_s = slot.waited_s
                    yield
            finally:
                await run.close()
                gw.record(run)

    try:
        response = await stream(gw, request, runs, n, batch_id, admitted)
    except ConnectionResetError:
        return web.Response(status=499)
    if not response.prepared:
        response.headers[REQUEST_ID_HEADER] = batch_id
    return response


def _client(gw: Gateway, request: web.Request) -> str:
    """Who sent `request`, for the admission queue's turns (admission.py)."""
    return client_of(request.remote, request.headers.get("X-Forwarded-For"), gw.config.trust_forwarded_for)


def _traced(request: web.Request, job: CompletionJob) -> contextlib.AbstractContextManager:
    """The request's span, the root of its trace (shared/runtime/tracing.py; nothing when tracing is off)."""
    return tracing.request_span(f"{request.method} {request.path}", request.headers, request_id=job.request_id,
                                transfer_mode=job.transfer_mode, prompt_tokens=len(job.prompt_ids), stream=job.stream)


def _final_body(gw: Gateway, run: CompletionRun, text: str) -> dict[str, Any]:
    job = run.job
    finish_reason = "stop" if run.finish_reason == "stop" else "length"
    if job.kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if job.structure.tool_mode and (calls := tool_calls(job.structure, text)) is not None:
            message, finish_reason = {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
        choice = {"index": 0, "message": message, "finish_reason": finish_reason,
                  "logprobs": chat_logprobs(gw.tokenizer, run.token_ids, run.token_logprobs) if job.logprobs >= 0 else None}
        obj = "chat.completion"
    else:
        prompt = gw.tokenizer.decode(job.prompt_ids) if job.echo else ""
        logprobs = completion_logprobs(gw.tokenizer, run.token_ids, run.token_logprobs,
                                       job.prompt_ids if job.echo else None, run.prompt_logprobs) \
            if job.logprobs >= 0 else None
        choice = {"index": 0, "text": prompt + text, "finish_reason": finish_reason, "logprobs": logprobs}
        obj = "text_completion"
    return {"id": job.request_id, "object": obj, "created": job.created, "model": gw.model_id, "choices": [choice],
            "usage": usage([run]), "smartgen": summary(run)}
