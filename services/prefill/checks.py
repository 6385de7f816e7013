"""What a `prefill` asks, checked before anything is allocated (services/prefill/service.py): every reason a
prefill worker refuses a request as malformed, in one pure function (the decode side's is services/decode/request.py `generate_problem`)."""
from __future__ import annotations

from schemas import KvLayout, Prefill, TransferMode, kv_budget_problem, mode_of, modes_where, plan_problem
from schemas.modes import Aux, Push
from shared.compute.modeling import ModelRunner

MODES_SERVED = modes_where(is_disaggregated=True, resolves_to=())


def prefill_problem(req: Prefill, runner: ModelRunner, layout: KvLayout) -> str:
    """Why this worker (its model `runner`, its store's `layout`) cannot prefill `req` as asked ("" if it can): a 400."""
    if req.transfer_mode not in MODES_SERVED:
        return f"prefill serves transfer modes {', '.join(MODES_SERVED)}, not {req.transfer_mode!r}"
    mode = mode_of(req.transfer_mode)
    if not req.token_ids or len(req.token_ids) != req.handle.num_tokens:
        return "the prompt is empty or does not match the KV handle's token count"
    if problem := runner.token_problem(req.token_ids):
        return problem
    if req.handle.layout != layout:
        return f"KV layout mismatch: decode has {req.handle.layout}, prefill has {layout}"
    if req.handle.capacity < len(req.token_ids) or req.handle.offset < 0 or req.handle.aux_bytes < 0:
        return "the KV handle's slab does not fit the prompt"
    if req.handle.cached_tokens and (mode.pushes is not Push.EVERY_ROW or not 0 < req.handle.cached_tokens < len(req.token_ids)):
        return (f"the KV handle's cached_tokens {req.handle.cached_tokens} must be 0, or in full mode fewer than the "
                f"prompt's {len(req.token_ids)} tokens")
    if mode.pushes is Push.PLAN_BLOCKS:
        if req.plan is None or req.plan.transfer_mode != req.transfer_mode or (mode.aux is Aux.METADATA and not req.selector):
            return f"transfer_mode {req.transfer_mode!r} needs its plan and a selector"
        if problem := plan_problem(req.plan, layout.num_layers, len(req.token_ids), layout.page_tokens):
            return problem
    if req.plan is not None and req.plan.exact_push and (problem := kv_budget_problem(req.kv_budget)):
        return f"the plan's exact push runs step 1 and needs its budget: {problem}"
    return mode.kv_bits_problem(req.kv_bits)


def reads_codes(mode: TransferMode, req: Prefill) -> bool:
    """smartgen with kv_bits: the decode node's reads (paths 2 and 3) move codes, not rows."""
    return mode.keeps_source and mode.pushes_by_query and req.kv_bits > 0
