"""RDMA data plane with pyverbs: one-sided READ and WRITE between registered regions.
One queue pair toward a peer, with its lanes and the pump that posts them, is rdma_link.py.

Per process: one device context, one protection domain, one memory region over the whole KV region
(LOCAL_WRITE | REMOTE_READ | REMOTE_WRITE), one completion queue polled by an asyncio task.
Per peer: one RC queue pair, brought to RTS with the peer's QP number, PSN and GID (RoCE v2, GID index 0)
exchanged through `rendezvous` (the services route it over NATS; tests call the peer directly).

- push: RDMA WRITE WITH IMMEDIATE, one work request per remote-contiguous piece of a chunk, gathering the
  local pieces with several SGEs. The immediate carries the ticket's low 32 bits, so the receiver can count
  what landed under each grant (and log and count a ticket it does not know). Completes when the peer's NIC
  has acknowledged placement of every piece.
- read: RDMA READ, one work request per remote-contiguous run, scattering into the local pieces with several
  SGEs. The owner's CPU is not involved.
- lanes and pacing: chunks are posted ON_DEMAND first, then PUSH, BACKGROUND when allowed, with at most
  MAX_POSTED_BYTES and SEND_QUEUE_DEPTH work requests outstanding per link (a chunk of scattered runs is cut
  at MAX_CHUNK_WRS), through the same Pacer as TCP.

What RDMA does differently from TCP (see shared/dataplane/README.md): integrity relies on the link's ICRC (no crc32c per
chunk, which would cost CPU on both sides); a READ is authorised per link (the rkey is handed out only in the
rendezvous), not per request, because the owner's CPU never sees it; a push under an unknown ticket is
detected and counted by the receiver but its bytes have already been placed.

Imports pyverbs, the standard library and what the data plane's base needs (numpy, structlog, crc32c), all of which the
Soft-RoCE test guest has (tools/rdma_vm/build.sh).
"""
from __future__ import annotations

import asyncio
import ctypes
import itertools
import logging
import random
import socket
from collections.abc import Awaitable, Callable, Sequence

from shared.dataplane.base import (DataPlane, DataPlaneError, Lane, Segment, check_within,
                                   split_into_chunks)
from shared.dataplane.pacing import chunk_bytes
from shared.dataplane.rdma_link import CHUNK_BYTES, SEND_QUEUE_DEPTH, _Chunk, _Link, _Pending

log = logging.getLogger("smartgen.dataplane.rdma")

MAX_CHUNK_WRS = SEND_QUEUE_DEPTH // 4  # a chunk of scattered small segments is cut here, so it always fits the queue
RECV_QUEUE_DEPTH = 256  # receives posted for WRITE WITH IMMEDIATE notifications
MAX_SGE = 16
Rendezvous = Callable[[str, dict], Awaitable[dict]]  # (peer address, our offer) → the peer's answer


class RdmaUnavailable(DataPlaneError):
    """No usable RDMA device (or no pyverbs)."""


def rdma_devices() -> list[str]:
    """Names of the RDMA devices this process can open ([] when there are none or no pyverbs)."""
    try:
        from pyverbs.device import get_device_list

        return [d.name.decode() for d in get_device_list()]
    except Exception:  # ImportError, or PyverbsRDMAError "Failed to get devices list" without kernel support
        return []


