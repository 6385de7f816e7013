"""The one client of the gateway's OpenAI API and of the services' admin routes, for the tools and the tests.

Synchronous (urllib; bodies are JSON both ways):
    request(url, body=None, …) → Reply(status, body, headers), whatever the status
    post_json(url, body, …) → (status, body)          get_json(url) → body (an HTTP error's with `_status`)
    open_stream(url, body, …) → EventStream: a streamed completion's `data:` items as they arrive
    Gateway(url, admin_token): complete(body), workers(), pace(gbps), build_profile(…), post(url, body)
Asynchronous (aiohttp; `smartgen loadtest`):
    stream_completion(session, url, body, timeout_s) → Outcome: one streamed completion, read to [DONE]

Connection failures (refused, timed out) raise OSError from the synchronous functions; HTTP error statuses
do not (but open_stream's: urllib.error.HTTPError, whose JSON body is json.load(exc)).

Outcome kinds: OK, ABORTED (set by the caller that cancels), `http <status> <type>/<code>` (from the
OpenAI-style JSON body), `sse error <type>/<code>` (an error event inside the stream), `timeout`,
`connection error (<exception>)` (after the response began) or `connection error before a response
(<exception>)`, `stream ended without [DONE]`, and a few malformed-stream kinds. A
cancelled request is no outcome here: cancellation propagates to the caller (leaving the `async with` closes
the connection, which is how the gateway learns the client has gone).
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # NOTE: aiohttp loads in stream_completion only, so the CLI and sync callers start fast
    import aiohttp

JSON_HEADERS = {"Content-Type": "application/json"}
DONE = "[DONE]"  # the last item of a stream


# --- synchronous ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Reply:
    status: int  # the HTTP status
    body: Any  # the parsed JSON body (an error status's too)
    headers: dict[str, str]  # as sent (names in the server's case)

    @property
    def is_success(self) -> bool:
        """A 2xx status (urllib follows redirects; any other status is an HTTP error)."""
        return 200 <= self.status < 300


def request(url: str, body: object = None, *, method: str | None = None, timeout: float = 120.0,
            headers: dict[str, str] | None = None) -> Reply:
    """One HTTP request: `body` None sends none (a GET unless `method` says otherwise), bytes go as they are,
    anything else as JSON. Returns the reply whatever its status; OSError when no reply comes."""
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    sent = {**(JSON_HEADERS if data is not None else {}), **(headers or {})}
    req = urllib.request.Request(url, data, sent, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return Reply(r.status, json.load(r), dict(r.headers))
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace")
        try:
            answer = json.loads(text)
        except ValueError:  # not JSON (a proxy's page, a bare 500): the text, as an error
            answer = {"error": text}
        return Reply(exc.code, answer, dict(exc.headers))


def post_json(url: str, body: object, timeout: float = 120.0, headers: dict[str, str] | None = None,
              method: str = "POST") -> tuple[int, Any]:
    """(status, JSON body) of a request with a JSON `body` (or raw bytes); `headers` e.g.
    shared.runtime.admin_auth.admin_headers(token) for the admin routes that change state."""
    reply = request(url, body, method=method, timeout=timeout, headers=headers)
    return reply.status, reply.body


def get_json(url: str, timeout: float = 5.0, headers: dict[str, str] | None = None) -> dict:
    """GET a JSON body; an HTTP error's JSON body comes back with its status under `_status`."""
    reply = request(url, timeout=timeout, headers=headers)
    return reply.body if reply.is_success else {"_status": reply.status, **reply.body}


def list_workers(gateway_url: str, admin_token: str = "", timeout: float = 10.0) -> list[dict]:
    """The gateway's GET /workers (one dict per service: role, id, pid, admin_url, …). It shows pids and internal
    addresses, so it takes the admin token: `admin_token`, else SMARTGEN_ADMIN_TOKEN(_FILE)."""
    from shared.runtime.admin_auth import admin_headers, admin_token_from_env

    token = admin_token or admin_token_from_env()
    reply = get_json(gateway_url.rstrip("/") + "/workers", timeout, admin_headers(token))
    if "_status" in reply:
        raise RuntimeError(f"GET /workers answered {reply['_status']}: {reply.get('error')} (it needs the admin token: "
                           "SMARTGEN_ADMIN_TOKEN or SMARTGEN_ADMIN_TOKEN_FILE, as `smartgen up` prints)")
    return reply["workers"]


