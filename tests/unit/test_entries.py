"""Reads of remote KV as entry sets (services/decode/presence.py `Entries`): one gather, one landing and one marking
for entries of any layers, each the same bytes and values as the entry-by-entry rule it replaced, and path 3's
blocks in reads of `background_read_bytes` each instead of one unit per (layer, page, head)."""
from __future__ import annotations

import asyncio

import numpy as np
import torch

from schemas import KvSource, entry_record_bytes
from services.decode.presence import Entries, Presence
from services.decode.read_codes import ReadCodes
from services.decode.remote import RemoteKv
from services.decode.remote_lifecycle import read_blocks
from shared.compute.entry_codes import records_to_values
from shared.compute.kvstore import layout_for
from shared.dataplane import Gather, Lane

LAYOUT = layout_for(num_layers=4, num_kv_heads=3, head_dim=8, page_tokens=16, dtype=torch.float32)
N, CAPACITY, SRC_CAPACITY = 40, 48, 56  # three pages, the last one partial
PAGES = -(-N // LAYOUT.page_tokens)
TOKEN_BYTES = LAYOUT.head_dim * 4  # one token of one head's K (or V), fp32


def presence(pushed_pages: list[tuple[int, int]] = (), codes_bits: int = 0) -> Presence:
    pushed = np.zeros((LAYOUT.num_layers, PAGES), dtype=bool)
    for layer, page in pushed_pages:
        pushed[layer, page] = True
    source = KvSource("p", "a:1", 1, 4096, SRC_CAPACITY, 30.0, 0, codes_bits)
    return Presence(LAYOUT, source, 1 << 16, CAPACITY, N, pushed, None)


def test_missing_in_blocks_lists_each_absent_entry_once_block_by_block():
    """Each block once (a repeated block adds nothing), pushed ones and tokens past the prompt left out, block by
    block, head by head, tokens in order."""
    p = presence(pushed_pages=[(1, 0)])
    blocks = [1 * PAGES + 2, 1 * PAGES + 0, 3 * PAGES + 1, 1 * PAGES + 2]  # layer 1's partial page twice; a pushed one
    got = p.missing_in_blocks(blocks)
    want = [(layer, h, t) for layer, page in ((1, 2), (3, 1)) for h in range(3)
            for t in range(page * 16, min(N, page * 16 + 16))]
    assert list(zip(got.layer.tolist(), got.head.tolist(), got.token.tolist())) == want
    assert got.mean_run() == (8 * 3 + 16 * 3) / 6  # one run per (layer, head)


def test_mark_counts_only_what_is_new():
    p = presence()
    before = p.num_missing
    entries = Entries(np.array([0, 0, 2, 2]), np.array([1, 1, 0, 2]), np.array([3, 4, 39, 0]))
    p.mark(entries)
    p.mark(entries[:2])  # again: nothing new
    assert p.num_missing == before - 4 == int((~p.present).sum())
    assert p.missing_per_layer.tolist() == (~p.present).sum(axis=(1, 2)).tolist()
    assert p.present[0, 1, 3] and p.present[2, 2, 0] and not p.present[2, 2, 1]
    assert p.missing(Entries(np.array([0, 1]), np.array([1, 1]), np.array([3, 3]))).layer.tolist() == [1]


def entry_bytes_of(gather: Gather) -> tuple[list[int], list[int]]:
    return ((gather.src_base + gather.src_index * gather.unit).tolist(),
            (gather.dst_base + gather.dst_index * gather.unit).tolist())


def test_a_gather_across_layers_reads_each_entrys_k_and_v_rows():
    """Exact rows: every entry's K and V row, at the byte where that (layer, K|V, head) row of the slab holds the
    token, on both nodes (src_rows / dst_rows are the per-row addresses the reads used before)."""
    p = presence()
    entries = Entries(np.array([0, 3, 3, 1]), np.array([2, 0, 0, 1]), np.array([5, 6, 7, 39]))
    gather = p.gather(entries)
    assert gather.unit == TOKEN_BYTES and gather.num_bytes == 2 * entries.size * TOKEN_BYTES
    src, dst = entry_bytes_of(gather)
    want_src = [int(p.src_rows[layer, kv, h]) + t * TOKEN_BYTES
                for kv in (0, 1) for layer, h, t in zip(entries.layer, entries.head, entries.token)]
    want_dst = [int(p.dst_rows[layer, kv, h]) + t * TOKEN_BYTES
                for kv in (0, 1) for layer, h, t in zip(entries.layer, entries.head, entries.token)]
    assert src == want_src and dst == want_dst
    # layer 3, head 0, tokens 6-7 are one run on both sides: K and V one segment each
    assert [s.length for s in gather.segments()] == [TOKEN_BYTES, 2 * TOKEN_BYTES, TOKEN_BYTES] * 2


def test_codes_across_layers_are_gathered_and_landed_as_their_values():
    """Records: entry (layer, head, token) is record (layer·H + head)·N + token on both nodes; landing writes each
    one's dequantized K and V into its slab rows and nothing else."""
    bits, record = 8, entry_record_bytes(LAYOUT.head_dim, 8)
    p = presence(codes_bits=bits)
    slab_bytes = 1 << 16 + 1
    codes_at = slab_bytes
    num_records = LAYOUT.num_layers * LAYOUT.num_kv_heads * N
    region = memoryview(bytearray(codes_at + num_records * record))
    rng = np.random.default_rng(0)
    records = np.frombuffer(region, np.uint8, num_records * record, codes_at).reshape(num_records, record)
    records[:] = rng.integers(0, 256, records.shape, dtype=np.uint8)
    records[:, -8:] = np.frombuffer(np.float16([0.5, -1.0, 0.25, 2.0]).tobytes(), np.uint8)  # finite scales
    vectors = np.frombuffer(region, np.float32, (codes_at // TOKEN_BYTES) * LAYOUT.head_dim).reshape(-1, LAYOUT.head_dim)
    vectors[:] = np.nan
    codes = ReadCodes(LAYOUT, KvSource("p", "a:1", 1, 4096, SRC_CAPACITY, 30.0, 1 << 20, bits), N, codes_at, region,
                      p.dst_rows, TOKEN_BYTES)
    entries = Entries(np.array([0, 3, 2]), np.array([2, 0, 1]), np.array([5, 39, 0]))
    gather = codes.gather(entries)
    index = [(layer * 3 + h) * N + t for layer, h, t in zip(entries.layer, entries.head, entries.token)]
    assert gather.unit == record and gather.src_index.tolist() == gather.dst_index.tolist() == index
    assert (gather.src_base, gather.dst_base) == (1 << 20, codes_at)
    codes.land(entries)
    for layer, h, t, i in zip(entries.layer, entries.head, entries.token, index):
        keys, values = records_to_values(records[i: i + 1], LAYOUT.head_dim, bits)
        at = (int(p.dst_rows[layer, 0, h]) // TOKEN_BYTES + t, int(p.dst_rows[layer, 1, h]) // TOKEN_BYTES + t)
        assert np.array_equal(vectors[at[0]], keys[0]) and np.array_equal(vectors[at[1]], values[0])
    assert int(np.isfinite(vectors).all(axis=1).sum()) == 2 * entries.size  # nothing else touched


class CountingPlane:
    """Every read succeeds at once; records what each moved."""

    address = "fake:0"

    def __init__(self) -> None:
        self.reads: list[tuple[Lane, int]] = []

    async def read(self, _addr: str, _ticket: int, segments, lane: Lane, _whole_frames: bool = False) -> None:
        self.reads.append((lane, sum(s.length for s in segments)))

    async def read_gather(self, _addr: str, _ticket: int, gather: Gather, lane: Lane, _whole_frames: bool = False) -> None:
        self.reads.append((lane, gather.num_bytes))


async def test_path_3_reads_many_blocks_in_few_reads():
    """Every block of every layer, exact rows: reads of at most `background_read_bytes` each, as few as that
    allows (it was one unit per block and head, grouped), moving each missing entry once, all marked present."""
    plane = CountingPlane()
    source = KvSource("p", plane.address, 1, 0, N, 30.0)
    pushed = np.zeros((LAYOUT.num_layers, PAGES), dtype=bool)
    pushed[0] = True
    remote = RemoteKv(plane, asyncio.get_running_loop(), source, LAYOUT, 1 << 20, N, N, pushed,  # type: ignore[arg-type]
                      background_read_bytes=4096)
    missing = remote.num_missing
    await read_blocks(remote, list(range(LAYOUT.num_layers * PAGES)))
    per_entry = 2 * TOKEN_BYTES
    assert remote.num_missing == 0 and remote.bytes_background == missing * per_entry
    assert all(lane == Lane.BACKGROUND and size <= 4096 for lane, size in plane.reads)
    assert len(plane.reads) == -(-missing * per_entry // 4096)
    await read_blocks(remote, [PAGES + 1])  # all here: nothing to read
    assert len(plane.reads) == -(-missing * per_entry // 4096)
    await remote.close()
