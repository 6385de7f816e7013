"""The replies any call may get: done, or refused with a code."""
from __future__ import annotations

from dataclasses import dataclass

from schemas.constants import ErrorCode


@dataclass(frozen=True, slots=True)
class Ack:
    """Any → any: a request that needs no payload in its reply was done."""

    ok: bool = True


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """Any service → requester: the request was refused or failed. Sent with nats.micro error headers too."""

    code: ErrorCode
    message: str
