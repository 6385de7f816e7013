"""The transfer contract: what each transfer mode moves and needs, the defaults every side shares, and the
plan geometry that prefill (which pushes), decode (which waits for the pushes) and the broker (which plans
them) must compute the same way. See docs/architecture.md, "Transfer modes".

No service compares mode names: each looks up the mode's row (`mode_of(name)`) and asks it a question
(`mode.pushes`, `mode.aux`, `mode.keeps_source`, …). `auto` is resolved once, by the broker; the plan it
returns carries the resolved mode and selector to everyone after it.

Geometry. A request's prompt of N tokens is cut into pages of `page_tokens` tokens; a block is one
(layer, page) pair, numbered flat as layer·num_pages + page. A plan's `push_blocks` is a bitmap over those
blocks (bit i of byte i // 8, LSB first).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # NOTE: messages.py takes its defaults from here, so this module must not import it at run time
    from schemas.messages import KvLayout, TransferPlan

# --- one source for each constant and default ---------------------------------------------------------
# KV selectors (shared/compute/selectors); `hata_untrained` is HATA with random projections, only when asked for
SELECTORS = ("oracle", "infinigen", "hata", "quest", "positional", "hata_untrained")
DEFAULT_SELECTOR = "quest"  # what a mode that needs a selector gets when the request names none
DEFAULT_KV_BUDGET = 0.1  # what a request with a selector attends to when it names no budget
KV_BITS = (2, 4)  # quantized transfer's code widths
DEFAULT_KV_BITS = 2
PUSH_KV_BITS = (4, 8)  # smartgen's low-bit proactive push (kv_bits on smartgen; 0, the default, pushes exact KV)
# ... whose keys travel in 8 bits whatever kv_bits says: a key quantized per token loses its outlier channels
# (SmolLM2, 2K prompts, dense, tools/bench/push_codes_fidelity.py: first-step KL 0.017–0.07 with 4-bit keys,
# 0.004–0.011 with 8-bit keys and 4-bit values; KIVI and KVQuant find the same)
PUSH_KEY_BITS = 8
# `auto` with kv_bits: the request's consent to low-bit KV at this width, so the broker may also choose quantized
# transfer or smartgen's low-bit push (the widths both take); without kv_bits auto moves exact KV only
AUTO_KV_BITS = tuple(bits for bits in KV_BITS if bits in PUSH_KV_BITS)
# A model worker refusing a request because all its request slots (max_active_requests) are taken starts its
# `overloaded` message with this; the gateway, which admitted the request counting those slots, waits for one
AT_CAPACITY = "at capacity"
DENSE_LAYERS = 2  # layers 0 and 1 stay dense in every selector; smartgen pushes them whole
# the three paths, `query` (the query-aware part of the proactive push), `ahead` (reading a layer's predicted selection
# while the layer before it runs: InfiniGen's speculation) and `early` (step 1 starts while the push lands, each layer waiting for its own bytes only:
# without it, decode waits for the whole push first), `exact` (where a layer's push would leave after the prefill
# anyway, the prefill node runs step 1 first and pushes its exact selection); a request may `ablate` any
SMARTGEN_PATHS = ("proactive", "parallel", "background", "query", "ahead", "early", "exact")
# What a decode worker does when a request's KV cannot come from the prefill node: `fail` the request with
# an error naming what failed, or `recompute` the prefill itself and carry on.
FAILURE_POLICIES = ("fail", "recompute")
# A transfer plan's states, in order; `failed` and `expired` can follow any state before `released`.
PLAN_STATES = ("opening", "transferring", "all_local", "released", "failed", "expired")
# KV paths, as counted in `kv_bytes` and `smartgen_kv_transfer_bytes_total{path}`.
KV_PATHS = ("full", "quantized", "metadata", "proactive", "on_demand", "background")


class Push(Enum):
    """Which rows of the KV the prefill pushes while it computes."""

    NOTHING = "nothing"
    EVERY_ROW = "every_row"  # every layer, every prompt token
    PLAN_BLOCKS = "plan_blocks"  # the blocks the plan's `push_blocks` names


class Aux(Enum):
    """What lands in the decode slab's aux area, ahead of or instead of the KV rows."""

    NONE = "none"
    METADATA = "metadata"  # the selector's metadata for every prompt token (layers ≥ DENSE_LAYERS)
    CODES = "codes"  # every layer's K/V as low-bit codes (shared/compute/quantization.py)


