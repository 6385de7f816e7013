"""SmartGen's transfer modes through the real stack on a paced link: transfer never changes tokens, nothing
is left behind, selective transfer beats full transfer on TTST, and profiles live in JetStream."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import nats
import pytest

from schemas import BuildProfile, Profile, ProfileInfo, ProfileKey, ProfileQuery, subjects
from tools.nats_server import free_port
from shared.runtime.rpc import RemoteError, call
from tools.client import wait_for_broker_pacing
from tools.stack import Stack, StackSpec, started_stack
from tests.integration.conftest import NO_FLOOR_ENV, assert_no_leaks, get_json, list_workers, post_json

# ~600 tokens: 8 layers × 2 KV heads × 16 dims × fp32 × K,V = 2 KiB per token, 1.2 MB of KV; on a 4 Mbit/s link
# a full transfer takes ~2.4 s, ~50× the tiny model's prefill, so most of what decoding selects starts remote.
PROMPT = "The history of the city begins with a small settlement on the river, where traders met. " * 33
LINK_GBPS = 0.004
# exact KV on every path (kv_bits 0; smartgen's default moves K8V8 codes): tokens equal colocated's, bit for bit
SMARTGEN_RUNS = [{"transfer_mode": "smartgen", "kv_bits": 0}, {"transfer_mode": "smartgen", "kv_bits": 0, "ablate": ["proactive"]},
                 {"transfer_mode": "smartgen", "kv_bits": 0, "ablate": ["parallel"]},
                 {"transfer_mode": "smartgen", "kv_bits": 0, "ablate": ["background"]}, {"transfer_mode": "partial"},
                 {"transfer_mode": "smartgen", "kv_bits": 0, "ablate": ["direct"]}]


@pytest.fixture(scope="module")
def paced(tmp_path_factory: pytest.TempPathFactory, tiny8_model_path: Path):
    """The whole stack on a tiny 8-layer model, every data-plane link paced to 4 Mbit/s."""
    model = tiny8_model_path
    log_file = tmp_path_factory.mktemp("logs") / "paced.log"
    spec = StackSpec(model=str(model), gateway_port=free_port(), log_file=log_file,
                     env={"SMARTGEN_KV_CACHE_MB": "64", "SMARTGEN_TORCH_THREADS": "1", **NO_FLOOR_ENV,
                          "SMARTGEN_FAULT_INJECTION": "1",  # POST /fault (delay): a push that lands late
                          "SMARTGEN_LINK_GBPS": str(LINK_GBPS),
                          # path 3 whenever planned, though 16 tokens cannot wait for the rest on this link (the
                          # default declines it then: test_background_policy.py)
                          "SMARTGEN_BACKGROUND_IF_IT_CAN_FINISH": "false",
                          # the exact push may hold back any selective layer (by default only the last third)
                          "SMARTGEN_EXACT_FROM_SHARE": "0",
                          # these tests compare modes on one prompt: full must move all of its KV every time, and
                          # the links are paced against the whole prompt's prefill, which a prefill cache hit would
                          # all but skip (the plan would then size the push for that: routing.py)
                          "SMARTGEN_DECODE_PREFIX_CACHE_MB": "0", "SMARTGEN_PREFIX_CACHE_MB": "0"})
    with started_stack(spec, 180) as running:
        running.log_path = log_file  # type: ignore[attr-defined]
        yield running
        assert not running.dead(), f"services died: {running.dead()}"


def complete(stack: Stack, **body) -> dict:
    status, reply = post_json(stack.gateway_url + "/v1/completions",
                              {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, **body}, timeout=120)
    assert status == 200, reply
    return {**reply["smartgen"], "id": reply["id"]}


@contextmanager
def paced_to_ratio(stack: Stack, ratio: float) -> Iterator[None]:
    """Inside: the prefill's link paced so that the whole KV takes `ratio` × the prefill's own time (measured on
    PROMPT first), then back to LINK_GBPS."""
    from tests.integration.fault_helpers import admin_post, worker

    prefill = worker(stack, "prefill")
    complete(stack, transfer_mode="full")  # so the prefill has measured its rate on this prompt
    rate = get_json(prefill["admin_url"] + "/stats")["prefill_tokens_per_s"]
    kv_bits_per_token = 8 * 2 * 2 * 16 * 2 * 8  # 8 layers × K,V × 2 KV heads × 16 dims × bf16, in bits
    gbps = kv_bits_per_token * rate / ratio / 1e9
    admin_post(stack, prefill, "/link", {"gbps": gbps})
    wait_for_broker_pacing(stack.gateway_url, gbps, stack.admin_token)
    try:
        yield
    finally:
        admin_post(stack, prefill, "/link", {"gbps": LINK_GBPS})
        wait_for_broker_pacing(stack.gateway_url, LINK_GBPS, stack.admin_token)


@pytest.mark.parametrize("selector", ["quest", "oracle"])
def test_transfer_never_changes_tokens(paced, selector):
    """For a fixed selector and budget, every combination of SmartGen's paths (and the partial baseline)
    decodes exactly the tokens of the same selector with all KV local, while most reads start remote. Path 2's
    reads go on the torch thread's own link (once it is open: from the second request on, every one of them),
    except where a request ablates it."""
    reference = complete(paced, transfer_mode="colocated", selector=selector, kv_budget=0.1)
    for number, run in enumerate(SMARTGEN_RUNS):
        sg = complete(paced, selector=selector, kv_budget=0.1, **run)
        assert sg["token_ids"] == reference["token_ids"], run
        assert sg["transfer_mode"] == run["transfer_mode"] and sg["attention"] == "selective"
        assert sg["kv_bytes"]["on_demand"] > 0, run  # the check is not vacuous: entries were read remotely
        assert min(sg["step_local_share"]) < 1.0, run  # (step 1 may find all local: the exact push)
        reads = sg["reads"]
        if "direct" in run.get("ablate", []):
            assert reads["direct"] == 0 and reads["fetch"] > 0, run
        elif number:
            assert reads["direct"] == reads["fetch"] > 0, run
    assert_no_leaks(paced)


def test_paths_show_in_the_bytes_and_the_ablations(paced):
    """Metadata and layers 0–1 go ahead; without the proactive path only metadata does; without background
    nothing moves on that lane; background raises the share of selected entries already local."""
    full = complete(paced, transfer_mode="smartgen")
    assert full["kv_bytes"]["metadata"] > 0 and full["kv_bytes"]["proactive"] > 0 and full["kv_bytes"]["background"] > 0
    assert full["plan"]["profile_source"] in ("positional", "calibration", "online") and full["plan"]["background"]
    no_push = complete(paced, transfer_mode="smartgen", ablate=["proactive"])
    assert no_push["kv_bytes"]["proactive"] == 0 and no_push["plan"]["num_push_blocks"] == 0
    no_bg = complete(paced, transfer_mode="smartgen", ablate=["background"])
    assert no_bg["kv_bytes"]["background"] == 0 and not no_bg["plan"]["background"]
    assert full["step_local_share"][-1] >= no_bg["step_local_share"][-1]
    assert_no_leaks(paced)


def test_smartgen_ttst_beats_full_on_a_paced_link(paced):
    """Same prompt, same run: selective transfer's stall between tokens 1 and 2 is well under full transfer's
    (which waits for the whole KV), and auto picks smartgen here, saying why."""
    full = complete(paced, transfer_mode="full")
    smart = complete(paced, transfer_mode="smartgen")
    assert smart["ttst_s"] < 0.6 * full["ttst_s"], (smart["ttst_s"], full["ttst_s"])
    auto = complete(paced, transfer_mode="auto")
    assert auto["transfer_mode"] == "smartgen" and auto["requested_mode"] == "auto"
    assert "full transfer would stall" in auto["plan"]["reason"]
    quantized = complete(paced, transfer_mode="quantized", kv_bits=2)
    # 2-bit codes of 16-bit KV are 1/8 of full; the tiny model's 16-wide partitions add as much again in fp16
    # scales and minima (4 bytes each), and the sinks stay in 16 bits: about 1/4.7 here (1/6 at SmolLM2's 64)
    assert 0 < quantized["kv_bytes"]["quantized"] < full["kv_bytes"]["full"] / 4
    assert_no_leaks(paced)


def test_the_query_tail_goes_past_the_prefill_where_nothing_fits_in_time(paced):
    """At R = 8 layers 0–1 alone (2 of 8 layers) take longer than the prefill, so not even one layer's
    query-aware push would land by the prefill's end, and step 1 would read those entries on demand anyway: the
    prefill still pushes step 1's budget by its last query in every layer ≥ 2 (the query tail), after the
    prefill's end, and decoding waits for exactly those bytes. They are the only proactive bytes beyond layers
    0–1 (K and V of 16 bf16 channels: 64 bytes an entry), and the tokens stay those of all-local selective
    attention."""
    body = dict(selector="quest", kv_budget=0.1)
    reference = complete(paced, transfer_mode="colocated", **body)
    with paced_to_ratio(paced, 8.0):
        tail = complete(paced, transfer_mode="smartgen", kv_bits=0, ablate=["background"], **body)
        dense_only = complete(paced, transfer_mode="smartgen", kv_bits=0, ablate=["background", "query"], **body)
    plan = tail["plan"]
    assert plan["query_stop_layer"] == 2 and plan["query_tokens"] == plan["query_tail_tokens"] > 0, plan
    assert "from layer 2 on whether or not in time" in plan["reason"]
    assert dense_only["plan"]["query_tail_tokens"] == 0 and dense_only["plan"]["num_push_blocks"] == plan["num_push_blocks"]
    # up to tail tokens per KV head of 6 selective layers × 2 KV heads (Quest selects whole pages, so the budget
    # rounds down to them)
    entry_bytes = tail["kv_bytes"]["proactive"] - dense_only["kv_bytes"]["proactive"]
    assert entry_bytes % 64 == 0 and 0.5 * 6 * 2 * plan["query_tail_tokens"] <= entry_bytes // 64 <= 6 * 2 * plan["query_tail_tokens"]
    assert tail["token_ids"] == dense_only["token_ids"] == reference["token_ids"]
    assert_no_leaks(paced)


def test_where_the_push_leaves_after_the_prefill_it_carries_step_ones_exact_selection(paced):
    """At R = 30 the pushes leave long after the prefill's end. A layer whose push, by the bytes queued before it,
    would leave only after the prefill's end is held back, and every later one (`exact_from_layer`); the prefill
    node then runs step 1 itself (the same step over the same bytes as the decode node will) and those layers
    push its exact selection instead of the last prompt query's picks: step 1 then finds all of its selection
    there local (here: every selective layer), where the last query's picks (`ablate: ["exact"]`) leave part of it
    remote, and the tokens stay all-local selective attention's."""
    body = dict(selector="quest", kv_budget=0.1)
    reference = complete(paced, transfer_mode="colocated", **body)
    with paced_to_ratio(paced, 30.0):
        exact = complete(paced, transfer_mode="smartgen", kv_bits=0, ablate=["background"], **body)
        last_query = complete(paced, transfer_mode="smartgen", kv_bits=0, ablate=["background", "exact"], **body)
    # every selective layer's push would leave after the prefill here, so every one carries step 1's exact selection
    assert exact["plan"]["exact_push"] and not last_query["plan"]["exact_push"]
    assert exact["plan"]["exact_from_layer"] == 2 and last_query["plan"]["exact_from_layer"] == 0, exact["plan"]
    # … and the decode node's step 1 selects exactly what the prefill node's did: all of it is local
    assert exact["step_local_share"][0] == 1.0 > last_query["step_local_share"][0], last_query["step_local_share"][:2]
    assert exact["token_ids"] == last_query["token_ids"] == reference["token_ids"]
    assert_no_leaks(paced)


