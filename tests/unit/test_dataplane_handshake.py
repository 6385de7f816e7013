"""Only members link: every TCP data-plane connection starts with a mutual challenge–response keyed by the
cluster secret (shared/dataplane/handshake.py), and with the TLS settings, inside mutual TLS (channel.py). A
stranger — a peer with another secret, a raw socket that skips the handshake, a listener that cannot prove
itself, a peer without a certificate from the cluster's CA — is refused before any KV byte moves."""
from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from shared.dataplane import DataPlaneError, Gather, Grant, Segment, make_dataplane
from shared.dataplane import frames, handshake
from shared.dataplane.frames import Header
from tests.certificates import make_certificates

SIZE = 1 << 20


async def plane(secret: str):
    p = make_dataplane("tcp", cluster_secret=secret)
    region = bytearray(SIZE)
    p.register_region(memoryview(region))
    await p.start()
    return p, region


async def test_members_with_the_same_secret_link_and_move_bytes():
    a, ra = await plane("s3cret")
    b, rb = await plane("s3cret")
    try:
        ra[:4096] = os.urandom(4096)
        b.grant(Grant(1, [(0, 4096)]))
        await a.push(b.address, 1, [Segment(0, 0, 4096)])
        assert rb[:4096] == ra[:4096]
        assert b.stats()["authenticated"] and b.stats()["peers_refused"] == 0
    finally:
        await a.close()
        await b.close()


@pytest.mark.parametrize("stranger_secret", ["not-the-secret", ""])
async def test_a_peer_with_another_secret_is_refused_before_any_byte_lands(stranger_secret):
    """The stranger's push fails with an error saying it was refused; the member's region is untouched, it holds
    no link to the stranger, and it counted the refusal. Its ticket would have allowed the write."""
    member, region = await plane("s3cret")
    stranger, stranger_region = await plane(stranger_secret)
    try:
        stranger_region[:4096] = b"\xff" * 4096
        member.grant(Grant(1, [(0, 4096)]))
        with pytest.raises(DataPlaneError, match="refused"):
            await stranger.push(member.address, 1, [Segment(0, 0, 4096)])
        with pytest.raises(DataPlaneError, match="refused"):
            await stranger.read(member.address, 1, [Segment(0, 0, 4096)])
        assert region[:4096] == bytes(4096) and stranger_region[:4096] == b"\xff" * 4096
        assert not member.links and member.stats()["peers_refused"] == 2
        assert stranger.stats()["peers_refused"] == 2  # the dialer counts being refused too
    finally:
        await member.close()
        await stranger.close()


async def test_a_raw_socket_that_skips_the_handshake_never_gets_its_push_in():
    """A well-formed PUSH frame under a valid ticket, sent without the handshake: the connection is closed
    and the bytes never land."""
    member, region = await plane("s3cret")
    member.grant(Grant(7, [(0, 4096)]))
    host, port = member.address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        payload = b"\xab" * 4096
        writer.write(Header(frames.OP_PUSH, seq=1, ticket=7, num_segments=1, payload_len=len(payload)).pack()
                     + frames.pack_segments([(0, len(payload))]) + payload)
        await writer.drain()
        try:
            await asyncio.wait_for(reader.read(), 5)  # the challenge, then EOF: it closed on us
        except ConnectionResetError:  # closed with our payload unread: also a close
            pass
        await asyncio.sleep(0.05)
        assert region[:4096] == bytes(4096) and not member.links
        assert member.stats()["peers_refused"] == 1  # a garbled hello is a refused peer, as /stats tells operators
    finally:
        writer.close()
        await member.close()


