"""TCP data plane (the reference implementation): direct sockets between prefill and decode.

One socket per pair of processes, used in both directions (through TLS where the TLS settings are given:
channel.py); it becomes a link only once both ends have shown they hold the cluster secret (handshake.py). This
module owns the plane: listening, dialling, the handshake, the links by peer, the counters, and cutting each
transfer into the frames its link moves (tcp_link.py: the frames' writer and reader tasks, lanes and pacing).
"""
from __future__ import annotations

import asyncio
import math
import socket
import ssl
import time
from collections.abc import Callable, Sequence

import structlog

from shared.dataplane import frames, handshake
from shared.dataplane.base import DataPlane, DataPlaneError, Gather, Grant, Lane, Segment, check_within, split_into_chunks
from shared.dataplane.channel import Channel, DataPlaneTls, open_channel
from shared.dataplane.frames import CHUNK_BYTES, FrameError, Header
from shared.dataplane.pacing import Pacer, chunk_bytes
from shared.dataplane.tcp_link import CONTROL, LaneStats, Link

# a READ asks the server to answer on the reader's lane
log = structlog.get_logger()
HANDSHAKE_TIMEOUT_S = 10.0  # connect (dialer); the whole handshake, TLS included, from accept (listener)
# accepted connections still in their handshake: beyond this many, a new one is closed at once (counted in
# peers_refused), so a flood of connections that never say hello costs at most this many sockets and tasks
MAX_PENDING_HANDSHAKES = 32
RATE_WINDOW_BYTES = 16 << 20  # the send rate is a moving average over about this many recent bytes
# A dialer that names itself "<its address>READS_ONLY" opens a link it only reads on (a DirectReader: the decode's
# torch thread, direct_reader.py): the listener answers its requests but never sends its own transfers on it
READS_ONLY = "#reads"


def peer_of(name: str) -> str:
    """The peer's data-plane address, whichever of its links `name` names."""
    return name.removesuffix(READS_ONLY)


async def _recv_handshake(channel: Channel, op: int) -> bytes:
    """The payload of the next frame, which must be the handshake frame `op` (FrameError otherwise); a refusal
    (a WELCOME with status REFUSED) raises PeerRefused."""
    raw = bytearray(frames.HEADER.size)
    await channel.recv_exactly(memoryview(raw))
    header = Header.unpack(raw)
    if header.op != op or header.num_segments:
        raise FrameError(f"expected handshake frame {op}, got op {header.op}")
    if header.status == frames.STATUS_REFUSED:
        raise handshake.PeerRefused("the listener refused our proof: is this process's cluster secret the cluster's?")
    payload = bytearray(header.payload_len)
    await channel.recv_exactly(memoryview(payload))
    return bytes(payload)


async def _challenge(channel: Channel, nonce: bytes) -> bytes:
    """The listener's challenge out, the dialer's hello back (its payload)."""
    await channel.sendall(Header(frames.OP_CHALLENGE, payload_len=len(nonce)).pack() + nonce)
    return await _recv_handshake(channel, frames.OP_HELLO)


def _peer_name(sock: socket.socket) -> str:
    try:
        return "%s:%s" % sock.getpeername()[:2]
    except OSError:
        return "?"


