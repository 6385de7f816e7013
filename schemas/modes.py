"""The transfer mode table: what each mode moves and needs. See docs/architecture.md, "Transfer modes".

No service compares mode names: each looks up the mode's row (`mode_of(name)`) and asks it a question
(`mode.pushes`, `mode.aux`, `mode.keeps_source`, …). `auto` is resolved once, by the broker; the plan it
returns carries the resolved mode and selector to everyone after it.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, StrEnum

from schemas.constants import AUTO_KV_BITS, DEFAULT_PUSH_KV_BITS, KV_BITS, PUSH_KV_BITS


class ModeName(StrEnum):
    """The transfer modes' names: what requests, messages and plans carry (`transfer_mode`)."""

    COLOCATED = "colocated"
    FULL = "full"
    PARTIAL = "partial"
    QUANTIZED = "quantized"
    SMARTGEN = "smartgen"
    AUTO = "auto"


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
    default_push_bits: int = 0  # the push width a short prompt's request that names no kv_bits gets (0: exact; `kv_bits: 0` asks for it; long prompts: SELECTIVE_DEFAULTS)
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
        return "full" if self.pushes is Push.EVERY_ROW else "proactive"  # KV_PATHS names, not modes

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
    TransferMode(ModeName.COLOCATED, "nothing moves: the decode worker runs the prefill itself (the physical limit)",
                 is_disaggregated=False, pushes=Push.NOTHING, aux=Aux.NONE, is_selective=False, keeps_source=False,
                 allows_selector=True, needs_selector=False),
    TransferMode(ModeName.FULL, "every layer's KV, pushed layer by layer during prefill; decode waits for all of it",
                 is_disaggregated=True, pushes=Push.EVERY_ROW, aux=Aux.NONE, is_selective=False, keeps_source=False,
                 allows_selector=True, needs_selector=False),
    TransferMode(ModeName.PARTIAL, "metadata and the prompt's first pages in memory order; the rest read on demand",
                 is_disaggregated=True, pushes=Push.PLAN_BLOCKS, aux=Aux.METADATA, is_selective=True,
                 keeps_source=True, allows_selector=True, needs_selector=True),
    TransferMode(ModeName.QUANTIZED, "every layer's KV as low-bit codes; decode dequantizes and attends densely",
                 is_disaggregated=True, pushes=Push.NOTHING, aux=Aux.CODES, is_selective=False, keeps_source=False,
                 allows_selector=False, needs_selector=False, kv_bits=KV_BITS),
    TransferMode(ModeName.SMARTGEN, "the three paths: profile push, parallel on-demand reads, background transfer",
                 is_disaggregated=True, pushes=Push.PLAN_BLOCKS, aux=Aux.METADATA, is_selective=True,
                 keeps_source=True, allows_selector=True, needs_selector=True, orders_by_profile=True, has_paths=True,
                 pushes_by_query=True, push_bits=PUSH_KV_BITS, default_push_bits=DEFAULT_PUSH_KV_BITS),
    # NOTE: the decode worker reserves auto's KV as for smartgen (metadata aux; with kv_bits, room for quantized's
    # codes too), since the broker may choose either; the plan's kv_bits says what the chosen mode runs with
    TransferMode(ModeName.AUTO, "the broker chooses full or smartgen from the measured link and prompt length (with kv_bits "
                 "4, also quantized or smartgen's 4-bit push)",
                 is_disaggregated=True, pushes=Push.NOTHING, aux=Aux.METADATA, is_selective=False, keeps_source=False,
                 allows_selector=True, needs_selector=True, has_paths=True, pushes_by_query=True,
                 push_bits=AUTO_KV_BITS, resolves_to=(ModeName.FULL, ModeName.QUANTIZED, ModeName.SMARTGEN)),
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


__all__ = ["ModeName", "Push", "Aux", "TransferMode", "MODES", "TRANSFER_MODES", "SERVABLE_TRANSFER_MODES", "SELECTIVE_MODES",
           "mode_of", "modes_where"]