def wait_for_broker_pacing(gateway_url: str, gbps: float, admin_token: str = "", timeout_s: float = 10.0) -> None:
    """Until every broker has heard every prefill worker report pacing `gbps` (a worker announces itself as its
    POST /link is answered): from then on, plans use that link rate."""
    from shared.runtime.admin_auth import admin_headers, admin_token_from_env

    headers = admin_headers(admin_token or admin_token_from_env())
    brokers = [w for w in list_workers(gateway_url, admin_token) if w["role"] == "broker"]
    deadline = time.monotonic() + timeout_s
    for broker in brokers:
        while True:
            heard = get_json(broker["admin_url"] + "/stats", 5, headers).get("prefill_link_gbps", {})
            if heard and all(x == gbps for x in heard.values()):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"broker {broker['id']} did not hear pacing {gbps} Gbit/s in {timeout_s:g} s: {heard}")
            time.sleep(0.02)


class EventStream:
    """A streamed response that has begun: `status` and `headers` are known. Iterating yields each `data:` item
    as it arrives: a dict per JSON event, then DONE. Other non-blank lines are skipped and kept in `other_lines`."""

    def __init__(self, response: Any):
        self._response = response
        self.status: int = response.status
        self.headers = response.headers  # an http.client.HTTPMessage: case-insensitive names
        self.other_lines: list[str] = []

    def __iter__(self) -> Iterator[dict | str]:
        for raw in self._response:
            line = raw.decode().strip()
            if not line:
                continue
            if not line.startswith("data: "):
                self.other_lines.append(line)
                continue
            yield DONE if line == f"data: {DONE}" else json.loads(line[6:])


