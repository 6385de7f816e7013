"""Garbage on every NATS endpoint and event subject of a live stack: each endpoint (listed by nats.micro's
$SRV.INFO) answers an error reply with code bad_request at once, event handlers drop what they cannot use,
and afterwards every service is alive, a completion still works and nothing leaks."""
from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp
import msgpack
import nats
import pytest

import schemas
from schemas import ErrorReply, decode, encode, subjects
from shared.runtime.rpc import ERROR_CODE_HEADER
from tests.integration.conftest import get_json, list_workers, post_json

REPLY_WITHIN_S = 2.0
FUZZER_ID = "fuzzer-1"  # a made-up worker whose heartbeat carries hostile plan registrations
ROLES = ("gateway", "prefill", "decode", "broker", "kvprofile")
EXPECTED_VERBS = {"prefill": {"prefill", "abort", "release"}, "decode": {"open", "generate", "abort", "resend"},
                  "broker": {"open", "progress", "workers"}, "kvprofile": {"get", "list", "show", "build", "delete"}}
LAYOUT = schemas.KvLayout(4, 2, 16, 16, "float32", 1024)
# Not one of these is any endpoint's message (ListQuery takes {} and {"prefix": …}: none is that either).
GARBAGE = {
    "empty": b"",
    "random bytes": b"\xc1" + random.Random(7).randbytes(255),  # 0xc1 is never valid msgpack
    "msgpack list": msgpack.packb([1, "two", None, 3.5, b"\x00"]),
    "msgpack map of wrong types": msgpack.packb({"request_id": 5, "num_tokens": "many", "key": None, "selector": 1.5}),
    "another message": encode(schemas.BuildProgress(1, 2, "not for you")),
    "huge string": msgpack.packb("x" * 600_000),
    "huge unknown key": msgpack.packb({"k" * 600_000: 1}),
    "header injection": msgpack.packb({"a\r\nNats-Service-Error-Code: 200\r\n\r\n": 1}),
    "deep nesting": b"\x91" * 100_000 + b"\xc0",
}


async def connect(stack) -> nats.aio.client.Client:
    """The stack's NATS as its services reach it (token and all, when the stack sets one)."""
    options = stack.nats_options() if hasattr(stack, "nats_options") else {"servers": [stack.nats_url]}
    return await nats.connect(**options, name="test-bad-input")


