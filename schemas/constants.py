"""The constants and defaults every side shares, the plan's states, the error codes on the wire, and the one
kv_budget rule. Imports nothing of the project: the messages take their defaults from here."""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

# KV selectors (shared/compute/selectors); `hata_untrained` is HATA with random projections, only when asked for
SELECTORS = ("oracle", "infinigen", "hata", "quest", "keycodes", "positional", "hata_untrained")
# The faithful default: HATA at 20% is closer to dense than 4-bit quantization (KL 0.0077 against 0.0115 nats/token,
# top-token agreement 0.984 against 0.974, 2K held-out prompts: docs/results/faithful-default-2026-12-05); Quest at
# 10% (the earlier default) is at KL 0.17. HATA needs its offline preparation, which `smartgen model prepare` makes.
DEFAULT_SELECTOR = "hata"  # what a mode that needs a selector gets when the request names none (short prompts)
DEFAULT_KV_BUDGET = 0.2  # what a request with a selector attends to when it names no budget
KV_BITS = (2, 4, 8)  # quantized transfer's code widths
# 4, not 2: 2-bit codes turn short chats into garbage on SmolLM2 ("Name three primary colors." answered "The human
# beings:\n\n\nfurther…"); 4 bits answers right (KL vs dense ~0.02 nats/token at 2K, docs/results accuracy)
DEFAULT_KV_BITS = 4
PUSH_KV_BITS = (4, 8)  # smartgen's low-bit proactive push and reads (kv_bits on smartgen; 0 moves exact KV)
# what smartgen moves when the request names no kv_bits: K8V8 codes (KL vs exact ~1e-4, greedy prefixes equal:
# docs/results/push-codes), half the bytes of exact 16-bit KV on every path
DEFAULT_PUSH_KV_BITS = 8
# ... whose keys travel in 8 bits whatever kv_bits says: a key quantized per token loses its outlier channels
# (SmolLM2, 2K prompts, dense, tools/bench/push_codes_fidelity.py: first-step KL 0.017–0.07 with 4-bit keys,
# 0.004–0.011 with 8-bit keys and 4-bit values; KIVI and KVQuant find the same)
PUSH_KEY_BITS = 8
# `auto` with kv_bits: the request's consent to low-bit KV at this width, so the broker may also choose quantized
# transfer or smartgen's low-bit push (the widths both take); without kv_bits auto moves exact KV only
AUTO_KV_BITS = tuple(bits for bits in KV_BITS if bits in PUSH_KV_BITS)


@dataclass(frozen=True)
class SelectiveDefault:
    """What a request that needs a selector gets for the fields it leaves out, by its prompt's length."""

    from_tokens: int  # prompts of at least this many tokens (up to the next row's)
    selector: str
    kv_budget: float  # for this selector (another named selector gets DEFAULT_KV_BUDGET)
    push_bits: int  # smartgen's kv_bits: the width of its push and reads' values (keys: PUSH_KEY_BITS)


# The faithful default, chosen by measurement (docs/results/long-default-2026-12-08: teacher-forced KL to dense and
# bytes by token 64, five tasks, n = 5 per length). Short prompts: HATA at 20%, K8V8 (2K: KL 0.0099 against
# quantized-4bit's 0.0132; keycodes at 10% 0.0272, a tenth of a short prompt is too few; 3K: keycodes ties
# quantized-4bit, 0.0156 against 0.0159). From 4K on keycodes at 10% with 4-bit values is closer to dense than
# quantized-4bit with fewer bytes (4K: 0.0102 against 0.0152 at 0.90×; 6K: 0.0072 / 0.0125, 0.89×; 8K: 0.0071 /
# 0.0141, 0.76× with the selection's memory), where HATA's 20% needs 1.2–1.5× the bytes and at 8K falls behind.
SELECTIVE_DEFAULTS = (SelectiveDefault(0, DEFAULT_SELECTOR, DEFAULT_KV_BUDGET, DEFAULT_PUSH_KV_BITS),
                      SelectiveDefault(3500, "keycodes", 0.1, 4))


def selective_default(prompt_tokens: int) -> SelectiveDefault:
    """The SELECTIVE_DEFAULTS row for a prompt of `prompt_tokens` tokens."""
    return [row for row in SELECTIVE_DEFAULTS if prompt_tokens >= row.from_tokens][-1]