class TcpDataPlane(DataPlane):
    def __init__(self, host: str = "127.0.0.1", port: int = 0, advertise_host: str = "", link_gbps: float = 0.0,
                 checksums: bool = True, cluster_secret: str = "", tls: DataPlaneTls | None = None,
                 handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S, max_pending_handshakes: int = MAX_PENDING_HANDSHAKES):
        super().__init__(link_gbps)
        self.handshake_timeout_s, self.max_pending_handshakes = handshake_timeout_s, max_pending_handshakes
        self.tls = tls  # every link through mutual TLS (channel.py); None = plain TCP
        self.cluster_key = cluster_secret.encode()  # proves membership at every link's start ("" = an open plane)
        self.num_peers_refused = 0  # connections that failed the handshake, either way
        self.host, self.port, self.advertise_host = host, port, advertise_host or host
        self.use_checksums = checksums
        self.scratch = memoryview(bytearray(CHUNK_BYTES))  # where refused payloads are drained to
        self.lane_stats = {CONTROL: LaneStats(), **{lane: LaneStats() for lane in Lane}}
        self.num_bytes_sent = 0
        self.num_bytes_received = 0
        self.num_refused = 0
        self.num_checksum_failures = 0  # chunks whose crc32c did not match, either side
        self._recent_bytes = 0.0  # decayed sums behind send_rate_gbps
        self._recent_busy_s = 0.0
        self._busy_until = 0.0  # time.monotonic() when the last data frame counted in them left
        self.links: dict[str, Link] = {}  # the link each peer's new transfers take
        # one per peer, shared by all links to it (a reads-only link too): the emulated NIC is the peer's, not a link's
        self.pacers: dict[str, Pacer] = {}
        self.open_links: set[Link] = set()  # those, and older links to the same peer still finishing their work
        self._unnamed: set[asyncio.Task[None]] = set()  # accepted sockets that have not said hello yet
        self._connecting: dict[str, asyncio.Lock] = {}
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None

    async def start(self) -> str:
        listener = socket.create_server((self.host, self.port))
        listener.setblocking(False)
        self._listener = listener
        self.address = f"{self.advertise_host}:{listener.getsockname()[1]}"
        self._accept_task = asyncio.create_task(self._accept_loop())
        return self.address

    async def close(self) -> None:
        if self._accept_task:
            self._accept_task.cancel()
            await asyncio.gather(self._accept_task, return_exceptions=True)
        if self._listener:
            self._listener.close()
        for task in list(self._unnamed):
            task.cancel()
        await asyncio.gather(*self._unnamed, return_exceptions=True)
        for link in list(self.open_links):
            await link.close()

    # --- numbers ---------------------------------------------------------------------------------
    def set_link_gbps(self, gbps: float) -> None:
        if gbps < 0:
            raise ValueError("link_gbps must be ≥ 0 (0 = unpaced)")
        self.link_gbps = gbps
        for pacer in self.pacers.values():
            pacer.set_gbps(gbps)
        self._recent_bytes = self._recent_busy_s = 0.0  # a different link: what was measured no longer holds

    def note_frame(self, lane: int, num_bytes: int, busy_s: float) -> None:
        """One frame of `lane` left in `busy_s` (pacing included), just now: count it; a data frame (not an ack)
        also goes into the moving average of the send rate, with only the part of its busy time no frame counted
        before covered: the links to one peer wait on one pacer (a decode worker's reads-only link beside its main
        one), so their frames' busy times overlap, and adding both counted the same wall time twice (the rate
        read 20% under the pacing while a decode worker read direct, docs/results/speculation-2026-12-07)."""
        stats = self.lane_stats[lane]
        stats.num_bytes += num_bytes
        stats.num_frames += 1
        stats.busy_s += busy_s
        if lane != CONTROL:
            now = time.monotonic()
            busy_s = max(0.0, min(busy_s, now - self._busy_until))
            self._busy_until = max(self._busy_until, now)
            keep = math.exp(-num_bytes / RATE_WINDOW_BYTES)
            self._recent_bytes = keep * self._recent_bytes + num_bytes
            self._recent_busy_s = keep * self._recent_busy_s + busy_s

    def send_rate_gbps(self) -> float:
        # NOTE: the writer's busy time includes the pacer and the socket's send time; on a real NIC with large
        # kernel buffers this is optimistic for short bursts. Good enough to size a proactive push.
        return self._recent_bytes * 8 / self._recent_busy_s / 1e9 if self._recent_busy_s > 0 else 0.0

    def stats(self) -> dict[str, object]:
        lanes = {name: vars(self.lane_stats[lane]).copy()
                 for name, lane in (("control", CONTROL), *((lane.name.lower(), lane) for lane in Lane))}
        return {"transport": "tcp", "bytes_sent": self.num_bytes_sent, "bytes_received": self.num_bytes_received,
                "refused": self.num_refused, "peers_refused": self.num_peers_refused,
                "checksum_failures": self.num_checksum_failures,
                "authenticated": bool(self.cluster_key), "tls": self.tls is not None, "links": len(self.links), "grants": len(self.grants),
                "link_gbps": self.link_gbps, "checksums": self.use_checksums,
                "background_paused": self.is_background_paused, "send_rate_gbps": round(self.send_rate_gbps(), 4),
                "lanes": lanes}

    # --- caller side ------------------------------------------------------------------------------
    async def push(self, peer: str, ticket: int, segments: Sequence[Segment], lane: Lane = Lane.ON_DEMAND) -> None:
        check_within(segments, len(self.region), "src")
        link = await self._link(peer)
        waits = [link.request(lane, Header(frames.OP_PUSH, ticket=ticket), [(s.dst, s.length) for s in chunk],
                              [self.region[s.src: s.src + s.length] for s in chunk], [])
                 for chunk in split_into_chunks(segments, chunk_bytes(self.link_gbps, CHUNK_BYTES))]
        await _all_or_first_error(waits)
        self.num_bytes_sent += sum(s.length for s in segments)

    async def read(self, peer: str, ticket: int, segments: Sequence[Segment], lane: Lane = Lane.ON_DEMAND,
                   whole_frames: bool = False) -> None:
        check_within(segments, len(self.region), "dst")
        link = await self._link(peer)
        flags = frames.LANE_FLAGS[lane]
        waits = [link.request(lane, Header(frames.OP_READ, ticket=ticket, flags=flags), [(s.src, s.length) for s in chunk],
                              [], chunk)
                 for chunk in split_into_chunks(segments, self._read_frame_bytes(whole_frames))]
        await _all_or_first_error(waits)
        self.num_bytes_received += sum(s.length for s in segments)

    async def read_gather(self, peer: str, ticket: int, gather: Gather, lane: Lane = Lane.ON_DEMAND,
                          whole_frames: bool = False) -> None:
        gather.check_within(len(self.region))
        n = gather.src_index.size
        if not n:
            return
        if gather.unit > CHUNK_BYTES or int(gather.src_index.max()) >> 32:  # does not fit the descriptor
            await super().read_gather(peer, ticket, gather, lane)
            return
        link = await self._link(peer)
        per_frame = max(1, self._read_frame_bytes(whole_frames) // gather.unit)
        header = Header(frames.OP_GATHER, ticket=ticket, flags=frames.LANE_FLAGS[lane])
        waits = [link.request(lane, header, [], [memoryview(frames.pack_gather(gather.src_base, gather.unit,
                                                                               gather.src_index[at: at + per_frame]))],
                              [], (gather.dst_base, gather.unit, gather.dst_index[at: at + per_frame]))
                 for at in range(0, n, per_frame)]
        await _all_or_first_error(waits)
        self.num_bytes_received += gather.num_bytes

    def _read_frame_bytes(self, whole_frames: bool) -> int:
        """How many bytes a read's reply frames carry: the paced link's ~1 ms chunks (pacing.chunk_bytes), so that
        an urgent frame queued behind one waits about as long as on a real NIC; or, where the caller knows none
        will (a decode worker's background reads while its on-demand reads travel on links of their own:
        services/decode/direct_reads.py), whole chunks, since every frame costs the receiving process about as
        much CPU as a whole chunk (~60 paced frames a step took ~39 ms of a decode worker's CPU at 2K:
        docs/results/direct-reads-2026-12-06)."""
        return CHUNK_BYTES if whole_frames else chunk_bytes(self.link_gbps, CHUNK_BYTES)

    async def _link(self, peer: str) -> Link:
        link = self.links.get(peer)
        if link is not None:
            return link
        async with self._connecting.setdefault(peer, asyncio.Lock()):
            link = self.links.get(peer)
            if link is not None:
                return link
            return self._add_link(await self._dial(peer, self.address), peer)

    async def dial_reads_only(self, peer: str) -> socket.socket:
        """A new connection to `peer`, through the handshake, for a DirectReader (direct_reader.py): the peer knows
        it as reads-only. Plain TCP only (DataPlaneError under TLS: the reader speaks to the socket itself)."""
        if self.tls is not None:
            raise DataPlaneError("direct reads need a plain TCP data plane; this one runs TLS")
        return (await self._dial(peer, self.address + READS_ONLY)).sock

    async def _dial(self, peer: str, own_name: str) -> Channel:
        """Connect to `peer` and prove ourselves as `own_name` (our address, or it marked READS_ONLY)."""
        host, port = peer.rsplit(":", 1)
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            # NOTE: asyncio.timeout, not wait_for, which on Python 3.11 drops a cancellation of the caller (a
            # request's task, aborted) that lands as a step ends: the aborted request went on
            async with asyncio.timeout(self.handshake_timeout_s):
                await loop.sock_connect(sock, (host, int(port)))
            async with asyncio.timeout(self.handshake_timeout_s):
                channel = await open_channel(sock, self.tls, server_side=False)
            async with asyncio.timeout(self.handshake_timeout_s):
                await self._prove_to_listener(channel, own_name)
        except (handshake.PeerRefused, ssl.SSLError) as exc:
            sock.close()
            self.num_peers_refused += 1
            raise DataPlaneError(f"the data plane at {peer} refused us, or failed to prove itself: {exc}") from None
        except (OSError, asyncio.TimeoutError, FrameError) as exc:
            sock.close()
            raise DataPlaneError(f"cannot connect to the data plane at {peer}: {exc or 'timeout'}") from None
        except BaseException:
            sock.close()
            raise
        return channel

    async def _prove_to_listener(self, channel: Channel, own_name: str) -> None:
        """The dialer's half of the handshake (handshake.py): answer the challenge, check the welcome."""
        challenge = await _recv_handshake(channel, frames.OP_CHALLENGE)
        if len(challenge) != handshake.NONCE_BYTES:
            raise FrameError("a challenge is one nonce")
        nonce, address = handshake.new_nonce(), own_name.encode()
        hello = handshake.hello_payload(self.cluster_key, challenge, nonce, address)
        await channel.sendall(Header(frames.OP_HELLO, payload_len=len(hello)).pack() + hello)
        welcome = await _recv_handshake(channel, frames.OP_WELCOME)
        handshake.check_welcome(self.cluster_key, nonce, challenge, address, welcome)

    # --- serving side ------------------------------------------------------------------------------
    def grant_for(self, ticket: int, table: list[tuple[int, int]]) -> Grant | None:
        """The grant if `ticket` may touch every range in `table`, else None (and the refusal is logged)."""
        return self.granted(ticket, lambda grant: all(grant.covers(off, n) for off, n in table))

    def granted(self, ticket: int, covers: Callable[[Grant], bool]) -> Grant | None:
        """`ticket`'s grant if `covers` says it allows what a frame asks, else None (counted and logged)."""
        grant = None if self.faults.refuse_tickets else self.grants.get(ticket)
        if grant is not None and covers(grant):
            return grant
        self.num_refused += 1
        log.warning("dataplane_refused", ticket=ticket, known_ticket=grant is not None)
        return None

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            try:
                sock, _ = await loop.sock_accept(self._listener)
            except OSError as exc:  # EMFILE, ECONNABORTED…: keep accepting rather than go deaf for good
                log.warning("dataplane_accept_failed", error=str(exc))
                await asyncio.sleep(0.1)
                continue
            if len(self._unnamed) >= self.max_pending_handshakes:  # a flood of silent connections: shed this one
                self.num_peers_refused += 1
                log.warning("dataplane_peer_refused", error=f"{len(self._unnamed)} handshakes pending already",
                            peer=_peer_name(sock))
                sock.close()
                continue
            task = asyncio.create_task(self._greet(sock))
            self._unnamed.add(task)
            task.add_done_callback(self._unnamed.discard)

    async def _greet(self, sock: socket.socket) -> None:
        """The listener's half of the handshake (handshake.py); a peer that proves it holds the cluster secret
        names its own data-plane address in its hello, and the socket becomes a link to that address. A peer that
        has not finished its part `handshake_timeout_s` after it connected is refused."""
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.handshake_timeout_s
        try:  # NOTE: asyncio.timeout, not wait_for, here and below: a close() that cancels this must not be dropped
            async with asyncio.timeout(self.handshake_timeout_s):
                channel = await open_channel(sock, self.tls, server_side=True)
        except (OSError, ConnectionError, asyncio.TimeoutError) as exc:  # ssl.SSLError too: a subclass of OSError
            self.num_peers_refused += 1  # only TLS can fail here: no certificate from the cluster's CA, or not TLS
            log.warning("dataplane_peer_refused", error=f"TLS handshake: {exc or type(exc).__name__}",
                        peer=_peer_name(sock))
            sock.close()
            return
        try:
            challenge = handshake.new_nonce()
            async with asyncio.timeout_at(deadline):
                hello = await _challenge(channel, challenge)
            try:
                nonce, address = handshake.check_hello(self.cluster_key, challenge, hello)
            except handshake.PeerRefused:
                self.num_peers_refused += 1
                await channel.sendall(Header(frames.OP_WELCOME, frames.STATUS_REFUSED).pack())
                raise
            proof = handshake.listener_proof(self.cluster_key, nonce, challenge, address)
            await channel.sendall(Header(frames.OP_WELCOME, payload_len=len(proof)).pack() + proof)
            self._add_link(channel, address.decode())
        except handshake.PeerRefused as exc:
            log.warning("dataplane_peer_refused", error=str(exc), peer=_peer_name(sock))
            sock.close()
        except (OSError, ConnectionError, FrameError, asyncio.TimeoutError, UnicodeDecodeError) as exc:
            self.num_peers_refused += 1  # no valid hello (garbage, silence, a hang-up): refused like a wrong proof
            log.warning("dataplane_bad_hello", error=str(exc) or type(exc).__name__, peer=_peer_name(sock))
            sock.close()

    def _add_link(self, channel: Channel, peer: str) -> Link:
        channel.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        link = Link(self, channel, peer)
        # NOTE: if both ends dialled at once there are two links. The first stays the one this end sends new
        # transfers on, as long as it is up: a request's pushes then all take one link, in one lane's FIFO order,
        # which is what the decode side's per-layer landing counts on (PrefillDone.layer_push_bytes). The second
        # carries what the other end sends on it, and replies to that. A reads-only link is never the first.
        current = self.links.get(peer)
        if not peer.endswith(READS_ONLY) and (current is None or current.error is not None):
            self.links[peer] = link
        self.open_links.add(link)
        return link

    def cut_links(self, reason: str = "cut by fault injection", peer: str | None = None) -> int:
        return self._cut([link for link in self.open_links if peer is None or link.peer == peer], reason)

    def cut_links_holding(self, ticket: int, reason: str) -> int:
        return self._cut([link for link in self.open_links if ticket in link.holding], reason)

    def _cut(self, links: list[Link], reason: str) -> int:
        for link in links:
            link.fail(DataPlaneError(f"data-plane link to {link.peer} {reason}"))
        return len(links)

    def revoke(self, ticket: int) -> Grant | None:
        grant = super().revoke(ticket)
        if grant is not None and grant.num_busy:
            for link in self.open_links:
                link.refuse_queued_replies(ticket)
        return grant

    def pacer_for(self, name: str) -> Pacer:
        """The pacer of the peer that link `name` goes to (one per peer: see `pacers`)."""
        peer = peer_of(name)
        if peer not in self.pacers:
            self.pacers[peer] = Pacer(self.link_gbps)
        return self.pacers[peer]

    def forget(self, link: Link) -> None:
        self.open_links.discard(link)
        if self.links.get(link.peer) is link:
            del self.links[link.peer]


async def _all_or_first_error(waits: list[asyncio.Future[None]]) -> None:
    """Wait for every chunk; raise the first error (after all have settled, so none is left pending)."""
    results = await asyncio.gather(*waits, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
