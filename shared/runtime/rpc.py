"""Request/reply over NATS with schema messages, the handler wrapper every endpoint uses, and the backoff for
asking again what nobody answered yet.

While a request is traced (shared/runtime/tracing.py), `call` and `publish` carry its trace context in the
message's headers and `endpoint` and `subscriber` run the handler in a span that continues it.

An error reply is an `ErrorReply` body plus nats.micro's error headers, so `nats micro` tools
see it as an error too. `call` turns it back into a `RemoteError` on the calling side.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats.errors
import structlog
from nats.aio.client import Client
from nats.micro.request import Request

from schemas import ErrorCode, ErrorReply, SchemaError, decode, encode
from shared.runtime import tracing

T = TypeVar("T")
ERROR_HEADER = "Nats-Service-Error"
ERROR_CODE_HEADER = "Nats-Service-Error-Code"
MAX_ERROR_CHARS = 2000  # an error reply's message is cut to this many characters (the header to 200)
MAX_ERROR_HEADER_CHARS = 200
log = structlog.get_logger()


class RemoteError(RuntimeError):
    """The other side answered with an error (or did not answer)."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


class RequestRefused(Exception):
    """Raised inside a handler to refuse a request with a code the caller can act on."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


async def call(nc: Client, subject: str, message: Any, reply_type: type[T], timeout: float) -> T:
    try:
        msg = await nc.request(subject, encode(message), timeout=timeout, headers=tracing.headers())
    except nats.errors.NoRespondersError:
        raise RemoteError(ErrorCode.UNAVAILABLE, f"no worker answers on {subject}") from None
    except nats.errors.TimeoutError:
        raise RemoteError(ErrorCode.TIMEOUT, f"no reply on {subject} within {timeout:g} s") from None
    if msg.headers and ERROR_HEADER in msg.headers:
        err = decode(ErrorReply, msg.data) if msg.data else ErrorReply(ErrorCode.INTERNAL, msg.headers[ERROR_HEADER])
        raise RemoteError(err.code, err.message)
    return decode(reply_type, msg.data)


async def publish(nc: Client, subject: str, message: Any) -> None:
    """Publish a schema message (with the trace context, when a traced request is being handled)."""
    await nc.publish(subject, encode(message), headers=tracing.headers())


async def respond_error(req: Request, code: ErrorCode, message: str) -> None:
    # NOTE: messages can echo what a caller sent; a header value must stay one short line of text
    message = message[:MAX_ERROR_CHARS]
    header = "".join(c if c.isprintable() else " " for c in message[:MAX_ERROR_HEADER_CHARS])
    await req.respond(encode(ErrorReply(code, message)), headers={ERROR_HEADER: header, ERROR_CODE_HEADER: code})


def endpoint(message_type: type[T], handler: Callable[[T], Awaitable[Any]], concurrent: bool = False,
             after_reply: Callable[[T], Awaitable[None]] | None = None) -> Callable[[Request], Awaitable[None]]:
    """Wrap `handler(message) -> reply message` as a nats.micro handler that never crashes on bad input.

    nats runs an endpoint's handlers one after another, in one task. `concurrent`: each message gets a task of
    its own instead, so a long handler (a prefill waiting its turn for the model) does not keep the next
    message unread, unseen by the service (and by its heartbeats, which say what it holds). `after_reply(message)`:
    work the handler left for after its reply (or error) is on its way to the caller, in the same task."""

    tasks: set[asyncio.Task] = set()

    async def spawn(req: Request) -> None:
        task = asyncio.create_task(handle(req))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def handle(req: Request) -> None:
        try:
            message = decode(message_type, req.data)
        except SchemaError as exc:
            await respond_error(req, ErrorCode.BAD_REQUEST, str(exc))
            return
        request_id = getattr(message, "request_id", None)
        with structlog.contextvars.bound_contextvars(request_id=request_id):
            try:
                await reply_to(req, message, request_id)
            finally:
                if after_reply is not None:
                    try:
                        await after_reply(message)
                    except Exception:  # noqa: BLE001 (the reply has gone: nobody else would hear of it)
                        log.exception("after_reply_failed", subject=req.subject)

    async def reply_to(req: Request, message: T, request_id: str | None) -> None:
        """The handler's reply to `req`, or the error it raised."""
        try:
            with tracing.handling(req, request_id):
                reply = await handler(message)
        except RequestRefused as exc:
            log.info("request_refused", code=exc.code, reason=exc.message)
            await respond_error(req, exc.code, exc.message)
            return
        except Exception as exc:  # the service keeps running; the caller learns at once
            log.exception("handler_failed", subject=req.subject)
            await respond_error(req, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")
            return
        data = encode(reply)
        try:
            await req.respond(data)
        except Exception as exc:  # e.g. nats' MaxPayloadError: the caller learns why now, not at its timeout
            log.warning("reply_not_sent", subject=req.subject, bytes=len(data), error=repr(exc))
            await respond_error(req, ErrorCode.INTERNAL, f"the reply ({len(data)} bytes) could not be sent: "
                                                         f"{type(exc).__name__}: {exc}")

    return spawn if concurrent else handle


def subscriber(message_type: type[T], handler: Callable[[T], Awaitable[None]]) -> Callable[[Any], Awaitable[None]]:
    """Wrap `handler(message)` as the callback of a plain pub/sub subscription (`nc.subscribe(..., cb=)`): the
    payload is decoded as `message_type`, and one that does not decode is logged and dropped (nothing replies
    on pub/sub). The counterpart of `endpoint` for request/reply."""

    async def on_msg(msg: Any) -> None:
        try:
            message = decode(message_type, msg.data)
        except SchemaError as exc:
            log.warning("bad_message", subject=msg.subject, type=message_type.__name__, error=str(exc))
            return
        with tracing.handling(msg, getattr(message, "request_id", None)):
            await handler(message)

    return on_msg


class Backoff:
    """The pauses between tries of something that is not ready yet (a NATS peer between servers, a JetStream
    cluster still electing its leader): from `first_s`, doubling up to `cap_s`, for as long as the next pause
    ends within `timeout_s` of when this was made."""

    def __init__(self, timeout_s: float, first_s: float = 0.2, cap_s: float = 2.0):
        self.deadline, self.delay, self.cap_s = time.monotonic() + timeout_s, first_s, cap_s

    @property
    def left(self) -> bool:
        """Whether another try fits before the deadline."""
        return time.monotonic() + self.delay <= self.deadline

    async def wait(self) -> None:
        """The pause before the next try."""
        await asyncio.sleep(self.delay)
        self.delay = min(self.cap_s, 2 * self.delay)
