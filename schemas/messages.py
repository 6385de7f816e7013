"""Every message that crosses NATS, as data only. Direction is in each docstring.
(Over 400 lines on purpose: one data-only file for every message, as the wire is read in one place.)

Sizes are tokens unless a field says bytes; times are seconds (monotonic clocks
never cross processes: only durations do, plus wall-clock `*_unix` stamps).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from schemas.constants import DEFAULT_FLOOR, DEFAULT_KV_BUDGET, FAILURE_POLICIES, BudgetFloor, ErrorCode, PlanState

# The transfer modes, their defaults and the plan geometry: schemas/modes.py, schemas/geometry.py.


@dataclass(frozen=True, slots=True)
class PrefillRate:
    """A prefill worker's measured prompt rate at one prompt length (shared/runtime/prefill_rate.py)."""

    tokens: int  # the prompt length measured (a moving average within its length bucket)
    tokens_per_s: float


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """Any service → everyone (heartbeat, every `heartbeat_s`): who I am and how loaded I am."""

    role: str
    worker_id: str
    pid: int
    host: str
    admin_url: str
    version: str
    dataplane_addr: str = ""  # "host:port" of the data-plane listener; "" for services without one
    model: str = ""
    active_requests: int = 0
    kv_pages_free: int = 0
    kv_pages_total: int = 0
    started_unix: float = 0.0
    send_rate_gbps: float = 0.0  # model workers: the rate their data plane achieved while sending; 0 = unknown
    link_gbps: float = 0.0  # model workers: the pacing their data plane is set to (emulated NIC); 0 = unpaced
    plans: list[PlanRegistration] = field(default_factory=list)  # decode: its live transfer plans (for the broker)
    # model workers: the requests they hold (decode: until the stream's last event is out). A gateway back from a
    # NATS reconnect uses it to tell a slow request from one whose reply or tokens were lost meanwhile.
    request_ids: list[str] = field(default_factory=list)
    max_requests: int = 0  # model workers: how many requests they take at once (max_active_requests)
    prefill_rates: list[PrefillRate] = field(default_factory=list)  # prefill: measured rate by prompt length
    draining: bool = False  # stopping (SIGTERM): finishing what it holds, taking nothing new (gateways pick others)


@dataclass(frozen=True, slots=True)
class Discover:
    """Gateway or broker → all services: answer with a heartbeat now (used at start-up)."""

    asker: str


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


@dataclass(frozen=True, slots=True)
class Release:
    """Decode → prefill (`prefill.<id>.release`): every entry is local, or the request is over: free its KV."""

    request_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class KeepLease:
    """Decode → prefill (`prefill.<id>.keep`, published): still reading this request's KV; extend its lease."""

    request_id: str


@dataclass(frozen=True, slots=True)
class OpenPlan:
    """Gateway → broker (`broker.<id>.open`): plan a request's transfer. Reply: TransferPlan."""

    request_id: str
    transfer_mode: str  # as asked (auto allowed)
    model: str
    selector: str
    num_tokens: int  # prompt tokens
    layout: KvLayout
    aux_bytes: int  # the decode node's aux area: metadata (selective modes) or codes (quantized)
    prefill_worker_id: str
    decode_worker_id: str
    ablate: list[str] = field(default_factory=list)  # SMARTGEN_PATHS switched off
    kv_budget: float | None = None  # the request's (None: DEFAULT_KV_BUDGET): sizes smartgen's query-aware push
    floor: BudgetFloor = DEFAULT_FLOOR  # the decode worker's (KvHandle.floor), likewise
    kv_bits: int = 0  # smartgen: the low-bit proactive push (PUSH_KV_BITS) sizes its budget in code bytes


@dataclass(frozen=True, slots=True)
class Progress:
    """Decode → broker (`broker.<id>.progress`) after each decode step. Reply: BackgroundBatch."""

    request_id: str
    step: int
    backlog_blocks: int  # blocks the broker sent earlier that are not local yet
    num_missing: int  # (layer, KV head, token) entries still remote
    wants_background: bool = True  # False: no background batch now (the rest cannot move before the request ends)


@dataclass(frozen=True, slots=True)
class BackgroundBatch:
    """Broker → decode: the next blocks to move on the background lane (flat layer·num_pages + page), most
    important first; empty when the speculative queue is empty or the decode node is still busy."""

    request_id: str
    blocks: list[int]
    remaining: int  # blocks left in the speculative queue after this batch


@dataclass(frozen=True, slots=True)
class PlanEvent:
    """Decode or gateway → broker (`broker.<id>.event`, published): a plan moved to `state`."""

    request_id: str
    state: PlanState
    reason: str = ""


