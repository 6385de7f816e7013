"""One request's life on NATS: the gateway's prefill and generate calls, the tokens streamed back, and the
calls that end it early (abort, a transfer that failed)."""
from __future__ import annotations

from dataclasses import dataclass, field

from schemas.constants import FAILURE_POLICIES
from schemas.messages.kv import KvHandle, KvSource, TransferPlan


@dataclass(frozen=True, slots=True)
class Sampling:
    """Sampling settings, shared by prefill (token 1) and decode (tokens 2…)."""

    temperature: float = 0.0  # 0 = greedy
    seed: int = 0
    top_p: float = 1.0  # nucleus: sample among the most likely tokens whose probabilities reach top_p (1 = all)
    top_k: int = 0  # sample among the top_k most likely tokens (0 = all)
    presence_penalty: float = 0.0  # OpenAI: subtracted from the logit of every token the completion already has
    frequency_penalty: float = 0.0  # OpenAI: subtracted × the number of times the completion has the token
    repetition_penalty: float = 1.0  # HF/vLLM: logits of tokens in the prompt or the completion ÷ it (if > 0, else ×)
    logit_bias: dict[str, float] = field(default_factory=dict)  # OpenAI: token id (a string) → added to its logit
    logprobs: int = -1  # ≥ 0: report each token's log-probability and this many most likely alternatives
    echo: bool = False  # with logprobs ≥ 0: the prefill also reports every prompt token's (OpenAI `echo`)
    min_p: float = 0.0  # vLLM: at temperature > 0, drop tokens less likely than min_p × the most likely one
    min_tokens: int = 0  # vLLM: the tokens in `end_ids` cannot be sampled before this many tokens were generated
    end_ids: list[int] = field(default_factory=list)  # the token ids that end the answer (what min_tokens holds off)
    # structured output: an llguidance grammar (its JSON text, checked by the gateway) every sampled token must
    # follow; the workers mask the logits with it and end the answer when it is complete ("" = free text)
    grammar: str = ""


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One token's log-probability under the model (its raw distribution, before temperature), and the most
    likely tokens at that position, most likely first."""

    logprob: float
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Prefill:
    """Gateway → prefill (`prefill.<id>.prefill`): run the prompt, push KV to `handle`. Reply: PrefillDone."""

    request_id: str
    token_ids: list[int]
    transfer_mode: str
    sampling: Sampling
    handle: KvHandle
    plan: TransferPlan | None = None  # every mode but colocated
    selector: str = ""  # partial, smartgen: the prefill computes this selector's metadata for every token
    kv_bits: int = 0  # quantized; smartgen's low-bit proactive push
    kv_budget: float | None = None  # smartgen's exact push (plan.exact_push): step 1's budget, as Generate.kv_budget


@dataclass(frozen=True, slots=True)
class PrefillDone:
    """Prefill → gateway: the first token. KV pushes may still be in flight (they overlap decode start)."""

    request_id: str
    first_token: int
    prefill_worker_id: str
    num_prompt_tokens: int
    prefill_s: float  # compute time of the prefill forward pass
    source: KvSource | None = None  # partial, smartgen: the KV left on the prefill node
    query_entries: int = 0  # (layer, KV head, token) entries pushed by query (TransferPlan.query_tokens)
    first_logprobs: TokenLogprobs | None = None  # Sampling.logprobs ≥ 0: the first token's
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # Sampling.echo: prompt tokens 1…N-1's
    aux_bytes: int = 0  # the part of the decode slab's aux area this prefill filled (≤ KvHandle.aux_bytes)
    # bytes pushed per layer, in the order they leave (one link, one lane: they land in that order too), so the
    # decode worker knows layer l has landed once the bytes up to it have, and need not wait for the rest
    layer_push_bytes: list[int] = field(default_factory=list)
    exact_from_layer: int = 0  # TransferPlan.exact_push: the first layer that pushed step 1's exact selection (0: none)
    step_one_s: float = 0.0  # the exact push: step 1 run on the prefill node before token 1 (seconds, not in prefill_s)
    # prompt tokens whose KV came from the prefill's prefix cache, not computed (pushed all the same)
    num_cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Generate:
    """Gateway → decode (`decode.<id>.generate`): produce tokens and stream them. Reply: Accepted.

    In `full` mode `first_token` comes from the prefill and the KV arrives over the data plane;
    in `colocated` mode the decode worker runs the prefill itself (`first_token` = -1). Under failure_policy
    `recompute` a disaggregated request may also come with `first_token` = -1: its prefill failed before
    the first token, and the decode worker recomputes it.
    """

    request_id: str
    transfer_mode: str
    token_ids: list[int]  # the prompt (used by colocated mode and for checks)
    first_token: int
    max_tokens: int  # total tokens of the completion, including the first
    stop_token_ids: list[int]
    sampling: Sampling
    stream_subject: str  # where TokenEvents go
    selector: str = ""  # "" = dense attention; else a KV selector name (see shared/compute/selectors)
    kv_budget: float | None = None  # with a selector: a fraction (0, 1] of the cached tokens, or a token count > 1; None without
    plan: TransferPlan | None = None
    source: KvSource | None = None  # partial, smartgen
    kv_bits: int = 0  # quantized; smartgen's low-bit proactive push
    prefill_worker_id: str = ""  # who prefilled (every mode but colocated)
    prefill_dataplane_addr: str = ""  # where its pushes come from: if that link drops, waiting for them stops
    failure_policy: str = FAILURE_POLICIES[0]  # one of FAILURE_POLICIES
    query_entries: int = 0  # PrefillDone.query_entries: part of what decode waits for before its first step
    # a request moved here because its decode worker died (colocated, failure_policy recompute): the completion
    # tokens the client already has; this worker recomputes the prompt, replays them and streams from there on
    resume_tokens: list[int] = field(default_factory=list)
    # PrefillDone.aux_bytes: decode checks it against what it computes the running mode fills (a prefill and a
    # decode worker with different selector preparations disagree here, instead of waiting for bytes that never come)
    prefill_aux_bytes: int = 0
    layer_push_bytes: list[int] = field(default_factory=list)  # PrefillDone.layer_push_bytes
    # the gateway that streams this request to its client: once its heartbeats stop, nobody reads the stream and the
    # decode worker aborts the request ("" = not said: never aborted for that)
    gateway_id: str = ""


@dataclass(frozen=True, slots=True)
class Accepted:
    """Decode → gateway: the request is admitted and tokens will follow on its stream subject."""

    request_id: str
    decode_worker_id: str


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """Decode → gateway (on `stream_subject`): one token, or the end of the stream.

    `index` counts completion tokens from 0 (token 0 is the first token). The last event has
    `finish_reason` set ("length", "stop", "abort" or "error") and carries the request's transfer stats.
    """

    request_id: str
    index: int
    token_id: int  # -1 on a final event without a token
    finish_reason: str = ""
    error: str = ""
    kv_bytes: dict[str, int] = field(default_factory=dict)  # bytes received per KV path
    kv_wait_s: float = 0.0  # decode time spent waiting for KV to land before step 1
    selected_share: float = 1.0  # share of cached (token, KV head) entries attended to; 1 = dense
    local_share: float = 1.0  # share of the selected entries (layers ≥ 2) that were already on the decode node
    on_demand_wait_s: float = 0.0  # decode time spent waiting on on-demand reads, all steps
    step_local_share: list[float] = field(default_factory=list)  # per decode step (token 2 on)
    step_wait_s: list[float] = field(default_factory=list)  # per decode step: waiting on the network
    # per decode step: the decode worker's torch thread's CPU seconds (its own core's work, whatever else ran there)
    step_cpu_s: list[float] = field(default_factory=list)
    all_local_step: int = -1  # the step after which every entry was local (-1: never, or no remote KV)
    background_declined: bool = False  # path 3 was held back: the rest could not arrive before the request ended
    recompute_reason: str = ""  # failure_policy recompute: why this worker recomputed the prefill ("" = it did not)
    # what the first decode step needed from the link, in bytes on the wire: nothing (colocated), everything the
    # mode pushes (full, quantized), or the metadata, the dense layers and step 1's own selection (selective)
    step1_kv_bytes: int = 0
    step1_compute_s: float = 0.0  # the first decode step's time less its network waits (all-local step time)
    kv_load_s: float = 0.0  # of kv_wait_s, the time building the cache and the remote view once the push had landed
    # step 1 started while the push was still landing (no global barrier), and how long its layers then waited for
    # their own pushed bytes (part of step_wait_s[0]); False: decode waited for the whole push (kv_wait_s)
    started_while_pushing: bool = False
    push_landing_wait_s: float = 0.0
    fetch_reads: int = 0  # on-demand reads a layer issued when it attended (all steps)
    speculative_reads: int = 0  # reads of a layer's predicted selection, issued while the layer before it ran
    ranked_reads: int = 0  # path 3's reads of what a wider selection for the latest query adds (background lane)
    ranked_bytes: int = 0  # their bytes, part of kv_bytes["background"]
    behind_reads: int = 0  # (ablate "stall") reads of selected entries that were not here, nobody waiting on them
    substituted: int = 0  # … the selected entries a step replaced by the best local ones instead of waiting
    logprobs: TokenLogprobs | None = None  # Sampling.logprobs ≥ 0: the token's
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # colocated, token 0 with Sampling.echo
    direct_reads: int = 0  # of fetch_reads, those the torch thread issued on its own link (services/decode/direct_reads.py)


@dataclass(frozen=True, slots=True)
class ResendTokens:
    """Gateway → decode (`decode.<id>.resend`): token events of this request were lost on the way (NATS core is
    at most once: a server that dies takes what it had not delivered). Reply: TokenBacklog."""

    request_id: str
    from_index: int  # the first completion token index the gateway lacks


@dataclass(frozen=True, slots=True)
class TokenBacklog:
    """Decode → gateway: the completion tokens from `from_index` on, as decoded so far, and the stream's last
    event if it has been sent (the decode worker keeps both a while after the request ends)."""

    request_id: str
    from_index: int
    token_ids: list[int]
    final: TokenEvent | None = None


@dataclass(frozen=True, slots=True)
class Abort:
    """Gateway → decode or prefill (`<role>.<id>.abort`): stop work on a request and free its KV."""

    request_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class TransferFailed:
    """Prefill → decode (`decode.<id>.transfer_failed`): a push for this request failed; fail it now."""

    request_id: str
    error: str
