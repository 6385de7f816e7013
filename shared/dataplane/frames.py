"""Wire format of the TCP data plane: a fixed header, a segment table, then the payload.

    header  (36 bytes, network order): magic u32 | op u8 | status u8 | reserved u16 | seq u64 |
                                       ticket u64 | num_segments u32 | payload_len u64
    table   num_segments × (offset u64, length u64)   offsets into the *receiver's* region for PUSH,
                                                      into the *server's* region for READ
    payload payload_len bytes: the segments' bytes, in table order
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

MAGIC = 0x53474B56  # "SGKV"
HEADER = struct.Struct("!IBBHQQIQ")
SEGMENT = struct.Struct("!QQ")
MAX_SEGMENTS = 1 << 16

OP_PUSH, OP_PUSH_ACK, OP_READ, OP_READ_DATA = 1, 2, 3, 4
STATUS_OK, STATUS_REFUSED = 0, 1


class FrameError(ValueError):
    """Bytes that are not a valid frame: the connection is closed."""


@dataclass(frozen=True, slots=True)
class Header:
    op: int
    status: int
    seq: int
    ticket: int
    num_segments: int
    payload_len: int

    def pack(self) -> bytes:
        return HEADER.pack(MAGIC, self.op, self.status, 0, self.seq, self.ticket, self.num_segments, self.payload_len)

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> "Header":
        magic, op, status, _, seq, ticket, n, payload_len = HEADER.unpack(data)
        if magic != MAGIC:
            raise FrameError(f"bad magic {magic:#x}")
        if op not in (OP_PUSH, OP_PUSH_ACK, OP_READ, OP_READ_DATA):
            raise FrameError(f"unknown op {op}")
        if n > MAX_SEGMENTS:
            raise FrameError(f"{n} segments exceed the limit of {MAX_SEGMENTS}")
        return cls(op, status, seq, ticket, n, payload_len)


def pack_segments(pairs: list[tuple[int, int]]) -> bytes:
    return b"".join(SEGMENT.pack(offset, length) for offset, length in pairs)


def unpack_segments(data: bytes | memoryview, count: int) -> list[tuple[int, int]]:
    return [SEGMENT.unpack_from(data, i * SEGMENT.size) for i in range(count)]
