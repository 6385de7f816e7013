"""The plan geometry that prefill (which pushes), decode (which waits for the pushes) and the broker (which plans
them) must compute the same way, and the byte math of what each mode moves.

A request's prompt of N tokens is cut into pages of `page_tokens` tokens; a block is one (layer, page) pair,
numbered flat as layer·num_pages + page. A plan's `push_blocks` is a bitmap over those blocks (bit i of byte
i // 8, LSB first).
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import numpy as np

from schemas.constants import PUSH_KEY_BITS
from schemas.messages.kv import KvLayout, TransferPlan
from schemas.modes import Aux, Push, TransferMode


def num_pages(num_tokens: int, page_tokens: int) -> int:
    """Pages a prompt of `num_tokens` covers (the last one may be partly filled)."""
    return -(-num_tokens // page_tokens)


def page_keys(token_ids: Sequence[int], page_tokens: int) -> list[bytes]:
    """The hash-chain key of each full page of `token_ids` (a trailing partial page has none): key(page i) =
    sha256(key(page i-1) ‖ token ids of page i), so equal keys mean equal token ids from the start through that
    page. The prefix caches (prefill and decode) and the gateway's routing all key pages this way."""
    keys, previous = [], b""
    for start in range(0, len(token_ids) - page_tokens + 1, page_tokens):
        page = ",".join(map(str, token_ids[start:start + page_tokens])).encode()
        previous = hashlib.sha256(previous + b"|" + page).digest()
        keys.append(previous)
    return keys


def bitmap_bytes(num_blocks: int) -> int:
    return -(-num_blocks // 8)


def pack_bits(flags: np.ndarray) -> bytes:
    """Bool array → bitmap (flattened C-order, bit i of byte i // 8 is element i, LSB first)."""
    return np.packbits(np.asarray(flags, dtype=bool).ravel(), bitorder="little").tobytes()


def unpack_bits(data: bytes, shape: tuple[int, ...]) -> np.ndarray:
    """Bitmap → bool array of `shape` (ValueError unless the bitmap has exactly the bytes `shape` needs)."""
    count = math.prod(shape)
    if len(data) != bitmap_bytes(count):
        raise ValueError(f"a bitmap of {len(data)} bytes does not describe {count} blocks")
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), count=count, bitorder="little")
    return bits.astype(bool).reshape(shape)


def plan_problem(plan: TransferPlan, num_layers: int, num_tokens: int, page_tokens: int) -> str:
    """Why `plan` does not describe the blocks of this prompt ("" when it does)."""
    pages = num_pages(num_tokens, page_tokens)
    if plan.num_pages != pages or len(plan.push_blocks) != bitmap_bytes(num_layers * pages):
        return "the transfer plan does not describe this prompt's blocks"
    return ""


def pushed_pages(plan: TransferPlan, num_layers: int) -> np.ndarray:
    """(num_layers, num_pages) bool: the blocks the plan has the prefill push."""
    return unpack_bits(plan.push_blocks, (num_layers, plan.num_pages))


def token_runs(flags: np.ndarray) -> list[tuple[int, int]]:
    """Ranges [start, stop) of the runs of consecutive True entries of a 1-D bool array."""
    idx = np.flatnonzero(flags)
    if not idx.size:
        return []
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    starts, ends = idx[np.r_[0, breaks]], idx[np.r_[breaks - 1, idx.size - 1]] + 1
    return list(zip(starts.tolist(), ends.tolist()))


def page_runs(pages: np.ndarray, page_tokens: int, num_tokens: int) -> list[tuple[int, int]]:
    """Token ranges [start, stop) covering the runs of consecutive True pages of one layer."""
    return [(a * page_tokens, min(num_tokens, b * page_tokens)) for a, b in token_runs(pages)]