@dataclass(frozen=True, slots=True)
class PlanRegistration:
    """Inside decode heartbeats: a live plan and what is local, so a restarted broker rebuilds its state."""

    plan: TransferPlan
    state: PlanState
    model: str
    selector: str
    prefill_worker_id: str
    decode_worker_id: str
    num_tokens: int
    num_layers: int
    page_tokens: int
    local_blocks: bytes  # bitmap like TransferPlan.push_blocks: blocks wholly on the decode node


@dataclass(frozen=True, slots=True)
class ProfileQuery:
    """Anyone → kvprofile (`kvprofile.<id>.get`): the profile for a request like this. Reply: Profile."""

    model: str
    selector: str
    num_tokens: int


@dataclass(frozen=True, slots=True)
class Profile:
    """KV-profile → requester (and the value stored in the bucket): positional importance I[layer, block].

    `importance` is float32, row-major (num_layers, num_blocks): for relative block b of layer l (tokens
    [b·N/M, (b+1)·N/M) of an N-token prompt), the share of its tokens a selector picked per decode step and
    KV head, averaged over calibration prompts (and, online, over served requests).
    """

    key: str
    model: str
    selector: str
    bucket: int  # prompts of up to this many tokens (and more than the previous bucket)
    version: int
    num_layers: int
    num_blocks: int
    importance: bytes
    source: str  # "calibration" or "online"
    num_prompts: int = 0
    num_updates: int = 0  # online refreshes applied since the build
    updated_unix: float = 0.0


@dataclass(frozen=True, slots=True)
class ProfileInfo:
    """KV-profile → requester, and on `smartgen.profile.updated`: a profile changed (or was deleted)."""

    key: str
    version: int
    source: str
    num_prompts: int = 0
    num_updates: int = 0
    updated_unix: float = 0.0
    deleted: bool = False


@dataclass(frozen=True, slots=True)
class BuildProfile:
    """CLI or admin → kvprofile (`kvprofile.<id>.build`): calibrate a profile. Reply: ProfileInfo."""

    selector: str
    prompt_tokens: int
    num_prompts: int = 4
    decode_steps: int = 16
    kv_budget: float = DEFAULT_KV_BUDGET
    progress_subject: str = ""  # where BuildProgress events go ("" = none)


@dataclass(frozen=True, slots=True)
class BuildProgress:
    """KV-profile → `progress_subject` of a build: prompts done so far."""

    done: int
    total: int
    stage: str


@dataclass(frozen=True, slots=True)
class ProfileKey:
    """Anyone → kvprofile (`kvprofile.<id>.delete`, `kvprofile.<id>.show`): one stored profile."""

    key: str


@dataclass(frozen=True, slots=True)
class SelectionStats:
    """Decode → kvprofile (`smartgen.profile.stats`, published) after a selective request: what it selected.

    `selected` is float32 (num_layers, num_blocks): tokens of each relative block picked, summed over steps
    and KV heads; `offered` is float32 (num_blocks,): steps × KV heads × tokens in the block, the most it
    could have been. selected / offered is the request's own importance.
    """

    model: str
    selector: str
    num_tokens: int
    num_layers: int
    num_blocks: int
    selected: bytes
    offered: bytes


@dataclass(frozen=True, slots=True)
class Ack:
    """Any → any: a request that needs no payload in its reply was done."""

    ok: bool = True


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """Any service → requester: the request was refused or failed. Sent with nats.micro error headers too."""

    code: ErrorCode
    message: str


@dataclass(frozen=True, slots=True)
class ListQuery:
    """Anyone → broker or kvprofile (`<role>.<id>.workers`, `kvprofile.<id>.list`): what do you hold?"""

    prefix: str = ""


@dataclass(frozen=True, slots=True)
class WorkerList:
    """Broker → requester: the workers it knows from heartbeats."""

    workers: list[WorkerInfo]


@dataclass(frozen=True, slots=True)
class ProfileList:
    """KV-profile → requester: the stored profile keys and the bucket that holds them."""

    bucket: str
    keys: list[str]


@dataclass(frozen=True, slots=True)
class RdmaEndpoint:
    """RDMA data plane ↔ its peer (`dataplane.<worker_id>.connect`): one side's queue pair and region,
    offered in the request and answered in the reply, to bring both RC queue pairs to RTS."""

    address: str  # the sender's data-plane address ("rdma:<worker_id>")
    qpn: int  # queue pair number
    psn: int  # initial packet sequence number (24 bits)
    gid: str  # RoCE v2 GID, fully written out
    addr: int  # virtual address of the registered region
    rkey: int  # remote key of the region
    length: int  # bytes in the region
