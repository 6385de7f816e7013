"""The transfer agent: a model worker's TCP data plane in a process of its own, off the model's GIL.

In one process, every chunk a link sends or receives is Python work on the event loop (a frame header, a
`recv_into`, a checksum, a scatter), and each of those waits for the torch thread to give up the GIL, and
holds it up in turn. With `dataplane_agent` on, the worker's KV arena lives in shared memory (a memfd both
processes map: `SharedArena`) and the TcpDataPlane runs in a child process over that same memory (`agent_main`).
The worker keeps an `AgentDataPlane`, a DataPlane whose calls are commands on a socketpair:

    worker (AgentDataPlane)  ── [id, op, args] ──▶  agent (TcpDataPlane over the same pages)
                             ◀── [id, error, result]   the reply when the op is done
                             ◀── [0, event, args]      "landed" (ticket, bytes), "link_lost", "stats"

So one push or read is one message each way, however many chunks it takes, and the bytes themselves never
cross the socketpair: they land in (or leave from) the shared pages. Grants live on both sides: the agent's
decides what a peer may touch; the worker's mirror counts landed bytes for its owner (on_landed).

Invariants: a call the worker cancels is cancelled in the agent too, and the worker waits for that before it
raises (its pages may be reused right after); if the worker dies the agent sees EOF and exits; if the agent
dies every pending and later call fails with DataPlaneError.
"""
from __future__ import annotations

import asyncio
import contextlib
import mmap
import socket
import sys
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import numpy as np
import structlog

from shared.runtime.arena import SharedArena
from shared.dataplane.base import (ChecksumMismatch, DataPlane, DataPlaneError, Gather, Grant, Lane, Segment,
                                   TicketRefused)

log = structlog.get_logger()
STATS_EVERY_S = 0.5  # how often the agent sends its counters (the worker's stats() and send_rate_gbps read them)
CANCEL_WAIT_S = 30.0  # a cancelled call: how long the worker waits for the agent to confirm it stopped
_ERRORS: dict[str, type[DataPlaneError]] = {"TicketRefused": TicketRefused, "ChecksumMismatch": ChecksumMismatch,
                                            "DataPlaneError": DataPlaneError}