def test_a_low_bit_push_carries_more_of_step_one_in_fewer_bytes(paced):
    """kv_bits on smartgen: what the prefill pushes travels as one record of codes per entry (tiny model: K and V
    of 16 bf16 channels are 64 bytes, 32 with 4-bit values and 8-bit keys), so on a link where the exact push has room for part of
    what step 1 selects (R ≈ 2), the low-bit push carries all of it; the on-demand reads move records too (40
    bytes an entry at 8 bits, not 64); the bytes are counted as records; a width other than 4 or 8 is refused."""
    with paced_to_ratio(paced, 2.0):
        body = dict(transfer_mode="smartgen", selector="quest", kv_budget=0.1, ablate=["background"])
        exact, low, eight = complete(paced, **body, kv_bits=0), complete(paced, **body, kv_bits=4), complete(paced, **body)
    assert low["kv_bits"] == 4 and "4-bit push" in low["plan"]["reason"] and exact["kv_bits"] is None
    assert eight["kv_bits"] == 8  # smartgen's default
    assert exact["plan"]["query_tokens"] < low["plan"]["query_tokens"], (exact["plan"], low["plan"])
    assert low["kv_bytes"]["proactive"] % 32 == 0 and eight["kv_bytes"]["proactive"] % 40 == 0
    assert low["kv_bytes"]["on_demand"] % 32 == 0 and eight["kv_bytes"]["on_demand"] % 40 == 0
    assert low["kv_bytes"]["on_demand"] > 0 and eight["kv_bytes"]["on_demand"] > 0  # (tests/unit/test_remote_kv.py
    # holds that these are exactly the records read)
    assert low["kv_bytes"]["proactive"] // 32 > exact["kv_bytes"]["proactive"] // 64  # more entries pushed
    assert low["kv_bytes"]["metadata"] == exact["kv_bytes"]["metadata"]  # the codes region's room does not move
    assert low["step_local_share"][0] > exact["step_local_share"][0]
    assert len(low["token_ids"]) == 16 and len(eight["token_ids"]) == 16
    status, reply = post_json(paced.gateway_url + "/v1/completions",
                              {"prompt": "hi", "max_tokens": 2, "transfer_mode": "smartgen", "kv_bits": 2}, timeout=30)
    assert status == 400 and reply["error"]["param"] == "kv_bits"
    assert_no_leaks(paced)