class RdmaDataPlane(DataPlane):
    def __init__(self, address: str, rendezvous: Rendezvous, device: str = "", port: int = 1, gid_index: int = 0,
                 link_gbps: float = 0.0, op_timeout_s: float = 30.0):
        try:
            import pyverbs.enums  # noqa: F401
        except ImportError:
            raise RdmaUnavailable("pyverbs is not installed: apt install python3-pyverbs (tools/rdma_vm builds a guest with it), "
                                  "or use transport tcp") from None
        devices = rdma_devices()
        if not devices or (device and device not in devices):
            raise RdmaUnavailable(f"no RDMA device{' ' + device if device else ''} here (found {devices or 'none'}): "
                                  "use transport 'tcp' or 'auto', or create a Soft-RoCE device with "
                                  "`rdma link add rxe0 type rxe netdev <iface>`")
        super().__init__(link_gbps)
        self.address, self.rendezvous = address, rendezvous
        self.device, self.port, self.gid_index = device or devices[0], port, gid_index
        # NOTE: a backstop, not the detector: RC retries should fail a transfer to a vanished peer within about
        # a second, but Soft-RoCE was seen to retry forever toward a destroyed queue pair.
        self.op_timeout_s = op_timeout_s
        self.lane_stats = {lane: {"bytes": 0, "chunks": 0} for lane in Lane}
        self.num_refused = 0
        self.num_bytes_received = 0
        self.links: dict[str, _Link] = {}
        self._by_qp: dict[int, _Link] = {}
        self._pending: dict[int, tuple[_Pending, _Link, int]] = {}  # wr_id → (waiter, link, bytes)
        self._wr_ids = itertools.count(1)
        self._connecting: dict[str, asyncio.Lock] = {}
        self._poll_task: asyncio.Task[None] | None = None
        self._poll_wakeup = asyncio.Event()
        self._pumps: set[asyncio.Task[None]] = set()  # every link's pump, awaited at close

    # --- set-up ---------------------------------------------------------------------------------
    def register_region(self, region: memoryview) -> None:
        super().register_region(region)
        self._anchor = (ctypes.c_char * len(self.region)).from_buffer(self.region)  # keeps the address valid
        self.region_addr = ctypes.addressof(self._anchor)

    async def start(self) -> str:
        import pyverbs.enums as e
        from pyverbs.cq import CQ
        from pyverbs.device import Context
        from pyverbs.mr import MR
        from pyverbs.pd import PD

        self.ctx = Context(name=self.device)
        self.pd = PD(self.ctx)
        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
        self.mr = MR(self.pd, len(self.region), access, address=self.region_addr)
        self.recv_mr = MR(self.pd, 64, e.IBV_ACCESS_LOCAL_WRITE)  # receives must name a buffer; none is written
        self.cq = CQ(self.ctx, SEND_QUEUE_DEPTH * 4 + RECV_QUEUE_DEPTH * 4, None, None, 0)
        self.gid = self.ctx.query_gid(self.port, self.gid_index).gid
        self.max_rd_atomic = min(16, self.ctx.query_device().max_qp_rd_atom or 1)
        self._poll_task = asyncio.create_task(self._poll_loop())
        log.info("rdma data plane on %s port %d gid %s, region %d bytes", self.device, self.port, self.gid,
                 len(self.region))
        return self.address

    async def close(self) -> None:
        for link in list(self.links.values()):
            self.fail_link(link, DataPlaneError("data plane closed"))
        if self._poll_task:
            self._poll_task.cancel()
        for pump in self._pumps:
            pump.cancel()
        await asyncio.gather(*self._pumps, *([self._poll_task] if self._poll_task else []), return_exceptions=True)
        for obj in ("mr", "recv_mr", "cq", "pd", "ctx"):
            if hasattr(self, obj):
                getattr(self, obj).close()

    def _new_qp(self):
        import pyverbs.enums as e
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr

        cap = QPCap(max_send_wr=SEND_QUEUE_DEPTH, max_recv_wr=RECV_QUEUE_DEPTH, max_send_sge=MAX_SGE, max_recv_sge=1)
        init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap)
        attr = QPAttr(port_num=self.port)
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
        qp = QP(self.pd, init, attr)  # created straight into INIT
        for _ in range(RECV_QUEUE_DEPTH):  # receives for WRITE WITH IMMEDIATE (no data lands in them)
            qp.post_recv(self._recv_wr(), None)
        return qp

    def _recv_wr(self):
        from pyverbs.wr import SGE, RecvWR

        return RecvWR(wr_id=0, num_sge=1, sg=[SGE(self.recv_mr.buf, 64, self.recv_mr.lkey)])

    def _offer(self, qp, psn: int) -> dict:
        return {"address": self.address, "qpn": qp.qp_num, "psn": psn, "gid": self.gid,
                "addr": self.region_addr, "rkey": self.mr.rkey, "length": len(self.region)}

    def _to_rts(self, qp, psn: int, remote: dict) -> None:
        import pyverbs.enums as e
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        attr = QPAttr(port_num=self.port)
        attr.path_mtu = e.IBV_MTU_1024
        attr.max_dest_rd_atomic = self.max_rd_atomic
        attr.max_rd_atomic = self.max_rd_atomic
        attr.min_rnr_timer, attr.timeout, attr.retry_cnt, attr.rnr_retry = 12, 14, 7, 7
        attr.dest_qp_num, attr.rq_psn, attr.sq_psn = remote["qpn"], remote["psn"], psn
        gr = GlobalRoute(dgid=GID(remote["gid"]), sgid_index=self.gid_index)
        attr.ah_attr = AHAttr(port_num=self.port, is_global=1, gr=gr)
        qp.to_rts(attr)

    async def accept(self, offer: dict) -> dict:
        """Serving side of the rendezvous: build our queue pair toward the offering peer; answer with ours."""
        qp, psn = self._new_qp(), random.getrandbits(24)
        self._to_rts(qp, psn, offer)
        self._add_link(offer["address"], qp, offer)
        return self._offer(qp, psn)

    async def _link(self, peer: str) -> _Link:
        link = self.links.get(peer)
        if link is not None:
            return link
        async with self._connecting.setdefault(peer, asyncio.Lock()):
            if peer in self.links:
                return self.links[peer]
            qp, psn = self._new_qp(), random.getrandbits(24)
            try:
                # NOTE: asyncio.timeout, not wait_for (here and below), which on Python 3.11 drops a cancellation
                # that lands as the awaited thing ends: an aborted request went on, and a closed plane kept polling
                async with asyncio.timeout(10):
                    answer = await self.rendezvous(peer, self._offer(qp, psn))
                self._to_rts(qp, psn, answer)
            except Exception as exc:
                qp.close()
                raise DataPlaneError(f"cannot connect to the RDMA data plane at {peer}: {exc}") from None
            return self._add_link(peer, qp, answer)

    def _add_link(self, peer: str, qp, remote: dict) -> _Link:
        stale = self.links.get(peer)
        if stale is not None:  # the peer reconnected (its old queue pair failed): ours toward it is dead too
            self.fail_link(stale, DataPlaneError(f"{peer} reconnected"))
        link = _Link(self, peer, qp, remote)
        self._pumps.add(link.pump)
        link.pump.add_done_callback(self._pumps.discard)
        self.links[peer] = link
        self._by_qp[qp.qp_num] = link
        return link

    def fail_link(self, link: _Link, error: DataPlaneError) -> None:
        if link.error:
            return
        link.error = error
        link.pump.cancel()
        for wr_id, (pending, owner, _) in list(self._pending.items()):
            if owner is link:
                del self._pending[wr_id]
                if not pending.done.done():
                    pending.done.set_exception(error)
        for queue in link.queues.values():
            for chunk in queue:
                for f in chunk.done:
                    if not f.done():
                        f.set_exception(error)
            queue.clear()
        if self.links.get(link.peer) is link:
            del self.links[link.peer]
        self._by_qp.pop(link.qp.qp_num, None)
        link.qp.close()
        self.link_lost(link.peer, error)

    def cut_links(self, reason: str = "cut by fault injection", peer: str | None = None) -> int:
        """Fail every link (or those to `peer`) as a lost queue pair would: its transfers fail at once, its queue
        pair is closed, and the next transfer to that peer runs the rendezvous again."""
        links = [link for link in list(self.links.values()) if peer is None or link.peer == peer]
        for link in links:
            self.fail_link(link, DataPlaneError(f"RDMA link to {link.peer} {reason}"))
        return len(links)

    def stats(self) -> dict[str, object]:
        return {"transport": "rdma", "device": self.device, "links": len(self.links), "grants": len(self.grants),
                "refused": self.num_refused, "bytes_received": self.num_bytes_received, "link_gbps": self.link_gbps,
                "lanes": {lane.name.lower(): dict(v) for lane, v in self.lane_stats.items()}}

    # --- transfers -------------------------------------------------------------------------------
    async def push(self, peer: str, ticket: int, segments: Sequence[Segment], lane: Lane = Lane.ON_DEMAND) -> None:
        import pyverbs.enums as e

        check_within(segments, len(self.region), "src")
        link = await self._link(peer)
        self._check_remote(link, [(s.dst, s.length) for s in segments])
        imm = socket.htonl(ticket & 0xFFFFFFFF)
        await self._run_chunks(link, lane, segments, e.IBV_WR_RDMA_WRITE_WITH_IMM, imm)

    async def read(self, peer: str, ticket: int, segments: Sequence[Segment], lane: Lane = Lane.ON_DEMAND,
                   whole_frames: bool = False) -> None:
        import pyverbs.enums as e

        check_within(segments, len(self.region), "dst")
        link = await self._link(peer)
        self._check_remote(link, [(s.src, s.length) for s in segments])
        # NOTE: a READ is one-sided, so its lane is kept here, on the requesting side, where it is posted
        await self._run_chunks(link, lane, segments, e.IBV_WR_RDMA_READ, None)

    @staticmethod
    def _check_remote(link: _Link, ranges: list[tuple[int, int]]) -> None:
        for offset, n in ranges:
            if offset < 0 or offset + n > link.remote["length"]:
                raise DataPlaneError(f"range {offset}+{n} is outside {link.peer}'s registered region "
                                     f"of {link.remote['length']} bytes")

    async def _run_chunks(self, link: _Link, lane: Lane, segments: Sequence[Segment], opcode: int, imm: int | None):
        loop = asyncio.get_running_loop()
        waits: list[asyncio.Future[None]] = []
        for piece in split_into_chunks(segments, chunk_bytes(self.link_gbps, CHUNK_BYTES)):
            groups = work_requests(piece, "dst" if imm is not None else "src")
            for first in range(0, len(groups), MAX_CHUNK_WRS):  # scattered tokens: many small WRs per chunk
                chunk = _Chunk([], 0)
                for group in groups[first: first + MAX_CHUNK_WRS]:
                    done = loop.create_future()
                    wr_id = next(self._wr_ids)
                    nbytes = sum(s.length for s in group)
                    self._pending[wr_id] = (_Pending(done, "write" if imm is not None else "read"), link, nbytes)
                    chunk.wrs.append(self._build_wr(wr_id, link, group, opcode, imm))
                    chunk.num_bytes += nbytes
                    chunk.done.append(done)
                    chunk.wr_ids.append(wr_id)
                    waits.append(done)
                link.submit(lane, chunk)
        try:
            async with asyncio.timeout(self.op_timeout_s):
                results = await asyncio.gather(*waits, return_exceptions=True)
        except TimeoutError:
            error = DataPlaneError(f"RDMA transfer with {link.peer}: no completion within {self.op_timeout_s:g} s")
            self.fail_link(link, error)
            raise error from None
        for result in results:
            if isinstance(result, BaseException):
                raise result

    def _build_wr(self, wr_id: int, link: _Link, group: list[Segment], opcode: int, imm: int | None):
        import pyverbs.enums as e
        from pyverbs.wr import SGE, SendWR

        is_write = imm is not None
        # write: remote = dst (contiguous), local pieces = src; read: remote = src, local pieces = dst
        remote_offset = group[0].dst if is_write else group[0].src
        sges = [SGE(self.region_addr + (s.src if is_write else s.dst), s.length, self.mr.lkey) for s in group]
        wr = SendWR(wr_id=wr_id, opcode=opcode, num_sge=len(sges), sg=sges, send_flags=e.IBV_SEND_SIGNALED)
        wr.set_wr_rdma(link.remote["rkey"], link.remote["addr"] + remote_offset)
        if is_write:
            wr.imm_data = imm
        return wr

    def forget_pending(self, wr_id: int) -> None:
        self._pending.pop(wr_id, None)

    # --- completions -------------------------------------------------------------------------------
    def wake_poller(self) -> None:
        self._poll_wakeup.set()

    async def _poll_loop(self) -> None:
        """Poll the CQ without blocking the event loop: busy while work is outstanding, then back off."""
        idle = 0
        while True:
            n, wcs = self.cq.poll(64)
            for wc in wcs[:n] if n > 0 else ():
                self._on_completion(wc)
            if n > 0:
                idle = 0
                await asyncio.sleep(0)
                continue
            idle += 1
            if not self._pending and idle > 100:
                self._poll_wakeup.clear()
                try:  # nothing of ours in flight: wake for new work, or look for notifications every 2 ms
                    async with asyncio.timeout(0.002):
                        await self._poll_wakeup.wait()
                except TimeoutError:
                    pass
            else:
                await asyncio.sleep(0.0002 if idle > 20 else 0)

    def _on_completion(self, wc) -> None:
        import pyverbs.enums as e

        if wc.wr_id == 0:  # one of our posted receives: a WRITE WITH IMMEDIATE landed here
            link = self._by_qp.get(wc.qp_num)
            if link is not None and not link.error:
                link.qp.post_recv(self._recv_wr(), None)
            if wc.status == e.IBV_WC_SUCCESS:
                self._on_landed(socket.ntohl(wc.imm_data), wc.byte_len)
            return
        entry = self._pending.pop(wc.wr_id, None)
        if entry is None:
            return
        pending, link, nbytes = entry
        link.completed(nbytes)
        if wc.status == e.IBV_WC_SUCCESS:
            if not pending.done.done():
                pending.done.set_result(None)
            return
        error = DataPlaneError(f"RDMA {pending.what} to {link.peer} failed: {_wc_status(wc.status)}")
        if not pending.done.done():
            pending.done.set_exception(error)
        self.fail_link(link, error)  # an RC queue pair in error state is dead: reconnect on next use

    def _on_landed(self, imm: int, num_bytes: int) -> None:
        for grant in self.grants.values():
            if grant.ticket & 0xFFFFFFFF == imm:
                grant.bytes_landed += num_bytes
                self.num_bytes_received += num_bytes
                if grant.on_landed:
                    grant.on_landed(num_bytes)
                return
        self.num_refused += 1
        log.warning("rdma write under unknown ticket %#x (%d bytes) ignored", imm, num_bytes)


def work_requests(piece: Sequence[Segment], remote_side: str) -> list[list[Segment]]:
    """Group a chunk's segments into work requests: consecutive segments that are contiguous on the remote
    side ("dst" for a write, "src" for a read) share one WR with several SGEs, up to MAX_SGE."""
    remote = (lambda s: s.dst) if remote_side == "dst" else (lambda s: s.src)
    groups: list[list[Segment]] = []
    for seg in piece:
        last = groups[-1] if groups else None
        if last and len(last) < MAX_SGE and remote(last[-1]) + last[-1].length == remote(seg):
            last.append(seg)
        else:
            groups.append([seg])
    return groups


def _wc_status(status: int) -> str:
    names = {1: "local length error", 2: "local QP operation error", 4: "local protection error",
             5: "work request flushed", 9: "remote invalid request", 10: "remote access error",
             11: "remote operation error", 12: "transport retry counter exceeded", 13: "RNR retry counter exceeded"}
    return f"{names.get(status, 'error')} (status {status})"
