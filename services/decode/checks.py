"""What a `generate` asks, checked against its reservation before anything runs (services/decode/service.py):
every reason a decode worker refuses a request as malformed (`generate_problem`), and the aux area it fills."""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from schemas import FAILURE_POLICIES, Generate, KvLayout, OpenKv, mode_of, modes_where, plan_problem
from schemas.modes import Aux
from shared.compute.decode_engine import DecodeEngine
from shared.compute.kvstore import KvStore
from shared.compute.selectors import PreparationMissing
from services.decode.request import DecodeRequest
from shared.compute.modeling import ModelRunner

MODES_SERVED = modes_where(resolves_to=())


def generate_problem(req: Generate, state: DecodeRequest, runner: ModelRunner, layout: KvLayout) -> str:
    """Why `generate` cannot run this request as asked on the reservation `state` ("" if it can): a 400."""
    if req.max_tokens < 1:
        return "max_tokens must be ≥ 1"
    if req.failure_policy not in FAILURE_POLICIES:
        return f"failure_policy {req.failure_policy!r} is not one of {', '.join(FAILURE_POLICIES)}"
    if problem := runner.token_problem(req.token_ids):
        return problem
    if req.transfer_mode not in MODES_SERVED:
        return f"decode serves transfer modes {', '.join(MODES_SERVED)}, not {req.transfer_mode!r}"
    mode = mode_of(req.transfer_mode)
    if req.resume_tokens:
        if mode.is_disaggregated or req.first_token >= 0:
            return "resume_tokens: a request resumes in colocated mode, from its prompt"
        if len(req.resume_tokens) >= req.max_tokens:
            return "resume_tokens: nothing is left to generate"
        if problem := runner.token_problem(req.resume_tokens):
            return f"resume_tokens: {problem}"
    if not mode.is_disaggregated:
        return ""
    recomputing = req.first_token < 0 and req.failure_policy == "recompute"  # the prefill failed before token 1
    if req.first_token < 0 and not recomputing:
        return f"{req.transfer_mode} mode needs the first token from the prefill"
    if not state.mode.may_run_as(req.transfer_mode):
        return f"the KV was reserved for {state.mode.name!r}, not {req.transfer_mode!r}"
    if len(req.token_ids) != state.num_tokens:
        return "the prompt does not match the reservation's token count"
    if mode.keeps_source:
        if not req.selector or req.plan is None or (req.source is None and not recomputing) \
                or req.plan.transfer_mode != req.transfer_mode:
            return f"transfer_mode {req.transfer_mode!r} needs a selector, its plan and the prefill's KvSource"
        if problem := plan_problem(req.plan, layout.num_layers, state.num_tokens, layout.page_tokens):
            return problem
        if req.source is not None and req.source.codes_bits not in (0, req.kv_bits):
            # NOTE: read records land in the codes region the reservation sized for kv_bits
            return f"the prefill serves reads as {req.source.codes_bits}-bit codes, not kv_bits {req.kv_bits}"
    return mode.kv_bits_problem(req.kv_bits)


def open_problem(req: OpenKv, runner: ModelRunner) -> str:
    """Why `open` cannot reserve for `req` ("" if it can): a 400."""
    if req.transfer_mode not in modes_where(is_disaggregated=True):
        return f"open is for disaggregated transfer modes, not {req.transfer_mode!r}"
    if not 0 < req.num_tokens or req.max_tokens < 1 or req.num_tokens + req.max_tokens > runner.max_positions:
        return f"{req.num_tokens} prompt + {req.max_tokens} completion tokens do not fit 1..{runner.max_positions}"
    if req.token_ids and len(req.token_ids) != req.num_tokens:
        return f"token_ids must be the prompt's {req.num_tokens} token ids, not {len(req.token_ids)}"
    if req.token_ids and (problem := runner.token_problem(req.token_ids)):
        return f"token_ids: {problem}"
    return ""


def aux_to_fill(engine: DecodeEngine, req: Generate, state: DecodeRequest) -> int:
    """The part of the slab's aux area the prefill fills for the mode that runs: all of it, but for `auto`,
    which reserved room for each of its choices (metadata and a low-bit push's codes, or quantized codes).
    ValueError saying why when the reservation cannot hold it (a 400)."""
    assert state.slab is not None
    mode = mode_of(req.transfer_mode)
    try:
        needed = engine.aux_bytes(mode.aux, state.num_tokens, req.selector, req.kv_bits, mode.pushes_by_query)
    except PreparationMissing as exc:
        raise ValueError(str(exc)) from None
    if req.prefill_aux_bytes and req.prefill_aux_bytes != needed:
        raise ValueError(f"the prefill filled {req.prefill_aux_bytes} aux bytes; this decode worker expects {needed} "
                         f"for {req.transfer_mode} (different selector preparation?)")
    if needed > state.slab.aux_bytes:
        raise ValueError(f"{req.transfer_mode} with kv_bits {req.kv_bits} needs {needed} aux bytes; the reservation "
                         f"for {state.mode.name} has {state.slab.aux_bytes}")
    return needed


async def aux_to_reserve(engine: DecodeEngine, in_torch: Callable[..., Awaitable[Any]], req: OpenKv) -> int:
    """The aux area an `open` reserves: selector metadata (selective modes and auto) or low-bit codes.
    ValueError saying why it cannot (a 400)."""
    mode = mode_of(req.transfer_mode)
    if mode.aux is Aux.NONE:
        return 0
    if mode.aux is Aux.METADATA and not req.selector:
        raise ValueError(f"transfer_mode {req.transfer_mode!r} needs a selector")
    try:
        args = (mode.aux, req.num_tokens, req.selector, req.kv_bits, mode.pushes_by_query)
        if engine.has_selector(req.selector):  # sizes only: no need to queue behind the model's steps
            aux_bytes = engine.aux_bytes(*args)
        else:
            aux_bytes = await in_torch(engine.aux_bytes, *args)  # loads the selector's preparation once
        if req.kv_bits and Aux.CODES in (mode_of(m).aux for m in mode.resolves_to):  # auto may choose quantized
            aux_bytes = max(aux_bytes, engine.aux_bytes(Aux.CODES, req.num_tokens, "", req.kv_bits))
        return aux_bytes
    except PreparationMissing as exc:
        raise ValueError(str(exc)) from None


def fits_problem(store: KvStore, num_tokens: int, max_tokens: int, aux_bytes: int) -> str:
    """Why a request of `num_tokens` prompt and `max_tokens` completion tokens can never run on this worker's whole
    store ("" when it can): a 400, not a 429."""
    if store.pages_needed(num_tokens + max_tokens, aux_bytes) <= store.num_pages_total:
        return ""
    return (f"{num_tokens} + {max_tokens} tokens of KV exceed this worker's whole store "
            f"({store.num_pages_total * store.layout.page_tokens} tokens): ask for fewer tokens or raise kv_cache_mb")
