"""The KV on both nodes: its geometry, where it lands (decode → prefill), where the rest can be read (prefill →
decode), and the plan that says which of it travels when (broker → prefill and decode)."""
from __future__ import annotations

from dataclasses import dataclass, field

from schemas.constants import DEFAULT_FLOOR, BudgetFloor


@dataclass(frozen=True, slots=True)
class KvLayout:
    """Geometry of a KV store. Both ends of a transfer must agree on it exactly.

    A request's slab is (num_layers, 2, num_kv_heads, capacity, head_dim), K then V, tokens contiguous per
    head; it is allocated in pages of `page_tokens` tokens.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_tokens: int
    dtype: str  # torch dtype name, e.g. "float32"
    token_bytes: int  # bytes of one token's K and V over all layers


@dataclass(frozen=True, slots=True)
class KvHandle:
    """Decode → gateway → prefill: where a request's KV must land on the decode node.

    The decode worker's slab for the request starts at byte `offset` of its registered region and holds
    `capacity` tokens (prompt plus room for the completion); see shared/compute/kvstore.py for its layout.
    """

    request_id: str
    decode_worker_id: str
    dataplane_addr: str
    ticket: int  # the decode side accepts pushes for this request only under this ticket
    layout: KvLayout
    num_tokens: int  # prompt tokens the prefill must deliver
    offset: int  # bytes
    capacity: int  # tokens
    aux_offset: int = 0  # bytes: where selector metadata or quantized codes land (see shared/compute/kvstore.py)
    aux_bytes: int = 0
    floor: BudgetFloor = DEFAULT_FLOOR  # the decode worker's budget floor: what its steps will attend to
    # full mode: the prompt's first tokens whose KV the decode worker already holds (its prefix cache) and has copied
    # into the slab: the prefill pushes only the rows from here on (schemas/geometry.py pushed_runs); 0 in other modes
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class KvSource:
    """Prefill → gateway → decode: where the KV that was not pushed can be read, and for how long.

    The prefill node keeps the request's slab (at `offset`, holding `capacity` tokens) under a lease that the
    decode node extends (`keep`) and ends (`release`) once every entry is local or the request is over.
    With `codes_bits` (smartgen with kv_bits 4 or 8) reads move codes, not rows: every prompt entry of every layer
    as one record (shared/compute/entry_codes.py: K in 8 bits, V in `codes_bits`), layer by layer from byte
    `codes_offset` of the prefill's region, record head·N + token within its layer; the ticket grants only those.
    """

    prefill_worker_id: str
    dataplane_addr: str
    ticket: int  # grants reads of the slab's prompt rows (or, with codes_bits, of its read-codes region only)
    offset: int  # bytes
    capacity: int  # tokens
    lease_s: float  # the lease ends this long after the last `keep`
    codes_offset: int = 0  # bytes: the read-codes region in the prefill's region (codes_bits > 0)
    codes_bits: int = 0  # 0: reads move the exact rows; 4 or 8: the V width of the records reads move


@dataclass(frozen=True, slots=True)
class OpenKv:
    """Gateway → decode (`decode.<id>.open`): reserve a slab for a request's KV. Reply: KvHandle."""

    request_id: str
    num_tokens: int  # prompt tokens
    max_tokens: int  # completion tokens to leave room for
    transfer_mode: str
    selector: str = ""  # partial, smartgen, auto: the selector whose metadata must land (sizes the aux area)
    kv_bits: int = 0  # quantized: 2, 4 or 8; smartgen: 0, or the proactive push's code width (4 or 8)
    # the prompt (num_tokens ids), for the decode worker's prefix cache to look up (full mode); [] = no lookup
    token_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """Broker → gateway → prefill and decode: how one request's KV moves (docs/architecture.md, "Transfer modes").

    Blocks are (layer, page) pairs: tokens [page·page_tokens, (page+1)·page_tokens) of one layer, K and V of
    every KV head. `push_blocks` is a bitmap over num_layers × num_pages (layer-major, bit i of byte i // 8
    is block i, LSB first) of what the prefill pushes while it computes.
    """

    request_id: str
    transfer_mode: str  # full, partial, quantized or smartgen (auto is resolved here)
    broker_worker_id: str
    num_pages: int  # pages of the prompt per layer
    push_blocks: bytes = b""
    num_push_blocks: int = 0
    profile: str = ""  # the profile that ordered the blocks ("" where none is used)
    profile_version: int = 0
    profile_source: str = ""  # "calibration", "online", or "positional" (the fallback when none is stored)
    link_gbps: float = 0.0  # the link estimate the plan was sized with
    prefill_tokens_per_s: float = 0.0  # the prefill rate estimate it was sized with
    parallel: bool = True  # path 2: fetch remote entries while gathering local ones (False: one after the other)
    background: bool = False  # path 3: speculative transfer of the rest
    reason: str = ""  # why this mode (auto) and this push budget, in words
    selector: str = ""  # the selector the request runs with, as resolved here ("" = dense: auto chose full)
    # smartgen's query-aware push: per KV head of each layer ≥ 2, how many tokens the prefill selects with that
    # layer's last-position query and pushes (beyond `push_blocks`); 0 = none
    query_tokens: int = 0  # … in layers DENSE_LAYERS … query_stop_layer − 1, as many as the link carries in time
    query_stop_layer: int = 0
    query_tail_tokens: int = 0  # … and from query_stop_layer on: step 1's budget, after the prefill's end if need be
    # … or step 1's exact selection (the prefill node runs step 1 first) in the layers whose push, by the link's
    # backlog when the prefill stores them, would leave only after it could (PrefillDone.exact_from_layer)
    exact_push: bool = False
    read_ahead: bool = True  # decode reads a layer's predicted selection while the one before runs (False: ablate "ahead")
    early_start: bool = True  # decode starts step 1 while the push lands, a layer at a time (False: ablate "early")
    stall: bool = True  # after step 1, a step waits for selected entries not yet here (False: ablate "stall")
    # the code width the resolved mode runs with: quantized's codes or smartgen's low-bit push (0 = exact KV). The
    # request's kv_bits, except where auto resolved to a mode that moves exact KV
    kv_bits: int = 0
    prefill_cached_tokens: int = 0  # the prefix cache hit it was sized with (OpenPlan's): the prefill computes the rest
    direct_reads: bool = True  # path 2's reads on the decode torch thread's own link where it has one (False: ablate "direct")