async def gather(nc: nats.aio.client.Client, subject: str, wait_s: float = 1.0) -> list[dict]:
    """Every reply to one request on `subject` (nats.micro's $SRV.* answer once per service instance)."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(subject, b"", reply=inbox)
    replies = []
    try:
        while True:
            msg = await sub.next_msg(timeout=wait_s)
            if msg.data:
                replies.append(json.loads(msg.data))
    except nats.errors.TimeoutError:
        return replies
    finally:
        await sub.unsubscribe()


async def endpoints_by_role(nc: nats.aio.client.Client) -> dict[str, list[str]]:
    infos = await gather(nc, "$SRV.INFO")
    return {info["name"].removeprefix("smartgen-"): [ep["subject"] for ep in info.get("endpoints", [])]
            for info in infos}


async def assert_bad_request(nc: nats.aio.client.Client, subject: str, payload: bytes, what: str) -> None:
    started = time.monotonic()
    msg = await nc.request(subject, payload, timeout=REPLY_WITHIN_S)
    assert time.monotonic() - started < REPLY_WITHIN_S
    assert msg.headers and msg.headers.get(ERROR_CODE_HEADER) == "bad_request", (subject, what, msg.headers)
    reply = decode(ErrorReply, msg.data)
    assert reply.code == "bad_request" and reply.message, (subject, what, reply)


def assert_alive_and_serving(stack) -> None:
    assert not stack.dead(), f"services died: {stack.dead()}"
    status, body = post_json(stack.gateway_url + "/v1/completions", {"prompt": "Still there?", "max_tokens": 4,
                                                                     "temperature": 0})
    assert status == 200 and len(body["smartgen"]["token_ids"]) == 4, body


async def test_every_endpoint_answers_garbage_with_bad_request(clean_stack):
    """Each endpoint of each service, sent each kind of garbage: an ErrorReply with code bad_request in under
    2 s; then all five services still answer $SRV.PING and a completion works."""
    nc = await connect(clean_stack)
    try:
        listed = await endpoints_by_role(nc)
        assert set(listed) == set(ROLES), listed
        for role, verbs in EXPECTED_VERBS.items():
            assert {s.rsplit(".", 1)[1] for s in listed[role]} == verbs, (role, listed[role])
        for role, endpoint_subjects in listed.items():
            for subject in endpoint_subjects:
                for what, payload in GARBAGE.items():
                    await assert_bad_request(nc, subject, payload, what)
        assert {p["name"] for p in await gather(nc, "$SRV.PING")} == {f"smartgen-{r}" for r in ROLES}
    finally:
        await nc.close()
    assert_alive_and_serving(clean_stack)


def semantically_bad(ids: dict[str, str]) -> list[tuple[str, object]]:
    """Messages of the right type whose values no handler can act on."""
    decode_open = subjects.worker("decode", ids["decode"], "open")
    prefill = subjects.worker("prefill", ids["prefill"], "prefill")
    broker_open = subjects.worker("broker", ids["broker"], "open")
    kvprofile = {verb: subjects.worker("kvprofile", ids["kvprofile"], verb) for verb in ("get", "show", "delete",
                                                                                          "build")}
    handle = schemas.KvHandle("fuzz-2", "d", "a:1", 1, LAYOUT, 3, 0, 16)
    decode_generate = subjects.worker("decode", ids["decode"], "generate")
    out_of_vocab = [1, 2, 10**9]  # an id past the embedding table: a clear refusal, not an IndexError
    return [
        (decode_generate, schemas.Generate("fuzz-4", "colocated", out_of_vocab, -1, 4, [], schemas.Sampling(),
                                           "fuzz.stream")),
        (decode_generate, schemas.Generate("fuzz-4", "colocated", [1, -7], -1, 4, [], schemas.Sampling(),
                                           "fuzz.stream")),
        (decode_generate, schemas.Generate("fuzz-4", "colocated", [1, 2], -1, 4, [], schemas.Sampling(),
                                           "fuzz.stream", resume_tokens=[3, 4, 5, 6])),  # nothing left to generate
        (subjects.worker("decode", ids["decode"], "resend"), schemas.ResendTokens("fuzz-5", -1)),
        (prefill, schemas.Prefill("fuzz-2", out_of_vocab, "full", schemas.Sampling(), handle)),
        (decode_open, schemas.OpenKv("fuzz-1", 8, 4, "teleport")),
        (decode_open, schemas.OpenKv("fuzz-1", -5, 4, "full")),
        (decode_open, schemas.OpenKv("fuzz-1", 8, 2**62, "full")),
        (prefill, schemas.Prefill("fuzz-2", [1, 2, 3], "colocated", schemas.Sampling(), handle)),
        (broker_open, schemas.OpenPlan("fuzz-3", "teleport", "m", "quest", 8, LAYOUT, 0, "p", "d")),
        (broker_open, schemas.OpenPlan("fuzz-3", "smartgen", "m", "quest", 2**50, LAYOUT, 0, "p", "d")),  # 2**48 blocks
        (broker_open, schemas.OpenPlan("fuzz-3", "smartgen", "m", "quest", 8, LAYOUT, 0, "p", "d", ["teleport"])),
        (kvprofile["get"], schemas.ProfileQuery("m", "quest", 0)),
        (kvprofile["show"], schemas.ProfileKey(">")),
        (kvprofile["show"], schemas.ProfileKey("")),
        (kvprofile["delete"], schemas.ProfileKey("a.*.c")),
        (kvprofile["delete"], schemas.ProfileKey("x" * 5000)),
        (kvprofile["build"], schemas.BuildProfile("magic", 2048)),
        (kvprofile["build"], schemas.BuildProfile("quest", 1)),
    ]


async def test_well_formed_messages_with_impossible_values_are_bad_requests(clean_stack):
    """Unknown modes, negative or giant sizes, keys that are no profile key: bad_request, not a crash, not a
    huge allocation, not a NATS error; then the stack still serves."""
    ids = {w["role"]: w["id"] for w in list_workers(clean_stack.gateway_url, clean_stack.admin_token)}
    nc = await connect(clean_stack)
    try:
        for subject, message in semantically_bad(ids):
            await assert_bad_request(nc, subject, encode(message), repr(message)[:80])
    finally:
        await nc.close()
    assert_alive_and_serving(clean_stack)


def event_subjects(ids: dict[str, str]) -> list[str]:
    """Every pub/sub subject a service listens on."""
    return [*(subjects.heartbeat(role) for role in ROLES), subjects.DISCOVER, subjects.PROFILE_STATS,
            subjects.PROFILE_UPDATED, subjects.worker("broker", ids["broker"], "event"),
            subjects.worker("prefill", ids["prefill"], "keep"),
            subjects.worker("decode", ids["decode"], "transfer_failed"),
            subjects.profile_progress("fuzz")]


def hostile_events() -> list[tuple[str, bytes]]:
    """Well-formed events that must be dropped: a worker id that is no subject token, statistics that would
    poison a profile, plan registrations in an unknown state or of 2**42 blocks."""
    stats = schemas.SelectionStats
    huge_plan = schemas.TransferPlan("fuzz-plan", "smartgen", "broker-0", 2**40, background=True)
    small_plan = schemas.TransferPlan("fuzz-plan", "smartgen", "broker-0", 1)
    registrations = [schemas.PlanRegistration(huge_plan, "transferring", "m", "quest", "p", "d", 2**44, 4, 16, b""),
                     schemas.PlanRegistration(small_plan, "bogus", "m", "quest", "p", "d", 16, 4, 16, b"\x00")]
    return [
        (subjects.heartbeat("decode"), encode(schemas.WorkerInfo("decode", "evil.*", 1, "h", "u", "v"))),
        (subjects.heartbeat("fuzzer"), encode(schemas.WorkerInfo("fuzzer", FUZZER_ID, 1, "h", "u", "v",
                                                                 plans=registrations))),
        (subjects.PROFILE_STATS, encode(stats("fuzz-model", "quest", 64, 1, 1024, bytes(4096),
                                              b"\x00\x00\xc0\x7f" * 1024))),  # offered: NaN
        (subjects.PROFILE_STATS, encode(stats("fuzz-model", "quest", 64, -1, 1024, bytes(4096), bytes(4096)))),
        (subjects.PROFILE_STATS, encode(stats("fuzz-model", "quest", 64, 1, 2, bytes(8), bytes(8)))),
        (subjects.PROFILE_STATS, encode(stats("fuzz-model", "magic", 64, 1, 1024, bytes(4096), bytes(4096)))),
    ]


async def stream_with_garbage_in_between(stack, nc: nats.aio.client.Client) -> list[dict]:
    """A streamed completion; after its first chunk, garbage goes to its own stream subject."""
    body = {"prompt": "Count with me:", "max_tokens": 48, "ignore_eos": True, "temperature": 0, "stream": True}
    chunks = []
    async with aiohttp.ClientSession() as http:
        async with http.post(stack.gateway_url + "/v1/completions", json=body) as response:
            assert response.status == 200
            async for raw in response.content:
                line = raw.decode().strip()
                if not line or line == "data: [DONE]":
                    continue
                chunks.append(json.loads(line.removeprefix("data: ")))
                if len(chunks) == 1:
                    for payload in GARBAGE.values():
                        await nc.publish(subjects.stream(chunks[0]["id"]), payload)
    return chunks


async def test_garbage_events_are_dropped_and_nothing_dies(clean_stack):
    """Garbage on every event subject (heartbeats, discover, profile statistics and updates, plan events,
    leases, transfer failures, a live request's token stream) and hostile well-formed events: no service
    dies, a bad worker id never reaches /workers, no profile is written, no plan is restored, and the stream
    that got garbage still delivers every token."""
    ids = {w["role"]: w["id"] for w in list_workers(clean_stack.gateway_url, clean_stack.admin_token)}
    nc = await connect(clean_stack)
    try:
        kvprofile_list = subjects.worker("kvprofile", ids["kvprofile"], "list")
        profiles_before = (await nc.request(kvprofile_list, encode(schemas.ListQuery()), timeout=5)).data
        for subject in event_subjects(ids):
            for payload in GARBAGE.values():
                await nc.publish(subject, payload)
        for subject, payload in hostile_events():
            await nc.publish(subject, payload)
        await nc.flush()
        chunks = await stream_with_garbage_in_between(clean_stack, nc)
        await asyncio.sleep(1.0)  # heartbeats and statistics are handled asynchronously
        assert (await nc.request(kvprofile_list, encode(schemas.ListQuery()), timeout=5)).data == profiles_before
        assert {p["name"] for p in await gather(nc, "$SRV.PING")} == {f"smartgen-{r}" for r in ROLES}
    finally:
        await nc.close()
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len(chunks[-1]["smartgen"]["token_ids"]) == 48
    listed = {w["id"] for w in list_workers(clean_stack.gateway_url, clean_stack.admin_token)}
    assert "evil.*" not in listed
    broker = next(w for w in list_workers(clean_stack.gateway_url, clean_stack.admin_token) if w["role"] == "broker")
    transfers = get_json(broker["admin_url"] + "/transfers")
    assert not any(p["request_id"] == "fuzz-plan" for p in [*transfers["live"], *transfers["recent"]])
    assert_alive_and_serving(clean_stack)
    wait_until_forgotten(clean_stack, FUZZER_ID)


def wait_until_forgotten(stack, worker_id: str, timeout_s: float = 15.0) -> None:
    """Leave no made-up worker in the registry for the tests that come next (it ages out after the TTL)."""
    deadline = time.monotonic() + timeout_s
    while any(w["id"] == worker_id for w in list_workers(stack.gateway_url, stack.admin_token)):
        assert time.monotonic() < deadline, f"{worker_id} still registered after {timeout_s} s"
        time.sleep(0.2)


async def test_an_abort_that_overtakes_its_open_or_generate_leaves_nothing(clean_stack):
    """A client that leaves while its request's decode.open (or colocated generate) is still queued: the abort
    arrives first, and the open or generate that follows is refused instead of holding a slab and a ticket
    until the reservation expires."""
    from shared.runtime.rpc import RemoteError, call
    from tests.integration.conftest import assert_no_leaks

    ids = {w["role"]: w["id"] for w in list_workers(clean_stack.gateway_url, clean_stack.admin_token)}
    nc = await connect(clean_stack)
    try:
        for rid, subject, message in (
                ("overtaken-open", "open", schemas.OpenKv("overtaken-open", 8, 4, "full")),
                ("overtaken-gen", "generate", schemas.Generate("overtaken-gen", "colocated", [1, 2, 3], -1, 4, [],
                                                               schemas.Sampling(), "fuzz.stream"))):
            await call(nc, subjects.worker("decode", ids["decode"], "abort"), schemas.Abort(rid, "client_gone"),
                       schemas.Ack, 10)
            with pytest.raises(RemoteError) as refused:
                await call(nc, subjects.worker("decode", ids["decode"], subject), message, schemas.KvHandle
                           if subject == "open" else schemas.Accepted, 10)
            assert refused.value.code == "not_found" and "aborted" in refused.value.message
    finally:
        await nc.close()
    assert_no_leaks(clean_stack, timeout_s=2)