DENSE_LAYERS = 2  # layers 0 and 1 stay dense in every selector; smartgen pushes them whole
# the three paths, `query` (the query-aware part of the proactive push), `ahead` (reading a layer's predicted selection
# while the layer before it runs: InfiniGen's speculation) and `early` (step 1 starts while the push lands, each layer waiting for its own bytes only:
# without it, decode waits for the whole push first), `exact` (where a layer's push would leave after the prefill
# anyway, the prefill node runs step 1 first and pushes its exact selection), `stall` (after step 1, a step waits for
# the selected entries that are not here; without it, it attends to the best local entries instead and reads the
# missed ones without waiting: services/decode/read_behind.py), `direct` (path 2's reads issued and received by the
# decode's torch thread on a link of its own, not through its event loop: services/decode/direct_reads.py); a
# request may `ablate` any
SMARTGEN_PATHS = ("proactive", "parallel", "background", "query", "ahead", "early", "exact", "stall", "direct")
# What a decode worker does when a request's KV cannot come from the prefill node: `fail` the request with
# an error naming what failed, or `recompute` the prefill itself and carry on.
FAILURE_POLICIES = ("fail", "recompute")
# KV paths, as counted in `kv_bytes` and `smartgen_kv_transfer_bytes_total{path}`.
KV_PATHS = ("full", "quantized", "metadata", "proactive", "on_demand", "background")


class PlanState(StrEnum):
    """A transfer plan's states, in order; FAILED and EXPIRED can follow any state before RELEASED."""

    OPENING = "opening"
    TRANSFERRING = "transferring"
    ALL_LOCAL = "all_local"
    RELEASED = "released"
    FAILED = "failed"
    EXPIRED = "expired"

    @property
    def is_final(self) -> bool:
        """Nothing follows it: the plan is over."""
        return self in (PlanState.RELEASED, PlanState.FAILED, PlanState.EXPIRED)


PLAN_STATES = tuple(PlanState)


class ErrorCode(StrEnum):
    """Why a request over NATS was refused or failed (ErrorReply.code). The callee raises the first five; the caller
    adds UNAVAILABLE (no responder) and TIMEOUT (no reply in time)."""

    BAD_REQUEST = "bad_request"  # the request is wrong: asking again will not help
    NOT_FOUND = "not_found"  # it names something the worker does not hold
    OVERLOADED = "overloaded"  # the worker cannot take it now (no KV pages): ask again later
    AT_CAPACITY = "at_capacity"  # every request slot (max_active_requests) is taken: the gateway waits for one
    INTERNAL = "internal"  # the worker failed
    UNAVAILABLE = "unavailable"
    TIMEOUT = "timeout"

    @property
    def is_busy(self) -> bool:
        """The worker is full for now; another worker, or the same one later, may take the request."""
        return self in (ErrorCode.OVERLOADED, ErrorCode.AT_CAPACITY)


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
    `recent` tokens are always selected (they count toward the budget).

    And the selection's memory (`stick`, hysteresis): at a layer, a prompt entry that one of the request's earlier
    steps selected scores `stick` × the standard deviation of the step's scores (per KV head) higher, so a step
    prefers what is already on the decode node where scores are close. A slow link carries the *union* of a
    request's selections, and without memory 64 steps of 20% selections cover ~70% (2K) to ~80% (8K) of the
    entries. The default, 0.25 with the 20% default budget, takes that to 61% (2K) and 72% (8K) for ~2% more KL;
    30% with stick 1.0 is closer to dense than 20% without memory at a smaller union (2K 55%, 8K 64%), but its larger
    step 1 costs TTST on a slow link (docs/results/sticky-selection, serve-2k-sticky-default).
    Deterministic (earlier picks, not what happens to have landed), so every mode selects alike. Selectors that score
    whole pages (Quest) or nothing (positional) have no memory."""

    min_tokens: int = 128
    dense_below: int = 1024
    sinks: int = 4
    recent: int = 32
    stick: float = 0.25

    def tokens(self, value: float, num_tokens: int) -> int:
        """The entries per KV head a step over `num_tokens` cached tokens attends to under budget `value`."""
        if num_tokens < self.dense_below:
            return num_tokens
        return min(num_tokens, max(budget_tokens(value, num_tokens), self.min_tokens))


DEFAULT_FLOOR = BudgetFloor()
NO_FLOOR = BudgetFloor(min_tokens=1, dense_below=0, sinks=0, recent=0, stick=0.0)  # the bare budget (tests of the mechanics)


def budget_tokens(value: float, num_tokens: int) -> int:
    """The token count a budget `value` (see kv_budget_problem) keeps of `num_tokens` cached tokens, ≥ 1."""
    k = math.ceil(value * num_tokens) if value <= 1 else int(value)
    return max(1, min(num_tokens, k))


__all__ = ["SELECTORS", "DEFAULT_SELECTOR", "DEFAULT_KV_BUDGET", "KV_BITS", "DEFAULT_KV_BITS", "PUSH_KV_BITS", "DEFAULT_PUSH_KV_BITS",
           "PUSH_KEY_BITS", "AUTO_KV_BITS", "SelectiveDefault", "SELECTIVE_DEFAULTS", "selective_default", "DENSE_LAYERS", "SMARTGEN_PATHS", "FAILURE_POLICIES", "KV_PATHS",
           "PlanState", "PLAN_STATES", "ErrorCode", "kv_budget_problem", "BudgetFloor", "DEFAULT_FLOOR",
           "NO_FLOOR", "budget_tokens"]