def test_auto_with_kv_bits_runs_quantized_or_a_low_bit_push_as_the_link_allows(paced):
    """auto with kv_bits 4 (the client's consent to low-bit KV): where the 4-bit codes fit behind the prefill
    (R = 2: about a third of the 16-bit KV here) the broker runs quantized transfer; where they do not (R = 6.5),
    smartgen with a 4-bit push. Each decodes the tokens of the same mode asked for by name, the decode worker
    waits for exactly what the chosen mode fills of auto's larger reservation, and the response says what ran."""
    selective = dict(selector="quest", kv_budget=0.1)
    with paced_to_ratio(paced, 2.0):
        auto = complete(paced, transfer_mode="auto", kv_bits=4, **selective)
        named = complete(paced, transfer_mode="quantized", kv_bits=4)
    assert (auto["transfer_mode"], auto["requested_mode"], auto["kv_bits"]) == ("quantized", "auto", 4)
    assert "4-bit codes" in auto["plan"]["reason"] and auto["attention"] == "dense", auto["plan"]
    assert auto["token_ids"] == named["token_ids"] and auto["kv_bytes"] == named["kv_bytes"]
    with paced_to_ratio(paced, 6.5):
        auto = complete(paced, transfer_mode="auto", kv_bits=4, ablate=["background"], **selective)
        named = complete(paced, transfer_mode="smartgen", kv_bits=4, ablate=["background"], **selective)
    assert (auto["transfer_mode"], auto["kv_bits"]) == ("smartgen", 4) and "4-bit push" in auto["plan"]["reason"]
    assert auto["token_ids"] == named["token_ids"]
    assert auto["kv_bytes"]["metadata"] == named["kv_bytes"]["metadata"] > 0
    exact = complete(paced, transfer_mode="auto", **selective)  # no consent: never lossy, whatever the link
    assert exact["transfer_mode"] == "smartgen" and exact["kv_bits"] is None
    status, reply = post_json(paced.gateway_url + "/v1/completions",
                              {"prompt": "hi", "max_tokens": 2, "transfer_mode": "auto", "kv_bits": 2}, timeout=30)
    assert status == 400 and reply["error"]["param"] == "kv_bits"
    assert_no_leaks(paced)


