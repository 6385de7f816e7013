"""One streaming completion as a client sees it, read to [DONE] and reduced to an Outcome (for `smartgen loadtest`).

Error kinds: `http <status> <type>/<code>` (from the OpenAI-style JSON body), `sse error <type>/<code>` (an error
event inside the stream), `timeout`, `connection error (<exception>)`, `stream ended without [DONE]`, and a
few malformed-stream kinds. A cancelled request is no outcome here: cancellation propagates to the caller
(leaving the `async with` closes the connection, which is how the gateway learns the client has gone).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import aiohttp

OK, ABORTED = "ok", "aborted at the deadline"  # the outcome kinds that are not errors


@dataclass(slots=True)
class Outcome:
    """One request as the client saw it. Latencies in seconds; ttft/ttst/tbt are the gateway's token stamps."""

    kind: str  # OK, ABORTED, or an error kind ("http 429 rate_limit_error/overloaded", "timeout", …)
    mode: str  # the transfer_mode asked for ("" = the gateway's default)
    e2e_s: float  # the client's wall time, request sent → [DONE]
    ttft_s: float | None = None
    ttst_s: float | None = None
    tbt_gaps_s: list[float] = field(default_factory=list)  # each gap between tokens after the second
    prompt_tokens: int = 0
    completion_tokens: int = 0
    retry_after_s: float | None = None  # a refusal's Retry-After header


async def stream_completion(session: aiohttp.ClientSession, url: str, body: dict, timeout_s: float) -> Outcome:
    """POST {url}/v1/completions with stream=true and read the events to [DONE]. Every failure is an Outcome."""
    mode, started = body.get("transfer_mode", ""), time.monotonic()

    def outcome(kind: str, **figures) -> Outcome:
        return Outcome(kind, mode, time.monotonic() - started, **figures)

    try:
        async with session.post(url + "/v1/completions", json={**body, "stream": True},
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            if response.status != 200:
                try:
                    error = (await response.json(content_type=None)).get("error")
                except (ValueError, AttributeError):
                    error = None
                return outcome(f"http {response.status} {_error_kind(error)}",
                               retry_after_s=_seconds(response.headers.get("Retry-After")))
            last = None  # the chunk with the `smartgen` object: the last before [DONE]
            async for data in _sse_data(response):
                if data == b"[DONE]":
                    return _finished(outcome, last)
                chunk = json.loads(data)
                if "error" in chunk:
                    return outcome(f"sse error {_error_kind(chunk['error'])}")
                last = chunk if "smartgen" in chunk else last
            return outcome("stream ended without [DONE]")
    except TimeoutError:  # aiohttp's timeouts subclass it (and ClientError): before ClientError
        return outcome("timeout")
    except aiohttp.ClientError as exc:
        return outcome(f"connection error ({type(exc).__name__})")
    except json.JSONDecodeError:
        return outcome("SSE data not JSON")


async def _sse_data(response: aiohttp.ClientResponse):
    """The `data:` payloads of an SSE body, one per event (an event ends with a blank line)."""
    buffer = b""
    async for piece in response.content.iter_any():
        buffer += piece
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if line.startswith(b"data: "):
                    yield line[6:]


def _finished(outcome, last: dict | None) -> Outcome:
    if last is None:
        return outcome("no smartgen object before [DONE]")
    sg, usage = last["smartgen"], last.get("usage", {})
    times = sg.get("token_times_s", [])
    gaps = [b - a for a, b in zip(times[1:], times[2:])]  # token 2 → 3, 3 → 4, …
    return outcome(OK, ttft_s=sg.get("ttft_s"), ttst_s=sg.get("ttst_s"), tbt_gaps_s=gaps,
                   prompt_tokens=usage.get("prompt_tokens", 0), completion_tokens=usage.get("completion_tokens", 0))


def _error_kind(error: object) -> str:
    """"type/code" of an OpenAI-style error object."""
    if not isinstance(error, dict):
        return "(no error object)"
    return "/".join(str(error[k]) for k in ("type", "code") if error.get(k)) or "(untyped)"


def _seconds(header: str | None) -> float | None:
    """A Retry-After header in seconds (the HTTP-date form counts as absent)."""
    try:
        return float(header) if header else None
    except ValueError:
        return None