@dataclass(frozen=True, slots=True)
class TransferMode:
    """One row of the mode table."""

    name: str
    summary: str
    is_disaggregated: bool  # prefill on a prefill worker, KV over the data plane (False: colocated)
    pushes: Push
    aux: Aux
    is_selective: bool  # decode attends with a selector while part of the KV is still on the prefill node
    keeps_source: bool  # the prefill keeps the KV readable under a lease (on-demand and background reads)
    allows_selector: bool  # a request may name a selector (selective attention once the KV is local)
    needs_selector: bool  # a request that names none gets DEFAULT_SELECTOR
    kv_bits: tuple[int, ...] = ()  # the kv_bits a request must ask for (one of them); () = none
    # the kv_bits a request may ask its proactive push to travel in (shared/compute/entry_codes.py); 0 = exact
    push_bits: tuple[int, ...] = ()
    orders_by_profile: bool = False  # PLAN_BLOCKS: the most important blocks by the KV profile (else memory order)
    # the prefill also pushes, per layer, the entries its own last-position query selects; the metadata then
    # carries a bitmap of them (TransferPlan.query_tokens sizes it)
    pushes_by_query: bool = False
    has_paths: bool = False  # smartgen's paths can be switched off (`ablate`)
    resolves_to: tuple[str, ...] = ()  # auto: the modes the broker chooses between

    @property
    def is_resolved(self) -> bool:
        """A mode that runs as it is named (every one but auto, which the broker resolves)."""
        return not self.resolves_to

    @property
    def rows_path(self) -> str:
        """The KV path (KV_PATHS) its pushed rows count under."""
        return "full" if self.pushes is Push.EVERY_ROW else "proactive"

    @property
    def aux_path(self) -> str:
        """The KV path its aux bytes count under."""
        return "quantized" if self.aux is Aux.CODES else "metadata"

    def kv_bits_problem(self, kv_bits: int) -> str:
        """Why a request of this mode cannot run with `kv_bits` (0 = none asked for); "" when it can."""
        if self.resolves_to and kv_bits and kv_bits not in self.push_bits:
            return (f"{self.name} transfer takes kv_bits {' or '.join(map(str, self.push_bits))} (consent to low-bit "
                    f"KV: quantized or smartgen's low-bit push), or none for exact KV")
        if self.kv_bits and kv_bits not in self.kv_bits:
            return f"{self.name} transfer needs kv_bits {' or '.join(map(str, self.kv_bits))}"
        if not self.kv_bits and kv_bits and kv_bits not in self.push_bits:
            if not self.push_bits:
                return f"{self.name} transfer takes no kv_bits"
            return f"{self.name} transfer pushes its proactive KV in kv_bits {' or '.join(map(str, self.push_bits))}"
        return ""

    def push_width(self, kv_bits: int) -> int:
        """The code width of this mode's low-bit push for a request asking `kv_bits` (0: its push is exact)."""
        return kv_bits if self.push_bits else 0

    def may_run_as(self, resolved: str) -> bool:
        """Whether KV reserved for this mode may serve a request that runs as `resolved` (auto: its choices)."""
        return resolved == self.name or resolved in self.resolves_to


MODES: dict[str, TransferMode] = {m.name: m for m in (
    TransferMode("colocated", "nothing moves: the decode worker runs the prefill itself (the physical limit)",
                 is_disaggregated=False, pushes=Push.NOTHING, aux=Aux.NONE, is_selective=False, keeps_source=False,
                 allows_selector=True, needs_selector=False),
    TransferMode("full", "every layer's KV, pushed layer by layer during prefill; decode waits for all of it",
                 is_disaggregated=True, pushes=Push.EVERY_ROW, aux=Aux.NONE, is_selective=False, keeps_source=False,
                 allows_selector=True, needs_selector=False),
    TransferMode("partial", "metadata and the prompt's first pages in memory order; the rest read on demand",
                 is_disaggregated=True, pushes=Push.PLAN_BLOCKS, aux=Aux.METADATA, is_selective=True,
                 keeps_source=True, allows_selector=True, needs_selector=True),
    TransferMode("quantized", "every layer's KV as low-bit codes; decode dequantizes and attends densely",
                 is_disaggregated=True, pushes=Push.NOTHING, aux=Aux.CODES, is_selective=False, keeps_source=False,
                 allows_selector=False, needs_selector=False, kv_bits=KV_BITS),
    TransferMode("smartgen", "the three paths: profile push, parallel on-demand reads, background transfer",
                 is_disaggregated=True, pushes=Push.PLAN_BLOCKS, aux=Aux.METADATA, is_selective=True,
                 keeps_source=True, allows_selector=True, needs_selector=True, orders_by_profile=True, has_paths=True,
                 pushes_by_query=True, push_bits=PUSH_KV_BITS),
    # NOTE: the decode worker reserves auto's KV as for smartgen (metadata aux; with kv_bits, room for quantized's
    # codes too), since the broker may choose either; the plan's kv_bits says what the chosen mode runs with
    TransferMode("auto", "the broker chooses full or smartgen from the measured link and prompt length (with kv_bits "
                 "4, also quantized or smartgen's 4-bit push)",
                 is_disaggregated=True, pushes=Push.NOTHING, aux=Aux.METADATA, is_selective=False, keeps_source=False,
                 allows_selector=True, needs_selector=True, has_paths=True, pushes_by_query=True,
                 push_bits=AUTO_KV_BITS, resolves_to=("full", "quantized", "smartgen")),
)}
TRANSFER_MODES = tuple(MODES)
SERVABLE_TRANSFER_MODES = TRANSFER_MODES
SELECTIVE_MODES = tuple(name for name, m in MODES.items() if m.is_selective)