def test_quantized_dequantizes_each_layer_as_it_lands(paced):
    """quantized: where the codes are still landing when the decode worker gets the request (R = 8: 4-bit codes
    take about twice the prefill), each layer is dequantized on the torch thread as soon as it has landed, so most
    are ready by the last byte; the tokens are those of the same request whose codes had all landed first."""
    body = dict(transfer_mode="quantized", kv_bits=4)
    whole = complete(paced, **body)
    with paced_to_ratio(paced, 8.0):
        layered = complete(paced, **body)
    assert layered["token_ids"] == whole["token_ids"]
    lines = [json.loads(line) for line in paced.spec.log_file.read_text().splitlines() if "codes_dequantized" in line]
    ours = [x for x in lines if x.get("request_id") == layered["id"]]
    assert ours and 1 <= ours[0]["layers_ready_at_last_byte"] <= ours[0]["layers"] == 8, ours
    assert_no_leaks(paced)


def test_step_one_starts_while_the_push_lands_and_decodes_the_same_tokens(paced):
    """No global push barrier: with every frame of the prefill's push held 30 ms (its reads are not), the push
    lands long after decode has the request. Step 1 starts at once, each layer waiting for its own bytes only,
    and decodes the tokens of all-local selective attention, as does the same request that waits for the whole
    push first (`ablate: early`)."""
    from tests.integration.fault_helpers import admin_post, worker

    selective = dict(selector="quest", kv_budget=0.1, ablate=["background"])
    reference = complete(paced, transfer_mode="colocated", selector="quest", kv_budget=0.1)
    prefill = worker(paced, "prefill")
    admin_post(paced, prefill, "/fault", {"kind": "delay", "delay_s": 0.03, "lanes": ["push"]})
    try:
        early = complete(paced, transfer_mode="smartgen", kv_bits=0, **selective)
        barrier = complete(paced, transfer_mode="smartgen", kv_bits=0, **{**selective, "ablate": ["background", "early"]})
    finally:
        admin_post(paced, prefill, "/fault", {"kind": "clear"})
    brief = {k: v for k, v in early.items() if k not in ("token_ids", "token_times_s", "plan")}
    assert early["started_while_pushing"] and early["push_landing_wait_s"] > 0.03, brief
    assert early["kv_wait_s"] < barrier["kv_wait_s"], (early["kv_wait_s"], barrier["kv_wait_s"])
    assert not barrier["started_while_pushing"] and barrier["push_landing_wait_s"] == 0
    assert early["token_ids"] == barrier["token_ids"] == reference["token_ids"]
    assert early["kv_bytes"]["metadata"] == barrier["kv_bytes"]["metadata"] > 0
    assert_no_leaks(paced)


