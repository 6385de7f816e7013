"""Wire format of the TCP data plane: a fixed header, a segment table, then the payload.

    header  (40 bytes, network order): magic u32 | op u8 | status u8 | flags u16 | seq u64 | ticket u64 |
                                       num_segments u32 | payload_len u64 | crc32c u32
    table   num_segments × (offset u64, length u64)   offsets into the *receiver's* region for PUSH,
                                                      into the *server's* region for READ
    payload payload_len bytes: the segments' bytes, in table order (≤ CHUNK_BYTES per frame)

A GATHER (a read of scattered entries of one size) has no table: its payload is a descriptor,

    base u64 | unit u32 | count u32 | count × index u32     entry i = `unit` bytes at base + index[i] × unit

and its reply is an ordinary READ_DATA whose payload is the entries in descriptor order (count × unit ≤ CHUNK_BYTES).

Every data frame is one chunk; `crc32c` (Castagnoli, hardware-computed: ~20 GB/s against zlib's ~3 GB/s on
these VMs) covers its payload when FLAG_CHECKSUM is set.
"""
from __future__ import annotations

import dataclasses
import struct
from collections.abc import Iterable
from dataclasses import dataclass

import crc32c as _crc32c
import numpy as np

from shared.dataplane.base import Lane, entries

MAGIC = 0x53474B56  # "SGKV"
HEADER = struct.Struct("!IBBHQQIQI")
SEGMENT = struct.Struct("!QQ")
GATHER = struct.Struct("!QII")  # a gather descriptor's head: base, unit, count (its indices follow, u32 each)
GATHER_INDEX = np.dtype(">u4")
MAX_SEGMENTS = 1 << 16
CHUNK_BYTES = 256 << 10  # the most one frame carries: a high-priority frame waits behind at most this much
MAX_HELLO_BYTES = 512
MAX_STAGED_TABLE = 4096 * SEGMENT.size  # frames whose segment table is larger go out without staging

OP_HELLO, OP_PUSH, OP_PUSH_ACK, OP_READ, OP_READ_DATA, OP_CHALLENGE, OP_WELCOME, OP_GATHER = 0, 1, 2, 3, 4, 5, 6, 7
OPS = (OP_HELLO, OP_PUSH, OP_PUSH_ACK, OP_READ, OP_READ_DATA, OP_CHALLENGE, OP_WELCOME, OP_GATHER)
HANDSHAKE_OPS = (OP_CHALLENGE, OP_HELLO, OP_WELCOME)  # before a link opens (handshake.py); never on an open link
STATUS_OK, STATUS_REFUSED, STATUS_CORRUPT = 0, 1, 2
STATUSES = (STATUS_OK, STATUS_REFUSED, STATUS_CORRUPT)
FLAG_CHECKSUM = 1
FLAG_BACKGROUND = 2  # on a READ or GATHER: answer it on the server's BACKGROUND lane
FLAG_PUSH_LANE = 4  # on a READ or GATHER: answer it on the server's PUSH lane (a guess: below on-demand reads)
KNOWN_FLAGS = FLAG_CHECKSUM | FLAG_BACKGROUND | FLAG_PUSH_LANE
# the lane a READ or GATHER asks its reply to travel on, as its flags say it (both ends read this one table)
LANE_FLAGS = {Lane.ON_DEMAND: 0, Lane.PUSH: FLAG_PUSH_LANE, Lane.BACKGROUND: FLAG_BACKGROUND}


def reply_lane(flags: int) -> Lane:
    """The lane a READ or GATHER with these flags asks its reply to travel on (LANE_FLAGS read backwards)."""
    return next((lane for lane, flag in LANE_FLAGS.items() if flag and flags & flag), Lane.ON_DEMAND)


class FrameError(ValueError):
    """Bytes that are not a valid frame: the connection is closed."""


