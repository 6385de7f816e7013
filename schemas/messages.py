"""Every message that crosses NATS, as data only. Direction is in each docstring.

Sizes are tokens unless a field says bytes; times are seconds (monotonic clocks
never cross processes: only durations do, plus wall-clock `*_unix` stamps).
"""
from __future__ import annotations

from dataclasses import dataclass, field

# Transfer modes the system knows. Issue-by-issue, more of them become servable;
# `SERVABLE_TRANSFER_MODES` is what a request may ask for today.
TRANSFER_MODES = ("colocated", "full", "partial", "quantized", "smartgen", "auto")
SERVABLE_TRANSFER_MODES = ("colocated", "full")

# KV paths, as counted in `kv_bytes` and `smartgen_kv_transfer_bytes_total{path}`.
KV_PATHS = ("full", "proactive", "on_demand", "background")


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """Any service → everyone (heartbeat, every `heartbeat_s`): who I am and how loaded I am."""

    role: str
    worker_id: str
    pid: int
    host: str
    admin_url: str
    version: str
    dataplane_addr: str = ""  # "host:port" of the data-plane listener; "" for services without one
    model: str = ""
    active_requests: int = 0
    kv_pages_free: int = 0
    kv_pages_total: int = 0
    started_unix: float = 0.0


@dataclass(frozen=True, slots=True)
class Discover:
    """Gateway or broker → all services: answer with a heartbeat now (used at start-up)."""

    asker: str


@dataclass(frozen=True, slots=True)
class KvLayout:
    """Geometry of a KV store. Both ends of a transfer must agree on it exactly.

    A request's slab is (num_layers, 2, num_kv_heads, capacity, head_dim), K then V, tokens contiguous per
    head; it is allocated in pages of `page_tokens` tokens.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_tokens: int
    dtype: str  # torch dtype name, e.g. "float32"
    token_bytes: int  # bytes of one token's K and V over all layers


@dataclass(frozen=True, slots=True)
class KvHandle:
    """Decode → gateway → prefill: where a request's KV must land on the decode node.

    The decode worker's slab for the request starts at byte `offset` of its registered region and holds
    `capacity` tokens (prompt plus room for the completion); see shared/kvstore.py for its layout.
    """

    request_id: str
    decode_worker_id: str
    dataplane_addr: str
    ticket: int  # the decode side accepts pushes for this request only under this ticket
    layout: KvLayout
    num_tokens: int  # prompt tokens the prefill must deliver
    offset: int  # bytes
    capacity: int  # tokens


@dataclass(frozen=True, slots=True)
class OpenKv:
    """Gateway → decode (`decode.<id>.open`): reserve a slab for a request's KV. Reply: KvHandle."""

    request_id: str
    num_tokens: int  # prompt tokens
    max_tokens: int  # completion tokens to leave room for
    transfer_mode: str


@dataclass(frozen=True, slots=True)
class Sampling:
    """Sampling settings, shared by prefill (token 1) and decode (tokens 2…)."""

    temperature: float = 0.0  # 0 = greedy
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Prefill:
    """Gateway → prefill (`prefill.<id>.prefill`): run the prompt, push KV to `handle`. Reply: PrefillDone."""

    request_id: str
    token_ids: list[int]
    transfer_mode: str
    sampling: Sampling
    handle: KvHandle


@dataclass(frozen=True, slots=True)
class PrefillDone:
    """Prefill → gateway: the first token. KV pushes may still be in flight (they overlap decode start)."""

    request_id: str
    first_token: int
    prefill_worker_id: str
    num_prompt_tokens: int
    prefill_s: float  # compute time of the prefill forward pass


@dataclass(frozen=True, slots=True)
class Generate:
    """Gateway → decode (`decode.<id>.generate`): produce tokens and stream them. Reply: Accepted.

    In `full` mode `first_token` comes from the prefill and the KV arrives over the data plane;
    in `colocated` mode the decode worker runs the prefill itself (`first_token` = -1).
    """

    request_id: str
    transfer_mode: str
    token_ids: list[int]  # the prompt (used by colocated mode and for checks)
    first_token: int
    max_tokens: int  # total tokens of the completion, including the first
    stop_token_ids: list[int]
    sampling: Sampling
    stream_subject: str  # where TokenEvents go
    selector: str = ""  # "" = dense attention; else a KV selector name (see services/decode/selectors)
    kv_budget: float = 0.0  # with a selector: a fraction (0, 1] of the cached tokens, or a token count > 1


@dataclass(frozen=True, slots=True)
class Accepted:
    """Decode → gateway: the request is admitted and tokens will follow on its stream subject."""

    request_id: str
    decode_worker_id: str


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """Decode → gateway (on `stream_subject`): one token, or the end of the stream.

    `index` counts completion tokens from 0 (token 0 is the first token). The last event has
    `finish_reason` set ("length", "stop", "abort" or "error") and carries the request's transfer stats.
    """

    request_id: str
    index: int
    token_id: int  # -1 on a final event without a token
    finish_reason: str = ""
    error: str = ""
    kv_bytes: dict[str, int] = field(default_factory=dict)  # bytes received per KV path
    kv_wait_s: float = 0.0  # decode time spent waiting for KV to land before step 1
    selected_share: float = 1.0  # share of cached (token, KV head) entries attended to; 1 = dense


@dataclass(frozen=True, slots=True)
class Abort:
    """Gateway → decode or prefill (`<role>.<id>.abort`): stop work on a request and free its KV."""

    request_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class TransferFailed:
    """Prefill → decode (`decode.<id>.transfer_failed`): a push for this request failed; fail it now."""

    request_id: str
    error: str


@dataclass(frozen=True, slots=True)
class Ack:
    """Any → any: a request that needs no payload in its reply was done."""

    ok: bool = True


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """Any service → requester: the request was refused or failed. Sent with nats.micro error headers too."""

    code: str  # "bad_request", "not_found", "overloaded", "internal"
    message: str


@dataclass(frozen=True, slots=True)
class ListQuery:
    """Anyone → broker or kvprofile (`<role>.<id>.workers`, `kvprofile.<id>.list`): what do you hold?"""

    prefix: str = ""


@dataclass(frozen=True, slots=True)
class WorkerList:
    """Broker → requester: the workers it knows from heartbeats."""

    workers: list[WorkerInfo]


@dataclass(frozen=True, slots=True)
class ProfileList:
    """KV-profile → requester: the stored profile keys and the bucket that holds them."""

    bucket: str
    keys: list[str]


@dataclass(frozen=True, slots=True)
class RdmaEndpoint:
    """RDMA data plane ↔ its peer (`dataplane.<worker_id>.connect`): one side's queue pair and region,
    offered in the request and answered in the reply, to bring both RC queue pairs to RTS."""

    address: str  # the sender's data-plane address ("rdma:<worker_id>")
    qpn: int  # queue pair number
    psn: int  # initial packet sequence number (24 bits)
    gid: str  # RoCE v2 GID, fully written out
    addr: int  # virtual address of the registered region
    rkey: int  # remote key of the region
    length: int  # bytes in the region