def test_every_entry_ends_local_or_released(paced):
    """A long enough decode with background transfer ends all local (the prefill's lease released early);
    the broker's plan went through its states in order and nothing is left open."""
    sg = complete(paced, transfer_mode="smartgen", max_tokens=160)
    assert sg["all_local_step"] is not None and sg["all_local_step"] < 160
    # a share is recorded for each step (tokens 1..all_local_step) while entries may be remote, and none after;
    # the last may be < 1: the step whose reads brought the last missing entries is the one that ends it
    assert len(sg["step_local_share"]) == sg["all_local_step"], (len(sg["step_local_share"]), sg["all_local_step"])
    broker = next(w for w in list_workers(paced.gateway_url, paced.admin_token) if w["role"] == "broker")
    recent = {p["request_id"]: p for p in get_json(broker["admin_url"] + "/transfers")["recent"]}
    states = [t["state"] for t in recent[sg["id"]]["transitions"]]
    assert states == ["opening", "transferring", "all_local", "released"]
    assert_no_leaks(paced)


async def _profiles(stack: Stack) -> tuple[ProfileInfo, Profile]:
    nc = await nats.connect(**stack.nats_options())
    try:
        info = await call(nc, subjects.worker("kvprofile", "kvprofile-0", "build"),
                          BuildProfile("quest", 600, num_prompts=1, decode_steps=4), ProfileInfo, 120)
        decode_model = next(w for w in list_workers(stack.gateway_url, stack.admin_token) if w["role"] == "decode")
        model = Path(get_json(decode_model["admin_url"] + "/stats")["model"]).name
        return info, await call(nc, subjects.worker("kvprofile", "kvprofile-0", "get"), ProfileQuery(model, "quest", 600),
                                Profile, 5)
    finally:
        await nc.close()


async def _get(stack: Stack, key: str, wait_s: float = 30.0) -> Profile:
    """The stored profile, asking until a kvprofile worker answers (it may be restarting)."""
    nc = await nats.connect(**stack.nats_options())
    try:
        for _ in range(int(wait_s / 0.2)):
            try:
                return await call(nc, subjects.worker("kvprofile", "kvprofile-0", "show"), ProfileKey(key), Profile, 5)
            except RemoteError as exc:
                if exc.code != "unavailable":
                    raise
                await asyncio.sleep(0.2)
        raise TimeoutError("no kvprofile worker answered")
    finally:
        await nc.close()


