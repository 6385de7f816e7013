"""What a `generate` asks, checked against its reservation before anything runs (services/decode/service.py):
every reason a decode worker refuses a request as malformed, in one function."""
from __future__ import annotations

from schemas import FAILURE_POLICIES, Generate, KvLayout, mode_of, modes_where, plan_problem
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
    return mode.kv_bits_problem(req.kv_bits)
