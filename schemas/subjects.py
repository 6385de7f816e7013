"""Every NATS subject, in one place. All live under `smartgen.` (or `smartgen.<namespace>.`: use_namespace).

Request plane (request/reply, addressed to one worker):
    smartgen.<role>.<worker_id>.<verb>        e.g. smartgen.decode.decode-3f2a.open
Event plane (pub/sub):
    smartgen.heartbeat.<role>                 WorkerInfo, every heartbeat_s
    smartgen.discover                         Discover: "send your heartbeat now"
    smartgen.stream.<request_id>              TokenEvent, decode → gateway
    smartgen.profile.stats                    SelectionStats, decode → kvprofile (online profiling)
    smartgen.profile.updated                  ProfileInfo, kvprofile → broker (drop cached profiles)
    smartgen.profile.progress.<build_id>      BuildProgress, kvprofile → whoever asked for the build
Data-plane set-up (RDMA only; TCP dials the advertised address directly):
    smartgen.dataplane.<worker_id>.connect    RdmaEndpoint ↔ RdmaEndpoint
"""
from __future__ import annotations

PREFIX = "smartgen"
DISCOVER = f"{PREFIX}.discover"
HEARTBEATS = f"{PREFIX}.heartbeat.*"
PROFILE_STATS = f"{PREFIX}.profile.stats"
PROFILE_UPDATED = f"{PREFIX}.profile.updated"


def use_namespace(namespace: str) -> None:
    """Put every subject of this process under `smartgen.<namespace>.` ("" = plain `smartgen.`), so several
    stacks can share one NATS without hearing each other (SMARTGEN_NAMESPACE; call before any subject is
    used: shared/runtime/natsconn.py does, for every service and tool)."""
    global PREFIX, DISCOVER, HEARTBEATS, PROFILE_STATS, PROFILE_UPDATED
    if namespace and not is_token(namespace):
        raise ValueError(f"namespace {namespace!r} must be letters, digits, '-' or '_' (one subject token)")
    PREFIX = f"smartgen.{namespace}" if namespace else "smartgen"
    DISCOVER = f"{PREFIX}.discover"
    HEARTBEATS = f"{PREFIX}.heartbeat.*"
    PROFILE_STATS = f"{PREFIX}.profile.stats"
    PROFILE_UPDATED = f"{PREFIX}.profile.updated"


def heartbeat(role: str) -> str:
    return f"{PREFIX}.heartbeat.{role}"


def worker(role: str, worker_id: str, verb: str) -> str:
    return f"{PREFIX}.{role}.{worker_id}.{verb}"


def dataplane_connect(worker_id: str) -> str:
    return f"{PREFIX}.dataplane.{worker_id}.connect"


def profile_progress(build_id: str) -> str:
    return f"{PREFIX}.profile.progress.{build_id}"


def stream(request_id: str) -> str:
    return f"{PREFIX}.stream.{request_id}"


def is_token(name: str) -> bool:
    """True if `name` can stand as one subject token (ids are built into subjects)."""
    return bool(name) and all(c.isalnum() or c in "-_" for c in name)