@contextmanager
def open_stream(url: str, body: dict, timeout: float = 120.0,
                headers: dict[str, str] | None = None) -> Iterator[EventStream]:
    """POST `body` with stream=true and yield the response as an EventStream (closed on exit). An error status
    raises urllib.error.HTTPError (its JSON body: json.load(exc)); no reply, OSError."""
    req = urllib.request.Request(url, json.dumps({**body, "stream": True}).encode(), {**JSON_HEADERS, **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as response:
        yield EventStream(response)


class Gateway:
    """The stack as a client sees it: the OpenAI API, plus the workers' admin routes (pacing, profiles)."""

    def __init__(self, url: str, admin_token: str = ""):
        from shared.runtime.admin_auth import admin_token_from_env

        self.url = url.rstrip("/")
        # the bearer token of the admin routes (POST /link, /profiles/build): the stack's, else SMARTGEN_ADMIN_TOKEN(_FILE)
        self.admin_token = admin_token or admin_token_from_env()

    def post(self, url: str, body: dict, timeout: float = 120.0) -> tuple[int, dict]:
        """(status, JSON body) of a POST to any of the stack's URLs, with the admin token."""
        from shared.runtime.admin_auth import admin_headers

        return post_json(url, body, timeout, admin_headers(self.admin_token))

    def complete(self, body: dict, timeout: float = 1800) -> dict:
        """POST /v1/completions, or /v1/chat/completions when `body` has `messages`: the reply's `smartgen`
        object plus its `text` and the client's end-to-end time `e2e_s`. RuntimeError unless 200."""
        started = time.monotonic()
        is_chat = "messages" in body
        status, reply = self.post(self.url + ("/v1/chat/completions" if is_chat else "/v1/completions"), body, timeout)
        if status != 200:
            raise RuntimeError(f"request failed ({status}): {reply.get('error', reply)}")
        choice = reply["choices"][0]
        text = choice["message"]["content"] if is_chat else choice["text"]
        return {**reply["smartgen"], "text": text, "e2e_s": time.monotonic() - started}

    def stream(self, body: dict, timeout: float = 1800, on_token: Callable[[int], None] | None = None) -> dict:
        """The completion streamed and timed on this client's clock: the final chunk's `smartgen` object with
        `token_times_s`, TTFT, TTST and TBT taken from when each token's chunk arrived here (seconds from sending;
        the gateway sends one chunk per token); the gateway's own stamps stay under `gateway_token_times_s`.
        Plus `text` and `e2e_s`. RuntimeError unless the stream completes. `on_token(i)`: as token i arrives."""
        from shared.runtime.timeline import Timeline

        is_chat = "messages" in body
        url = self.url + ("/v1/chat/completions" if is_chat else "/v1/completions")
        started = time.monotonic()
        arrivals: list[float] = []
        text, final = [], None
        try:
            with open_stream(url, body, timeout) as events:
                for event in events:
                    if event == DONE:
                        break
                    if "error" in event:
                        raise RuntimeError(f"request failed mid-stream: {event['error']}")
                    choice = event["choices"][0]
                    text.append((choice.get("delta") or {}).get("content") or "" if is_chat else choice.get("text", ""))
                    if choice.get("finish_reason") is None:
                        arrivals.append(time.monotonic() - started)
                        if on_token is not None:
                            on_token(len(arrivals) - 1)
                    if "smartgen" in event:
                        final = event["smartgen"]
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"request failed ({exc.code}): {json.load(exc).get('error')}") from None
        if final is None:
            raise RuntimeError("the stream ended without its final chunk")
        arrivals = arrivals[:len(final["token_ids"])]
        t = Timeline.of(arrivals)
        return {**final, "gateway_token_times_s": final["token_times_s"], "token_times_s": arrivals,
                "ttft_s": t.ttft_s, "ttst_s": t.ttst_s, "tbt_s": t.tbt_s, "text": "".join(text),
                "e2e_s": time.monotonic() - started}

    def kvprofile_url(self) -> str | None:
        """The admin URL of the stack's kvprofile service; None if it has none."""
        return next((w["admin_url"] for w in self.workers() if w["role"] == "kvprofile"), None)

    def learn_online(self, enabled: bool) -> bool:
        """Let kvprofile refresh profiles from served requests, or freeze them (benchmarks measure frozen).
        False when the stack has no kvprofile (nothing learns there); RuntimeError if the switch fails."""
        url = self.kvprofile_url()
        if url is None:
            return False
        status, reply = self.post(url + "/online", {"enabled": enabled}, 10)
        if status != 200:
            raise RuntimeError(f"switching online profile updates failed ({status}): {reply}")
        return True

    def build_profile(self, selector: str, prompt_tokens: int, num_prompts: int, kv_budget: float) -> dict:
        """Calibrate the selector's profile for this prompt length in the stack's kvprofile service; its reply."""
        url = self.kvprofile_url()
        if url is None:
            raise RuntimeError("no kvprofile service in this stack")
        status, reply = self.post(url + "/profiles/build",
                                  {"selector": selector, "prompt_tokens": prompt_tokens, "num_prompts": num_prompts,
                                   "kv_budget": kv_budget}, 3600)
        if status != 200:
            raise RuntimeError(f"profile build failed ({status}): {reply}")
        return reply

    def workers(self) -> list[dict]:
        """The gateway's GET /workers list: one dict per service (role, id, pid, admin_url, …)."""
        return list_workers(self.url, self.admin_token)

    def decode_floor(self) -> dict | None:
        """The budget floor of a live decode worker (its /stats), or None if none answers."""
        for w in self.workers():
            if w["role"] == "decode":
                return get_json(w["admin_url"] + "/stats", timeout=10).get("floor")
        return None

    def pace(self, gbps: float) -> None:
        """Pace every model worker's data plane (0 = unpaced); back once the broker has heard the new pacing."""
        for w in self.workers():
            if w["role"] in ("prefill", "decode"):
                status, reply = self.post(w["admin_url"] + "/link", {"gbps": gbps}, 10)
                if status != 200:
                    raise RuntimeError(f"pacing {w['id']} failed: {reply}")
        wait_for_broker_pacing(self.url, gbps, self.admin_token)


# --- asynchronous: one streamed completion as an Outcome ------------------------------------------------------
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
    token_ids: list[int] = field(default_factory=list)  # the completion's tokens (`smartgen.token_ids`)
    resumed: bool = False  # the gateway moved it to another decode worker mid-stream (failure_policy recompute)
    recomputed: bool = False  # its prompt was computed again (resumed, or its KV lost before decode: `recompute`)
    finished_at_s: float | None = None  # a load test's clock: when it ended, from the run's start


async def stream_completion(session: aiohttp.ClientSession, url: str, body: dict, timeout_s: float) -> Outcome:
    """POST {url}/v1/completions with stream=true and read the events to [DONE]. Every failure is an Outcome."""
    import aiohttp

    mode, started = body.get("transfer_mode", ""), time.monotonic()

    def outcome(kind: str, **figures) -> Outcome:
        return Outcome(kind, mode, time.monotonic() - started, **figures)

    responded = False  # the response's head arrived: a connection error after it is a request lost mid-answer
    try:
        async with session.post(url + "/v1/completions", json={**body, "stream": True},
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            responded = True
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
    except aiohttp.ClientError as exc:  # before a response: refused, or a pooled connection the server closed
        return outcome(f"connection error{'' if responded else ' before a response'} ({type(exc).__name__})")
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
                   prompt_tokens=usage.get("prompt_tokens", 0), completion_tokens=usage.get("completion_tokens", 0),
                   token_ids=list(sg.get("token_ids", [])), resumed=bool(sg.get("resumed_from")),
                   recomputed=bool(sg.get("recomputed")))


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
