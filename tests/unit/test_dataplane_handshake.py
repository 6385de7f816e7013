"""Only members link: every TCP data-plane connection starts with a mutual challenge–response keyed by the
cluster secret (shared/dataplane/handshake.py). A stranger — a peer with another secret, a raw socket that
skips the handshake, or a listener that cannot prove itself — is refused before any KV byte moves."""
from __future__ import annotations

import asyncio
import os

import pytest

from shared.dataplane import DataPlaneError, Grant, Segment, make_dataplane
from shared.dataplane import frames, handshake
from shared.dataplane.frames import Header

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
