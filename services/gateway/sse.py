"""Streamed answers: server-sent events, one chunk per token, then `data: [DONE]`.

One choice streams as its tokens come (`choice_chunks`). Several (`n` > 1, or several prompts) run as requests of
their own, all at once, and their chunks interleave on one stream as they come, each with its choice's `index`
(OpenAI's shape); every chunk carries the batch's id. Each choice's last chunk has its finish_reason, usage and
`smartgen` figures; with stream_options.include_usage a last chunk with `choices: []` has the usage of all.
An error before the first chunk is an HTTP error; after it, an error object in the stream, then [DONE].
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import structlog
from aiohttp import web

from services.gateway.completion import CompletionRun
from services.gateway.errors import ApiError, error_response
from services.gateway.logprobs import chat_logprobs, completion_logprobs
from services.gateway.report import summary
from services.gateway.requests import CompletionJob
from services.gateway.structured import ToolCallStream
from services.gateway.textstream import TextStream
from shared.runtime.access_log import REQUEST_ID_HEADER

log = structlog.get_logger()
WRITE_TIMEOUT_S = 30.0  # a streaming client that takes no bytes for this long is dropped (_write)


def usage(runs: list[CompletionRun], n: int = 1) -> dict[str, Any]:
    """Every prompt's tokens once (choice p·n + j answers prompt p), every choice's completion tokens;
    `prompt_tokens_details.cached_tokens`: the prompt tokens the prefill took from its prefix cache."""
    n_prompt = sum(len(run.job.prompt_ids) for run in runs[::n])
    n_out = sum(len(run.token_ids) for run in runs)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
            "prompt_tokens_details": {"cached_tokens": sum(run.num_cached_tokens for run in runs[::n])}}


async def choice_chunks(gw, run: CompletionRun, index: int = 0) -> AsyncIterator[dict[str, Any]]:
    """One choice's chunks: one per token (even when its text is held back: a client times every token from the
    stream), then the last, with finish_reason, usage and smartgen. Raises ApiError or RequestFailed."""
    text = TextStream(gw.tokenizer, run.job.stop, run.job.include_stop_str_in_output)
    calls = ToolCallStream(run.job.structure) if run.job.structure.tool_mode else None  # tool_choice: delta.tool_calls
    sent_any = False  # the first chunk of a chat stream names the role
    offset = 0  # the text offset of the next token (completions logprobs)
    async for token in run.tokens():
        piece = text.add(token)
        chunk = _chunk(gw, run, calls.delta(piece) if calls else piece, None, index, first=not sent_any)
        if run.job.logprobs >= 0:
            offset = _add_logprobs(gw, run, chunk, offset)
        yield chunk
        sent_any = True
        if text.is_stopped:
            run.stop_early("stop_string")
            break
    tail: str | dict[str, Any] = text.flush()
    await run.close()  # so the last chunk reports the final finish_reason
    finish_reason = "stop" if run.finish_reason == "stop" else "length"
    if calls is not None:
        delta, is_calls = calls.finish(text.emitted, tail)
        if delta:
            yield _chunk(gw, run, delta, None, index, first=not sent_any)
            sent_any = True
        tail, finish_reason = {}, "tool_calls" if is_calls else finish_reason
    final = _chunk(gw, run, tail, finish_reason, index, first=not sent_any)
    final["usage"] = usage([run])
    final["smartgen"] = summary(run)
    yield final


async def stream(gw, request: web.Request, runs: list[CompletionRun], n: int, batch_id: str,
                 admitted: Callable[[CompletionRun], Any]) -> web.StreamResponse:
    """Stream `runs` (choice i is runs[i]; `n` answers per prompt) as one SSE response. `admitted(run)`: an async
    context manager that holds the run's admission slot while it runs (and records it at the end)."""
    queue: asyncio.Queue[tuple[int, dict[str, Any] | BaseException | None]] = asyncio.Queue()

    async def one(i: int, run: CompletionRun) -> None:
        try:
            async with admitted(run):
                async for chunk in choice_chunks(gw, run, i):
                    await queue.put((i, chunk))
            await queue.put((i, None))
        except Exception as exc:  # noqa: BLE001 (ApiError, RequestFailed, or a bug: the stream must not hang)
            await queue.put((i, exc))

    tasks = [asyncio.create_task(one(i, run), name=f"choice-{i}") for i, run in enumerate(runs)]
    response: web.StreamResponse | None = None
    try:
        num_done = 0
        while num_done < len(runs):
            _, item = await queue.get()
            if item is None:
                num_done += 1
                continue
            if isinstance(item, BaseException):
                return await _failed(request, response, item)
            if response is None:
                response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                       "Cache-Control": "no-cache", REQUEST_ID_HEADER: batch_id})
                await response.prepare(request)
            await _send(response, {**item, "id": batch_id})
        assert response is not None  # every choice sends at least its last chunk
        if runs[0].job.include_usage:  # stream_options.include_usage: OpenAI's usage-only last chunk
            await _send(response, {"id": batch_id, "object": _object(runs[0].job), "created": runs[0].job.created,
                                   "model": gw.model_id, "choices": [], "usage": usage(runs, n)})
        await _write(response, b"data: [DONE]\n\n")
        return response
    except (ConnectionResetError, asyncio.CancelledError):  # the client left: every run is aborted below
        log.info("client_gone", tokens=sum(len(run.token_ids) for run in runs))
        for run in runs:
            run.client_gone = True
        raise
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _failed(request: web.Request, response: web.StreamResponse | None, exc: BaseException) -> web.StreamResponse:
    """A choice failed: an HTTP error if nothing was sent yet, else an error object in the stream, then [DONE]."""
    error = exc if isinstance(exc, ApiError) else ApiError(502, f"the request failed in a worker: {exc}",
                                                           code="worker_failed")
    if response is None:
        return error_response(error)
    await _send(response, error.body())
    await _write(response, b"data: [DONE]\n\n")
    return response


