"""Property-based fuzzing of the TCP data plane's wire format (shared/dataplane/frames.py) and of the reader
that parses it off a socket: hostile bytes give FrameError (the connection closes), never another exception,
and no length field makes the reader allocate more than the format's bounds."""
from __future__ import annotations

import asyncio
import struct

import pytest
import structlog
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.dataplane import Grant, Segment, make_dataplane
from shared.dataplane import frames, handshake
from shared.dataplane.frames import (CHUNK_BYTES, HEADER, MAGIC, MAX_HELLO_BYTES, MAX_SEGMENTS, SEGMENT, FrameError,
                                     Header)

EXAMPLES = 300
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
# The most a reader allocates for one frame's table and payload, whatever the header says.
MAX_FRAME_ALLOCATION = MAX_SEGMENTS * SEGMENT.size + CHUNK_BYTES
U8, U16, U32, U64 = (st.integers(0, 2**bits - 1) for bits in (8, 16, 32, 64))

# Headers with the right magic and every other field arbitrary: what gets past the first check.
RAW_HEADERS = st.builds(lambda *fields: HEADER.pack(MAGIC, *fields), U8, U8, U16, U64, U64, U32, U64, U32)
VALID_HEADERS = st.one_of(
    st.builds(Header, st.just(frames.OP_HELLO), payload_len=st.integers(1, MAX_HELLO_BYTES)),
    st.builds(Header, st.just(frames.OP_PUSH), st.sampled_from(frames.STATUSES), U64, U64, st.integers(0, MAX_SEGMENTS),
              st.integers(0, CHUNK_BYTES), st.sampled_from([0, frames.FLAG_CHECKSUM]), U32),
    st.builds(Header, st.just(frames.OP_READ), st.sampled_from(frames.STATUSES), U64, U64,
              st.integers(0, MAX_SEGMENTS), flags=st.sampled_from([0, frames.FLAG_BACKGROUND, frames.FLAG_PUSH_LANE])),
    st.builds(Header, st.sampled_from([frames.OP_PUSH_ACK, frames.OP_READ_DATA]), st.sampled_from(frames.STATUSES),
              U64, U64),
)


def parse_or_refuse(data: bytes) -> Header | None:
    try:
        header = Header.unpack(data)
    except FrameError:
        return None
    assert header.num_segments * SEGMENT.size + header.payload_len <= MAX_FRAME_ALLOCATION
    return header


@FUZZ
@given(data=st.binary(max_size=2 * HEADER.size))
def test_header_parser_takes_any_bytes(data):
    """Bytes of any length (short, long, random) give a Header or FrameError, never struct.error."""
    parse_or_refuse(data)


@FUZZ
@given(data=RAW_HEADERS)
def test_header_length_fields_are_bounded_before_anything_is_allocated(data):
    """With a good magic and hostile op, status, flags and lengths: FrameError, or a header whose table and
    payload fit the format's bounds (what the reader allocates from it)."""
    header = parse_or_refuse(data)
    if header is not None:
        assert header.op in frames.OPS and header.status in frames.STATUSES
        assert header.num_segments <= MAX_SEGMENTS and header.payload_len <= CHUNK_BYTES


@FUZZ
@given(header=VALID_HEADERS)
def test_every_frame_the_sender_builds_round_trips(header):
    """pack → unpack gives the same header for every shape of frame the TCP plane sends."""
    assert Header.unpack(header.pack()) == header


@FUZZ
@given(data=st.binary(max_size=8 * SEGMENT.size), count=st.integers(-1, 2 * MAX_SEGMENTS))
def test_segment_table_parser_takes_any_bytes(data, count):
    """A segment table of the wrong size for its count is a FrameError, not struct.error."""
    try:
        table = frames.unpack_segments(data, count)
    except FrameError:
        return
    assert len(table) == count and all(0 <= x < 2**64 for pair in table for x in pair)


def test_header_parser_refuses_the_shapes_that_desynchronize_a_stream():
    """An ack or read with a payload, a reply with a table, an unknown status or flag: each is a FrameError."""
    bad = [Header(frames.OP_PUSH_ACK, payload_len=8), Header(frames.OP_READ, num_segments=1, payload_len=8),
           Header(frames.OP_READ_DATA, num_segments=1), Header(frames.OP_HELLO, num_segments=1, payload_len=4),
           Header(frames.OP_PUSH, status=7), Header(frames.OP_PUSH, flags=0x80)]
    for header in bad:
        with pytest.raises(FrameError):
            Header.unpack(header.pack())