def mode_of(name: str) -> TransferMode:
    """The mode's row; ValueError naming the choices for an unknown name."""
    try:
        return MODES[name]
    except (KeyError, TypeError):
        raise ValueError(f"transfer_mode {name!r} is not one of {', '.join(TRANSFER_MODES)}") from None


def modes_where(**wanted: object) -> tuple[str, ...]:
    """Mode names whose row has every attribute `wanted` says, e.g. modes_where(is_disaggregated=True)."""
    return tuple(name for name, m in MODES.items() if all(getattr(m, k) == v for k, v in wanted.items()))


# --- the one kv_budget rule ------------------------------------------------------------------------------
def kv_budget_problem(value: object, max_tokens: int | None = None) -> str:
    """Why `value` is no KV budget ("" when it is one): a fraction of the cached tokens in (0, 1], or a whole
    number of tokens ≥ 1 (at most `max_tokens` where that is known). Booleans are neither."""
    limit = f" to {max_tokens}" if max_tokens else ""
    rule = f"kv_budget must be a fraction in (0, 1] or a whole number of tokens from 1{limit}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return rule
    if isinstance(value, float) and math.isnan(value):
        return rule
    if 0 < value <= 1:
        return ""
    is_whole = isinstance(value, int) or (math.isfinite(value) and float(value).is_integer())
    if is_whole and value >= 1 and (max_tokens is None or value <= max_tokens):
        return ""
    return rule


@dataclass(frozen=True, slots=True)
class BudgetFloor:
    """The floor every sparse-attention system has under its budget: a step over fewer than `dense_below` cached
    tokens attends densely; above it, a budget keeps at least `min_tokens`, and the first `sinks` and the last
    `recent` tokens are always selected (they count toward the budget)."""

    min_tokens: int = 128
    dense_below: int = 1024
    sinks: int = 4
    recent: int = 32

    def tokens(self, value: float, num_tokens: int) -> int:
        """The entries per KV head a step over `num_tokens` cached tokens attends to under budget `value`."""
        if num_tokens < self.dense_below:
            return num_tokens
        return min(num_tokens, max(budget_tokens(value, num_tokens), self.min_tokens))


DEFAULT_FLOOR = BudgetFloor()
NO_FLOOR = BudgetFloor(min_tokens=1, dense_below=0, sinks=0, recent=0)  # the bare budget (tests of the mechanics)


def budget_tokens(value: float, num_tokens: int) -> int:
    """The token count a budget `value` (see kv_budget_problem) keeps of `num_tokens` cached tokens, ≥ 1."""
    k = math.ceil(value * num_tokens) if value <= 1 else int(value)
    return max(1, min(num_tokens, k))


# --- plan geometry -----------------------------------------------------------------------------------------
def num_pages(num_tokens: int, page_tokens: int) -> int:
    """Pages a prompt of `num_tokens` covers (the last one may be partly filled)."""
    return -(-num_tokens // page_tokens)


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
                num_tokens: int) -> list[list[tuple[int, int]]]:
    """Per layer, the token ranges [start, stop) of KV rows the prefill pushes in `mode` (resolved)."""
    if mode.pushes is Push.EVERY_ROW:
        return [[(0, num_tokens)] for _ in range(layout.num_layers)]
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
                 aux_bytes: int, query_entries: int = 0, push_bits: int = 0) -> int:
    """Every byte the prefill pushes in `mode` (resolved): its aux area, if the mode fills one, its rows, and
    the `query_entries` (layer, KV head, token) entries its query-aware push picked (K and V each). With
    `push_bits` (smartgen's low-bit push) the rows and entries travel as codes instead, and only the metadata
    part of the aux area moves whole. The decode worker starts decoding once exactly this many bytes have landed."""
    rows = sum(stop - start for runs in pushed_runs(mode, plan, layout, num_tokens) for start, stop in runs)
    aux = pushed_aux_bytes(layout, num_tokens, aux_bytes, push_bits) if mode.aux is not Aux.NONE else 0
    entries = rows * layout.num_kv_heads + query_entries
    return aux + entries * wire_entry_bytes(layout, push_bits)


__all__ = ["AUTO_KV_BITS", "quantized_bytes", "AT_CAPACITY", "DEFAULT_KV_BITS", "PUSH_KEY_BITS", "PUSH_KV_BITS", "entry_record_bytes", "entry_region_bytes", "pushed_aux_bytes",
           "wire_entry_bytes", "DEFAULT_KV_BUDGET", "DEFAULT_SELECTOR", "DENSE_LAYERS", "FAILURE_POLICIES", "KV_BITS",
           "KV_PATHS", "MODES", "PLAN_STATES", "SELECTIVE_MODES", "SELECTORS", "SERVABLE_TRANSFER_MODES",
           "SMARTGEN_PATHS", "TRANSFER_MODES", "Aux", "BudgetFloor", "DEFAULT_FLOOR", "NO_FLOOR", "Push", "TransferMode",
           "bitmap_bytes", "budget_tokens",
           "kv_budget_problem", "mode_of", "modes_where", "num_pages", "pack_bits", "page_runs", "plan_problem",
           "pushed_bytes", "pushed_pages", "pushed_runs", "token_runs", "unpack_bits"]