async def _send(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await _write(response, b"data: " + json.dumps(payload).encode() + b"\n\n")


async def _write(response: web.StreamResponse, data: bytes) -> None:
    """Send stream bytes; a client that takes none for WRITE_TIMEOUT_S (its socket buffers full: it does not read)
    is dropped, as one that left: the stream ends, the workers are told, and its admission slot is free again.
    NOTE: the slot covers generation, not a slow reader."""
    try:
        async with asyncio.timeout(WRITE_TIMEOUT_S):  # NOTE: not wait_for, which can drop a cancellation (completion.py)
            await response.write(data)
    except asyncio.TimeoutError:
        raise ConnectionResetError(f"the client took no data for {WRITE_TIMEOUT_S:g} s") from None


def _object(job: CompletionJob) -> str:
    return "chat.completion.chunk" if job.kind == "chat" else "text_completion"


def _chunk(gw, run: CompletionRun, delta: str | dict[str, Any], finish_reason: str | None, index: int,
           first: bool = False) -> dict[str, Any]:
    """One stream chunk of choice `index`: `delta` is the new text, or (chat, tool calls) the delta object itself."""
    job: CompletionJob = run.job
    if job.kind == "chat":
        if isinstance(delta, dict):
            delta = dict(delta)
        else:
            delta = {"content": delta} if delta or finish_reason is None else {}
        choice = {"index": index, "delta": delta, "finish_reason": finish_reason}
        if first:
            choice["delta"]["role"] = "assistant"
        return {"id": job.request_id, "object": _object(job), "created": job.created, "model": gw.model_id,
                "choices": [choice]}
    return {"id": job.request_id, "object": _object(job), "created": job.created, "model": gw.model_id,
            "choices": [{"index": index, "text": delta, "finish_reason": finish_reason, "logprobs": None}]}


def _add_logprobs(gw, run: CompletionRun, chunk: dict[str, Any], offset: int) -> int:
    """Put the latest token's log-probabilities into its stream chunk; returns the next token's text offset."""
    token, scores = run.token_ids[-1:], run.token_logprobs[-1:]
    if run.job.kind == "chat":
        chunk["choices"][0]["logprobs"] = chat_logprobs(gw.tokenizer, token, scores)
        return offset
    logprobs = chunk["choices"][0]["logprobs"] = completion_logprobs(gw.tokenizer, token, scores, offset=offset)
    return offset + sum(len(t) for t in logprobs["tokens"])