# --- the reader on a live socket -------------------------------------------------------------------------------
HELLO = Header(frames.OP_HELLO, payload_len=len(b"fuzzer:1")).pack() + b"fuzzer:1"
FRAMES = st.builds(lambda head, table, payload: head + table + payload,
                   RAW_HEADERS | st.builds(Header.pack, VALID_HEADERS), st.binary(max_size=4 * SEGMENT.size),
                   st.binary(max_size=64))
STREAMS = st.one_of(st.binary(max_size=256), st.binary(min_size=HEADER.size, max_size=256),  # junk for a hello
                    st.builds(bytes.__add__, RAW_HEADERS, st.binary(max_size=64)),  # a hostile first header
                    st.builds(lambda frames_: HELLO + b"".join(frames_), st.lists(FRAMES, max_size=3)))


@pytest.fixture
async def server():
    """A TCP data plane serving a 1 MiB region, with one ticket granted on its first 4 KiB."""
    plane = make_dataplane("tcp")
    plane.register_region(memoryview(bytearray(1 << 20)))
    await plane.start()
    plane.grant(Grant(7, [(0, 4096)]))
    yield plane
    await plane.close()


async def send_and_wait_for_close(address: str, stream: bytes) -> None:
    """Send `stream`; one that starts with HELLO stands for "a member's handshake, then the rest", so the hostile
    frames after it reach an open link's reader (the fixture's plane has no secret: the key is empty)."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        if stream.startswith(HELLO):
            stream = stream[len(HELLO):]
            challenge = (await reader.readexactly(HEADER.size + handshake.NONCE_BYTES))[HEADER.size:]
            hello = handshake.hello_payload(b"", challenge, handshake.new_nonce(), b"fuzzer:1")
            writer.write(Header(frames.OP_HELLO, payload_len=len(hello)).pack() + hello)
            welcome = Header.unpack(await reader.readexactly(HEADER.size))
            assert welcome.op == frames.OP_WELCOME and welcome.status == frames.STATUS_OK
            await reader.readexactly(welcome.payload_len)
        writer.write(stream)
        writer.write_eof()
        await asyncio.wait_for(reader.read(), 2)  # whatever it answers, then EOF: the server closed the connection
    except ConnectionResetError:  # it closed with our bytes unread: also a close
        pass
    finally:
        writer.close()


@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(stream=STREAMS)
async def test_hostile_streams_close_only_their_connection(server, stream):
    """Junk, and hellos followed by hostile frames: the server closes that connection without a crash of its
    reader, its writer or its hello task, and still serves a well-behaved peer."""
    escaped: list[BaseException] = []
    greet = type(server)._greet

    async def greet_and_record(sock):  # the hello task: nothing awaits it, so record what escapes it here
        try:
            await greet(server, sock)
        except BaseException as exc:
            escaped.append(exc)
            raise

    server._greet = greet_and_record
    with structlog.testing.capture_logs() as logs:
        await send_and_wait_for_close(server.address, stream)
        await asyncio.sleep(0.01)
    crashes = [e for e in logs if e["event"] in ("dataplane_reader_crashed", "dataplane_writer_crashed")]
    assert not crashes and not escaped, (crashes, escaped)
    client = make_dataplane("tcp")
    client.register_region(memoryview(bytearray(4096)))
    await client.start()
    try:
        await client.push(server.address, 7, [Segment(0, 0, 4096)])
    finally:
        await client.close()


def test_struct_sizes_match_the_documented_format():
    """The header is 40 bytes and a segment 16, as the module docstring and MAX_FRAME_ALLOCATION assume."""
    assert HEADER.size == 40 and SEGMENT.size == 16 and struct.calcsize("!QQ") == SEGMENT.size


def test_checksum_is_crc32c_over_the_concatenated_parts():
    """The frame checksum is CRC-32C (Castagnoli): the standard check value, and split parts equal the whole."""
    assert frames.crc32c([b"123456789"]) == 0xE3069283
    data = bytes(range(256)) * 1000
    assert frames.crc32c([memoryview(data)[:1000], memoryview(data)[1000:]]) == frames.crc32c([data])