# --- the worker's side ------------------------------------------------------------------------------------
class AgentDataPlane(DataPlane):
    """A DataPlane whose work runs in the transfer agent (see the module docstring). `tcp_args` are
    make_dataplane("tcp", ...)'s keyword arguments; `arena` is the shared memory the region lies in."""

    def __init__(self, arena: SharedArena, worker_id: str = "", log_level: str = "info", **tcp_args: Any):
        super().__init__(tcp_args.get("link_gbps", 0.0))
        self.arena, self.tcp_args = arena, tcp_args
        self.names = {"worker_id": worker_id, "log_level": log_level}  # for the agent's log lines
        self._proc: asyncio.subprocess.Process | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._next_id = 1
        self._stats: dict[str, Any] = {}
        self._error: DataPlaneError | None = None
        self._closing = False
        # Called once if the agent dies (not on close): every transfer of this worker fails from then on.
        self.on_agent_lost: Callable[[DataPlaneError], None] | None = None

    def register_region(self, region: memoryview) -> None:
        region = region.cast("B") if region.format != "B" else region
        base = np.frombuffer(self.arena.view, np.uint8).ctypes.data
        start = np.frombuffer(region, np.uint8).ctypes.data if len(region) else base
        if not (base <= start and start + len(region) <= base + len(self.arena.view)):
            raise ValueError("the transfer agent's region must lie in its shared arena")
        self.region_offset = start - base  # where the region starts in the arena (the agent maps the whole arena)
        super().register_region(region)

    async def start(self) -> str:
        ours, theirs = socket.socketpair()
        config = {**self.tcp_args, **self.names, "region_offset": self.region_offset, "region_len": len(self.region),
                  "arena_len": len(self.arena.view)}
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "shared.dataplane.agent", str(theirs.fileno()), str(self.arena.fd),
            pass_fds=(theirs.fileno(), self.arena.fd))
        theirs.close()
        reader, self._writer = await asyncio.open_unix_connection(sock=ours)
        self._send(0, "config", [config])  # NOTE: on the channel, not argv: it holds the cluster secret
        self._reader_task = asyncio.create_task(self._read_loop(reader))
        self.address = await self._call("address")
        return self.address

    async def close(self) -> None:
        if self._proc is None:
            return
        self._closing = True
        with contextlib.suppress(DataPlaneError):
            await asyncio.wait_for(self._call("close"), 10)
        if self._writer:
            self._writer.close()
        try:
            await asyncio.wait_for(self._proc.wait(), 10)
        except asyncio.TimeoutError:
            self._proc.kill()
            await self._proc.wait()
        if self._reader_task:
            self._reader_task.cancel()
            await asyncio.gather(self._reader_task, return_exceptions=True)
        self._proc = None

    # --- the contract -------------------------------------------------------------------------------------
    def grant(self, grant: Grant) -> None:
        super().grant(grant)
        self._send(0, "grant", [grant.ticket, [list(r) for r in grant.ranges]])

    def revoke(self, ticket: int) -> Grant | None:
        grant = super().revoke(ticket)
        if grant is not None:
            self._send(0, "revoke", [ticket])
        return grant

    async def retire(self, ticket: int, timeout_s: float) -> None:
        if super().revoke(ticket) is not None:
            await self._call("retire", ticket, timeout_s)

    async def push(self, peer: str, ticket: int, segments: Sequence[Segment], lane: Lane = Lane.ON_DEMAND) -> None:
        await self._call("push", peer, ticket, _flat(segments), int(lane))

    async def read(self, peer: str, ticket: int, segments: Sequence[Segment], lane: Lane = Lane.ON_DEMAND,
                   whole_frames: bool = False) -> None:
        await self._call("read", peer, ticket, _flat(segments), int(lane))

    async def read_gather(self, peer: str, ticket: int, gather: Gather, lane: Lane = Lane.ON_DEMAND,
                          whole_frames: bool = False) -> None:
        gather.check_within(len(self.region))
        await self._call("read_gather", peer, ticket, gather.src_base, gather.dst_base, gather.unit,
                         gather.src_index.astype(np.int64).tobytes(), gather.dst_index.astype(np.int64).tobytes(),
                         int(lane))

    def cut_links(self, reason: str = "cut by fault injection", peer: str | None = None) -> int:
        """The agent cuts them as this returns; the count is of the links it last reported (all of them)."""
        self._send(0, "cut_links", [reason, peer])
        return int(self._stats.get("links", 0))

    def set_link_gbps(self, gbps: float) -> None:
        self.link_gbps = gbps
        self._send(0, "set_link_gbps", [gbps])

    def apply_faults(self) -> None:
        self._send(0, "faults", [self.faults.summary()])

    def send_rate_gbps(self) -> float:
        return float(self._stats.get("send_rate_gbps", 0.0))

    def stats(self) -> dict[str, object]:
        return {**self._stats, "grants": len(self.grants), "agent_pid": self._proc.pid if self._proc else None}

    # --- the channel ----------------------------------------------------------------------------------------
    def _send(self, call_id: int, op: str, args: list[Any]) -> None:
        if self._error:
            raise self._error
        assert self._writer, "the transfer agent has not started"
        self._writer.write(msgpack.packb([call_id, op, args], use_bin_type=True))

    async def _call(self, op: str, *args: Any) -> Any:
        call_id, self._next_id = self._next_id, self._next_id + 1
        done = asyncio.get_running_loop().create_future()
        self._send(call_id, op, list(args))
        self._pending[call_id] = done
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:
            # NOTE: the agent may still be moving bytes from or into our pages: stop it there, and wait
            if not self._error:
                self._send(0, "cancel", [call_id])
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await asyncio.wait_for(done, CANCEL_WAIT_S)
            raise

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        unpacker = msgpack.Unpacker(raw=False)
        try:
            while data := await reader.read(1 << 16):
                unpacker.feed(data)
                for call_id, what, payload in unpacker:
                    if call_id:
                        self._on_reply(call_id, what, payload)
                    else:
                        self._on_event(what, payload)
            error = DataPlaneError("the transfer agent exited")
        except (OSError, ValueError) as exc:
            error = DataPlaneError(f"the transfer agent's channel failed: {exc}")
        self._error = error
        for done in self._pending.values():
            if not done.done():
                done.set_exception(error)
        self._pending.clear()
        if not self._closing:
            log.error("dataplane_agent_lost", error=str(error))
            if self.on_agent_lost:
                self.on_agent_lost(error)

    def _on_reply(self, call_id: int, error: list[str] | None, result: Any) -> None:
        done = self._pending.pop(call_id, None)
        if done is None or done.done():
            return
        if error:
            kind, message = error
            done.set_exception(_ERRORS.get(kind, DataPlaneError)(message or f"the transfer agent {kind} it"))
        else:
            done.set_result(result)

    def _on_event(self, event: str, args: list[Any]) -> None:
        try:
            self._handle_event(event, args)
        except Exception:  # the owner's callback failed: log it; the channel carries on
            log.exception("dataplane_agent_event_failed", agent_event=event)

    def _handle_event(self, event: str, args: list[Any]) -> None:
        if event == "landed":
            ticket, num_bytes = args
            grant = self.grants.get(ticket)
            if grant is not None:
                grant.bytes_landed += num_bytes
                if grant.on_landed:
                    grant.on_landed(num_bytes)
        elif event == "link_lost":
            peer, message = args
            if self.on_link_lost:
                self.on_link_lost(peer, DataPlaneError(message))
        elif event == "stats":
            self._stats = args[0]


def _flat(segments: Sequence[Segment]) -> list[int]:
    return [x for s in segments for x in (s.src, s.dst, s.length)]


def _segments(flat: list[int]) -> list[Segment]:
    return [Segment(flat[i], flat[i + 1], flat[i + 2]) for i in range(0, len(flat), 3)]