async def test_a_listener_that_cannot_prove_the_secret_gets_nothing_from_the_dialer():
    """An impostor listener takes any hello and answers with a made-up proof: the dialer refuses it and sends
    no frame after its hello, so no KV leaves toward a process that is not a member."""
    received_after_hello = bytearray()

    async def impostor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        challenge = os.urandom(handshake.NONCE_BYTES)
        writer.write(Header(frames.OP_CHALLENGE, payload_len=len(challenge)).pack() + challenge)
        head = Header.unpack(await reader.readexactly(frames.HEADER.size))
        await reader.readexactly(head.payload_len)
        writer.write(Header(frames.OP_WELCOME, payload_len=32).pack() + os.urandom(32))
        await writer.drain()
        received_after_hello.extend(await reader.read())  # until the dialer closes
        writer.close()

    server = await asyncio.start_server(impostor, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    dialer, region = await plane("s3cret")
    try:
        region[:4096] = os.urandom(4096)
        with pytest.raises(DataPlaneError, match="prove"):
            await dialer.push(f"127.0.0.1:{port}", 1, [Segment(0, 0, 4096)])
        await asyncio.sleep(0.05)
        assert received_after_hello == b"" and not dialer.links
    finally:
        await dialer.close()
        server.close()
        await server.wait_closed()


def test_proofs_bind_the_nonces_and_the_address():
    """A proof made for one challenge, or one address, does not pass for another (no replay, no renaming)."""
    key, challenge, nonce = b"k", os.urandom(32), os.urandom(32)
    hello = handshake.hello_payload(key, challenge, nonce, b"10.0.0.1:9000")
    assert handshake.check_hello(key, challenge, hello) == (nonce, b"10.0.0.1:9000")
    with pytest.raises(handshake.PeerRefused):
        handshake.check_hello(key, os.urandom(32), hello)  # replayed against a fresh challenge
    with pytest.raises(handshake.PeerRefused):
        handshake.check_hello(key, challenge, hello[:64] + b"10.0.0.2:9000")  # another address
    with pytest.raises(handshake.PeerRefused):
        handshake.check_hello(b"other", challenge, hello)


async def tls_plane(pem: dict, secret: str = "s3cret"):
    p = make_dataplane("tcp", cluster_secret=secret, tls=(str(pem["ca.pem"]), str(pem["peer.pem"]), str(pem["peer.key"])))
    region = bytearray(SIZE)
    p.register_region(memoryview(region))
    await p.start()
    return p, region


async def test_members_link_through_mutual_tls_and_move_bytes_exactly(tmp_path):
    """With the TLS settings, links run through TLS (the bytes on the socket are not the KV) and pushes, reads and
    gathers land exactly, chunks of several TLS records included."""
    pem = make_certificates(tmp_path)
    a, ra = await tls_plane(pem)
    b, rb = await tls_plane(pem)
    try:
        ra[:] = os.urandom(SIZE)
        rb[:] = os.urandom(SIZE)
        b.grant(Grant(1, [(0, SIZE)]))
        await a.push(b.address, 1, [Segment(0, 0, 600_000), Segment(700_000, 650_000, 5)])
        assert rb[:600_000] == ra[:600_000] and rb[650_000:650_005] == ra[700_000:700_005]
        rb[:] = os.urandom(SIZE)
        await a.read(b.address, 1, [Segment(100, 0, 300_000)])
        assert ra[:300_000] == rb[100:300_100]
        await a.read_gather(b.address, 1, Gather(0, 0, 128, np.arange(4000, 0, -2), np.arange(2000)))
        assert all(ra[i * 128: (i + 1) * 128] == rb[(4000 - 2 * i) * 128: (4001 - 2 * i) * 128] for i in range(2000))
        assert a.stats()["tls"] and b.stats()["peers_refused"] == 0 and len(b.links) == 1
        link = a.links[b.address]
        assert type(link.channel).__name__ == "TlsChannel" and link.channel._tls.version() in ("TLSv1.2", "TLSv1.3")
    finally:
        await a.close()
        await b.close()


async def test_a_peer_without_the_cluster_cas_certificate_is_refused_before_any_byte_lands(tmp_path):
    """A dialer whose certificate another CA signed holds the cluster secret and a valid ticket, and still moves
    nothing: the TLS handshake fails (both ends say so at once), the member keeps no link and counts it."""
    member, region = await tls_plane(make_certificates(tmp_path))
    (tmp_path / "other").mkdir()
    intruder, intruder_region = await tls_plane(make_certificates(tmp_path / "other"))
    try:
        intruder_region[:4096] = b"\xff" * 4096
        member.grant(Grant(1, [(0, 4096)]))
        with pytest.raises(DataPlaneError, match="refused us"):
            await asyncio.wait_for(intruder.push(member.address, 1, [Segment(0, 0, 4096)]), 5)
        await _until(lambda: member.stats()["peers_refused"] == 1)
        assert region[:4096] == bytes(4096) and not member.links and intruder.stats()["peers_refused"] == 1
    finally:
        await member.close()
        await intruder.close()


async def test_a_plain_tcp_peer_is_refused_by_a_tls_member(tmp_path):
    """Data-plane frames in the clear (a worker without the TLS settings, once challenged) fail the member's TLS
    handshake at once: the connection is closed and counted, no link is made."""
    member, _ = await tls_plane(make_certificates(tmp_path))
    try:
        host, port = member.address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(Header(frames.OP_HELLO, payload_len=0).pack())
        await writer.drain()
        await asyncio.wait_for(reader.read(), 5)  # a TLS alert at most, then the member closes the connection
        await _until(lambda: member.stats()["peers_refused"] == 1)
        assert not member.links
        writer.close()
    finally:
        await member.close()


async def _until(condition, timeout_s: float = 2.0) -> None:
    """Wait for `condition()` (the member's side of a failed handshake may finish just after the dialer's)."""
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    assert condition()