def test_profiles_survive_a_kvprofile_restart_and_are_used(paced):
    """A built profile is in JetStream: it outlives the kvprofile process, the broker orders blocks by it,
    and a served request refreshes it online (a new version)."""
    info, profile = asyncio.run(_profiles(paced))
    assert profile.key == info.key and profile.source == "calibration" and profile.version == info.version
    paced.restart("kvprofile")
    again = asyncio.run(_get(paced, info.key))
    assert again.version == info.version and again.importance == profile.importance
    sg = complete(paced, transfer_mode="smartgen", selector="quest")
    assert sg["plan"]["profile"] == info.key and sg["plan"]["profile_source"] == "calibration"
    for _ in range(50):  # the decode worker's selection statistics arrive asynchronously
        latest = asyncio.run(_get(paced, info.key))
        if latest.num_updates > again.num_updates:
            break
        time.sleep(0.1)
    assert latest.version > again.version and latest.num_updates == again.num_updates + 1
    assert_no_leaks(paced)


def test_missing_profile_degrades_to_positional(paced):
    """A selector with no stored profile still serves: the plan falls back to the positional profile and the
    broker says so in its log."""
    sg = complete(paced, transfer_mode="smartgen", selector="hata_untrained")
    assert sg["plan"]["profile_source"] == "positional" and sg["plan"]["profile_version"] == 0
    log = paced.log_path.read_text()  # type: ignore[attr-defined]
    assert '"event": "profile_missing"' in log and ".hata_untrained." in log
    assert_no_leaks(paced)


def broker_info(stack: Stack) -> dict:
    return next(w for w in list_workers(stack.gateway_url, stack.admin_token) if w["role"] == "broker")


def test_a_restarted_broker_rebuilds_live_plans_from_heartbeats(paced):
    """Restart the broker while a smartgen request decodes: the new broker learns the plan from the decode
    worker's heartbeats (state and what is local), keeps feeding the background lane, and the request ends
    normally with nothing left open."""
    from concurrent.futures import ThreadPoolExecutor

    before = broker_info(paced)["admin_url"]
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(complete, paced, transfer_mode="smartgen", max_tokens=600)
        for _ in range(400):  # until it decodes (not while the plan is still opening: the prefill pushing)
            live = get_json(before + "/transfers")["live"]
            if live and live[0]["state"] in ("transferring", "all_local"):
                break
            time.sleep(0.05)
        paced.restart("broker")
        restored = None
        for _ in range(200):
            url = broker_info(paced)["admin_url"]
            if url != before:
                live = get_json(url + "/transfers")["live"]
                if live:
                    restored = live[0]
                    break
            time.sleep(0.05)
        sg = running.result(120)
    assert restored is not None, "the restarted broker never showed the live plan"
    assert restored["reason"] == "restored from a decode heartbeat" and restored["state"] in ("transferring", "all_local")
    assert len(sg["token_ids"]) == 600
    recent = get_json(broker_info(paced)["admin_url"] + "/transfers")["recent"]
    assert any(p["request_id"] == sg["id"] and p["state"] == "released" for p in recent)
    assert_no_leaks(paced)


def test_the_query_aware_push_is_exact_and_counted(paced):
    """On a link where the prompt's selection fits behind the prefill (R ≈ 1.2), the prefill also pushes the
    entries its own last-position query selects: the plan says how many per KV head, they arrive as proactive
    bytes before step 1 (decode waits for exactly what was pushed), and the tokens stay those of all-local
    selective attention. (Whether step 1 finds them useful depends on real attention: test_real_model.py.)"""
    # R ≈ 1.2: layers 0–1 (25% of the KV) fit behind the prefill with room for the query-aware push, even if the
    # prefill runs twice as fast or slow as it just did
    with paced_to_ratio(paced, 1.2):
        reference = complete(paced, transfer_mode="colocated", selector="quest", kv_budget=0.1)
        by_query = complete(paced, transfer_mode="smartgen", kv_bits=0, selector="quest", kv_budget=0.1, ablate=["background"])
        by_profile = complete(paced, transfer_mode="smartgen", kv_bits=0, selector="quest", kv_budget=0.1,
                              ablate=["background", "query"])
    assert by_query["token_ids"] == by_profile["token_ids"] == reference["token_ids"]
    assert by_query["plan"]["query_tokens"] > 0 and by_profile["plan"]["query_tokens"] == 0
    # the last layer(s) push step 1's budget by query, after the prefill's end
    assert by_query["plan"]["query_stop_layer"] > 2 and by_query["plan"]["query_tail_tokens"] > 0
    assert by_query["kv_bytes"]["proactive"] > 0 and by_query["step_local_share"][0] > 0
    assert_no_leaks(paced)