def pushed_runs(mode: TransferMode, plan: TransferPlan | None, layout: KvLayout,
                num_tokens: int, cached_tokens: int = 0) -> list[list[tuple[int, int]]]:
    """Per layer, the token ranges [start, stop) of KV rows the prefill pushes in `mode` (resolved). In `full`,
    the rows past `cached_tokens` (KvHandle.cached_tokens: the decode worker has the rest from its prefix cache;
    no other mode takes a hit)."""
    if mode.pushes is Push.EVERY_ROW:
        return [[(cached_tokens, num_tokens)] for _ in range(layout.num_layers)]
    assert not cached_tokens, f"{mode.name} takes no decode-side prefix cache hit"
    if mode.pushes is Push.PLAN_BLOCKS:
        assert plan is not None, f"{mode.name} pushes the plan's blocks: it needs a plan"
        pages = pushed_pages(plan, layout.num_layers)
        return [page_runs(pages[layer], layout.page_tokens, num_tokens) for layer in range(layout.num_layers)]
    return [[] for _ in range(layout.num_layers)]


# --- smartgen's low-bit proactive push (shared/compute/entry_codes.py) -------------------------------------
def entry_record_bytes(head_dim: int, bits: int) -> int:
    """One (layer, KV head, token) entry as codes: its K in PUSH_KEY_BITS and its V in `bits` per channel, each
    with an fp16 scale and minimum."""
    return head_dim * PUSH_KEY_BITS // 8 + head_dim * bits // 8 + 2 * 2 * 2


def wire_entry_bytes(layout: KvLayout, bits: int = 0) -> int:
    """One (layer, KV head, token) entry's K and V on the wire: exact, or as a record of `bits`-bit codes."""
    return entry_record_bytes(layout.head_dim, bits) if bits else layout.token_bytes // (layout.num_layers * layout.num_kv_heads)


def quantized_bytes(layout: KvLayout, num_tokens: int, bits: int) -> int:
    """The quantized mode's codes for a prompt of `num_tokens` (shared/compute/quantization.py's QuantLayout,
    before its alignment padding): sinks in fp16, K per token and V per 64-token partition in `bits`, each
    partition with an fp16 scale and minimum. The broker sizes auto's choice with it."""
    d, sinks = layout.head_dim, min(4, num_tokens)
    rest = num_tokens - sinks
    per_head = 2 * sinks * d * 2 + rest * (d * bits // 8 + 4) + d * math.ceil(rest / 64) * (64 * bits // 8 + 4)
    return layout.num_layers * layout.num_kv_heads * per_head


def pushed_aux_bytes(layout: KvLayout, num_tokens: int, aux_bytes: int, bits: int = 0) -> int:
    """The part of an aux area of `aux_bytes` the prefill fills whole: all of it but the codes region of the
    low-bit push (room for every entry; only the pushed records move, and count as proactive)."""
    return aux_bytes - entry_region_bytes(layout, num_tokens, bits) if aux_bytes else 0


def entry_region_bytes(layout: KvLayout, num_tokens: int, bits: int) -> int:
    """The aux bytes a request reserves for its pushed entries' codes: room for every entry of every layer."""
    return layout.num_layers * layout.num_kv_heads * num_tokens * entry_record_bytes(layout.head_dim, bits) if bits else 0


def pushed_bytes(mode: TransferMode, plan: TransferPlan | None, layout: KvLayout, num_tokens: int,
                 aux_bytes: int, query_entries: int = 0, push_bits: int = 0, cached_tokens: int = 0) -> int:
    """Every byte the prefill pushes in `mode` (resolved): its aux area, if the mode fills one, its rows, and
    the `query_entries` (layer, KV head, token) entries its query-aware push picked (K and V each). With
    `push_bits` (smartgen's low-bit push) the rows and entries travel as codes instead, and only the metadata
    part of the aux area moves whole. `cached_tokens`: as `pushed_runs`. The decode worker starts decoding once
    exactly this many bytes have landed."""
    rows = sum(stop - start for runs in pushed_runs(mode, plan, layout, num_tokens, cached_tokens) for start, stop in runs)
    aux = pushed_aux_bytes(layout, num_tokens, aux_bytes, push_bits) if mode.aux is not Aux.NONE else 0
    entries = rows * layout.num_kv_heads + query_entries
    return aux + entries * wire_entry_bytes(layout, push_bits)


__all__ = ["num_pages", "page_keys", "bitmap_bytes", "pack_bits", "unpack_bits", "plan_problem", "pushed_pages", "token_runs",
           "page_runs", "pushed_runs", "entry_record_bytes", "wire_entry_bytes", "quantized_bytes",
           "pushed_aux_bytes", "entry_region_bytes", "pushed_bytes"]