# --- the agent's side -------------------------------------------------------------------------------------
class _Agent:
    """Runs the commands of one worker against a TcpDataPlane over the worker's arena."""

    def __init__(self, plane: DataPlane, writer: asyncio.StreamWriter):
        self.plane, self.writer = plane, writer
        self.calls: dict[int, asyncio.Task[None]] = {}
        self.closing = asyncio.Event()
        plane.on_link_lost = lambda peer, error: self.emit(0, "link_lost", [peer, str(error)])

    def emit(self, call_id: int, what: Any, payload: Any) -> None:
        if not self.writer.is_closing():
            self.writer.write(msgpack.packb([call_id, what, payload], use_bin_type=True))

    async def serve(self, reader: asyncio.StreamReader, unpacker: msgpack.Unpacker) -> None:
        for call_id, op, args in unpacker:  # what came in with the config
            self._dispatch(call_id, op, args)
        stats = asyncio.create_task(self._send_stats())
        try:
            while not self.closing.is_set() and (data := await reader.read(1 << 16)):
                unpacker.feed(data)
                for call_id, op, args in unpacker:
                    self._dispatch(call_id, op, args)
        finally:
            stats.cancel()
            for task in self.calls.values():
                task.cancel()
            await asyncio.gather(*self.calls.values(), return_exceptions=True)
            await self.plane.close()

    def _dispatch(self, call_id: int, op: str, args: list[Any]) -> None:
        plane = self.plane
        if op == "cancel":
            task = self.calls.get(args[0])
            if task is not None:
                task.cancel()
        elif op == "grant":
            ticket, ranges = args
            plane.grant(Grant(ticket, [tuple(r) for r in ranges],
                              on_landed=lambda n, ticket=ticket: self.emit(0, "landed", [ticket, n])))
        elif op == "revoke":
            plane.revoke(args[0])
        elif op == "cut_links":
            plane.cut_links(args[0], args[1])
        elif op == "set_link_gbps":
            plane.set_link_gbps(args[0])
        elif op == "faults":
            for name, value in args[0].items():
                setattr(plane.faults, name, value)
        else:
            self.calls[call_id] = asyncio.create_task(self._run(call_id, op, args))

    async def _run(self, call_id: int, op: str, args: list[Any]) -> None:
        plane, result, error = self.plane, None, None
        try:
            if op == "address":
                result = plane.address
            elif op == "retire":
                await plane.retire(args[0], args[1])
            elif op in ("push", "read"):
                peer, ticket, flat, lane = args
                await getattr(plane, op)(peer, ticket, _segments(flat), Lane(lane))
            elif op == "read_gather":
                peer, ticket, src_base, dst_base, unit, src_index, dst_index, lane = args
                gather = Gather(src_base, dst_base, unit, np.frombuffer(src_index, np.int64),
                                np.frombuffer(dst_index, np.int64))
                await plane.read_gather(peer, ticket, gather, Lane(lane))
            elif op == "close":
                self.closing.set()
            else:
                error = ["DataPlaneError", f"the transfer agent has no command {op!r}"]
        except asyncio.CancelledError:
            error = ["cancelled", ""]
        except DataPlaneError as exc:
            error = [type(exc).__name__ if type(exc).__name__ in _ERRORS else "DataPlaneError", str(exc)]
        except Exception as exc:  # a bug: the worker's call fails loudly rather than hanging
            log.exception("dataplane_agent_command_failed", op=op)
            error = ["DataPlaneError", f"the transfer agent failed on {op}: {exc!r}"]
        finally:
            self.calls.pop(call_id, None)
        self.emit(call_id, error, result)

    async def _send_stats(self) -> None:
        while True:
            self.emit(0, "stats", [self.plane.stats()])
            await asyncio.sleep(STATS_EVERY_S)


async def _agent(channel_fd: int, arena_fd: int) -> None:
    from shared.dataplane import make_dataplane
    from shared.runtime.logging import setup_logging

    reader, writer = await asyncio.open_unix_connection(sock=socket.socket(fileno=channel_fd))
    unpacker = msgpack.Unpacker(raw=False)
    config: dict[str, Any] | None = None
    while config is None:  # the first message is the config
        data = await reader.read(1 << 16)
        if not data:
            return
        unpacker.feed(data)
        for _, _, (config,) in unpacker:
            break
    setup_logging("dataplane-agent", config.pop("worker_id"), config.pop("log_level"))
    arena = mmap.mmap(arena_fd, config.pop("arena_len"))
    offset, length = config.pop("region_offset"), config.pop("region_len")
    plane = make_dataplane("tcp", **{k: tuple(v) if k == "tls" and v else v for k, v in config.items()})
    plane.register_region(memoryview(arena)[offset: offset + length])
    await plane.start()
    await _Agent(plane, writer).serve(reader, unpacker)  # until the worker closes the channel, or exits


def agent_main(argv: list[str]) -> None:
    """`python -m shared.dataplane.agent CHANNEL_FD ARENA_FD` (started by AgentDataPlane.start; the config comes
    as the first message on the channel)."""
    asyncio.run(_agent(int(argv[0]), int(argv[1])))


if __name__ == "__main__":
    agent_main(sys.argv[1:])