@dataclass(frozen=True, slots=True)
class Header:
    op: int
    status: int = STATUS_OK
    seq: int = 0
    ticket: int = 0
    num_segments: int = 0
    payload_len: int = 0
    flags: int = 0
    crc: int = 0

    def with_crc(self, crc: int) -> "Header":
        """This header saying its payload's crc32c."""
        return dataclasses.replace(self, flags=self.flags | FLAG_CHECKSUM, crc=crc)

    def pack(self) -> bytes:
        return HEADER.pack(MAGIC, self.op, self.status, self.flags, self.seq, self.ticket, self.num_segments,
                           self.payload_len, self.crc)

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> "Header":
        """A header read off the wire, checked before the reader allocates anything it announces:
        raises FrameError for any 40 bytes that are not a header this side can act on."""
        if len(data) != HEADER.size:
            raise FrameError(f"a header is {HEADER.size} bytes, not {len(data)}")
        magic, op, status, flags, seq, ticket, n, payload_len, crc = HEADER.unpack(data)
        if magic != MAGIC:
            raise FrameError(f"bad magic {magic:#x}")
        if op not in OPS:
            raise FrameError(f"unknown op {op}")
        if status not in STATUSES:
            raise FrameError(f"unknown status {status}")
        if flags & ~KNOWN_FLAGS:
            raise FrameError(f"unknown flags {flags:#x}")
        # NOTE: bounds first: the reader allocates num_segments × 16 bytes of table from this header
        if n > MAX_SEGMENTS:
            raise FrameError(f"{n} segments exceed the limit of {MAX_SEGMENTS}")
        limit = MAX_HELLO_BYTES if op in HANDSHAKE_OPS else CHUNK_BYTES
        if payload_len > limit:
            raise FrameError(f"payload of {payload_len} bytes exceeds the limit of {limit} for op {op}")
        if n and op not in (OP_PUSH, OP_READ):
            raise FrameError(f"op {op} carries no segment table, yet announces {n} segments")
        if payload_len and op in (OP_PUSH_ACK, OP_READ):
            raise FrameError(f"op {op} carries no payload, yet announces {payload_len} bytes")
        return cls(op, status, seq, ticket, n, payload_len, flags, crc)


def pack_segments(pairs: Iterable[tuple[int, int]]) -> bytes:
    return b"".join(SEGMENT.pack(offset, length) for offset, length in pairs)


def unpack_segments(data: bytes | memoryview, count: int) -> list[tuple[int, int]]:
    """`count` (offset, length) pairs; FrameError if `data` is not exactly that table."""
    if not 0 <= count <= MAX_SEGMENTS or len(data) != count * SEGMENT.size:
        raise FrameError(f"a table of {count} segments is {count * SEGMENT.size} bytes, not {len(data)}")
    return [SEGMENT.unpack_from(data, i * SEGMENT.size) for i in range(count)]


def pack_gather(base: int, unit: int, index: np.ndarray) -> bytes:
    """A GATHER's descriptor; `index` must fit u32 (the caller falls back to segments otherwise)."""
    return GATHER.pack(base, unit, index.size) + index.astype(GATHER_INDEX).tobytes()


def unpack_gather(data: bytes | memoryview) -> tuple[int, int, np.ndarray]:
    """(base, unit, index as int64) of a descriptor; FrameError unless it is exactly one descriptor whose entries
    fit one chunk."""
    if len(data) < GATHER.size:
        raise FrameError(f"a gather descriptor is at least {GATHER.size} bytes, not {len(data)}")
    base, unit, count = GATHER.unpack_from(data)
    if len(data) != GATHER.size + count * GATHER_INDEX.itemsize:
        raise FrameError(f"a gather of {count} entries is {GATHER.size + count * GATHER_INDEX.itemsize} bytes, "
                         f"not {len(data)}")
    if unit == 0 or count * unit > CHUNK_BYTES:
        raise FrameError(f"a gather of {count} × {unit} bytes is not one chunk (≤ {CHUNK_BYTES} bytes)")
    return base, unit, np.frombuffer(data, GATHER_INDEX, count, GATHER.size).astype(np.int64)


def crc32c(parts: Iterable[memoryview | bytes]) -> int:
    """CRC-32C of the parts, as if concatenated (SSE4.2 / ARMv8 instructions where the CPU has them)."""
    crc = 0
    for part in parts:
        crc = _crc32c.crc32c(part, value=crc)
    return crc


def land_gather_reply(header: Header, stage: memoryview, region: memoryview, dst_base: int, unit: int,
                      index: np.ndarray) -> bool:
    """A gather's reply, received whole into `stage` (header.payload_len bytes): unless its crc32c fails (False,
    nothing written), entry i lands at dst_base + index[i] · unit of `region`. NOTE: only verified bytes reach the
    region, where attention may read them."""
    if header.flags & FLAG_CHECKSUM and crc32c([stage]) != header.crc:
        return False
    if index.size:
        entries(region, dst_base, unit, int(index.max()) + 1)[index] = entries(stage, 0, unit, index.size)
    return True
