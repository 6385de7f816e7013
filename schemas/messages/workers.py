"""Who is there: every service's heartbeat, discovery, the broker's list of workers, and the RDMA data plane's
queue-pair exchange."""
from __future__ import annotations

from dataclasses import dataclass, field

from schemas.messages.plans import PlanRegistration


@dataclass(frozen=True, slots=True)
class PrefillRate:
    """A prefill worker's measured prompt rate at one prompt length (shared/runtime/prefill_rate.py)."""

    tokens: int  # the prompt length measured (a moving average within its length bucket)
    tokens_per_s: float


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
    send_rate_gbps: float = 0.0  # model workers: the rate their data plane achieved while sending; 0 = unknown
    link_gbps: float = 0.0  # model workers: the pacing their data plane is set to (emulated NIC); 0 = unpaced
    plans: list[PlanRegistration] = field(default_factory=list)  # decode: its live transfer plans (for the broker)
    # model workers: the requests they hold (decode: until the stream's last event is out). A gateway back from a
    # NATS reconnect uses it to tell a slow request from one whose reply or tokens were lost meanwhile.
    request_ids: list[str] = field(default_factory=list)
    max_requests: int = 0  # model workers: how many requests they take at once (max_active_requests)
    prefill_rates: list[PrefillRate] = field(default_factory=list)  # prefill: measured rate by prompt length
    draining: bool = False  # stopping (SIGTERM): finishing what it holds, taking nothing new (gateways pick others)
    prefix_cache_mb: int = 0  # prefill: its prefix cache's pool (0: off, so the gateway expects no hit there)


@dataclass(frozen=True, slots=True)
class Discover:
    """Gateway or broker → all services: answer with a heartbeat now (used at start-up)."""

    asker: str


@dataclass(frozen=True, slots=True)
class ListQuery:
    """Anyone → broker or kvprofile (`<role>.<id>.workers`, `kvprofile.<id>.list`): what do you hold?"""

    prefix: str = ""


@dataclass(frozen=True, slots=True)
class WorkerList:
    """Broker → requester: the workers it knows from heartbeats."""

    workers: list[WorkerInfo]


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
