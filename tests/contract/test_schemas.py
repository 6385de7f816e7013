"""Every NATS message round-trips through the codec; bad bytes give SchemaError, never a crash."""
from __future__ import annotations

import dataclasses
import typing

import pytest

import schemas
from schemas import SchemaError, decode, encode, messages, subjects

LAYOUT = schemas.KvLayout(num_layers=2, num_kv_heads=3, head_dim=64, page_tokens=16, dtype="float32", token_bytes=3072)
PLAN = schemas.TransferPlan("r1", "smartgen", "broker-0", 2, b"\x0f", 4, "m.quest.2048", 3, "calibration", 0.5, 200.0,
                            True, True, "fits", "quest", 12)
EXAMPLES = [
    schemas.WorkerInfo("decode", "decode-1", 42, "host", "http://127.0.0.1:1", "0.1.0", "127.0.0.1:2", "m", 1, 2, 3, 4.5,
                       request_ids=["r1", "r2"]),
    schemas.WorkerInfo("prefill", "prefill-1", 43, "host", "http://127.0.0.1:3", "0.1.0",
                       prefill_rates=[schemas.PrefillRate(512, 380.5), schemas.PrefillRate(2048, 333.0)]),
    schemas.PrefillRate(4096, 270.25),
    schemas.Discover("gateway-1"),
    LAYOUT,
    schemas.KvHandle("r1", "decode-1", "127.0.0.1:2", 2**62, LAYOUT, 20, 4096, 48,
                     floor=schemas.BudgetFloor(64, 512, 2, 16)),
    schemas.BudgetFloor(128, 1024, 4, 32),
    schemas.OpenKv("r1", 20, 16, "full"),
    schemas.Sampling(0.7, 3),
    schemas.Sampling(0.0, 1, logprobs=2, echo=True),
    schemas.Sampling(0.9, 5, top_p=0.9, top_k=40, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
                     logit_bias={"17": -100.0, "3": 2.5}),
    schemas.Sampling(0.0, 1, min_p=0.1, min_tokens=2, end_ids=[2], grammar='{"grammars": [{"json_schema": {}}]}'),
    schemas.TokenLogprobs(-0.25, [5, 9], [-0.25, -2.5]),
    schemas.TokenEvent("r1", 0, 5, logprobs=schemas.TokenLogprobs(-0.25, [5], [-0.25]),
                       prompt_logprobs=[schemas.TokenLogprobs(-1.5), schemas.TokenLogprobs(-0.5)]),
    schemas.Prefill("r1", [1, 2, 3], "full", schemas.Sampling(), schemas.KvHandle("r1", "d", "a:1", 1, LAYOUT, 3, 0, 16)),
    schemas.PrefillDone("r1", 7, "prefill-1", 3, 0.25, query_entries=600),
    schemas.Generate("r1", "full", [1, 2], 5, 16, [2], schemas.Sampling(), "smartgen.stream.r1", "quest", 0.1,
                     prefill_worker_id="prefill-1", prefill_dataplane_addr="127.0.0.1:3", failure_policy="recompute",
                     query_entries=600),
    schemas.Accepted("r1", "decode-1"),
    schemas.ResendTokens("r1", 7),
    schemas.TokenBacklog("r1", 7, [5, 6, 7], schemas.TokenEvent("r1", 10, -1, "length", kv_bytes={"full": 8})),
    schemas.TokenEvent("r1", 3, 99, "length", "", {"full": 1024}, 0.5, 0.1, recompute_reason="link dropped"),
    schemas.Abort("r1", "client_gone"),
    schemas.TransferFailed("r1", "boom"),
    schemas.Ack(),
    schemas.ErrorReply("bad_request", "no"),
    schemas.ListQuery("pre"),
    schemas.WorkerList([schemas.WorkerInfo("broker", "b", 1, "h", "u", "v")]),
    schemas.ProfileList("bucket", ["a", "b"]),
    schemas.RdmaEndpoint("rdma:decode-1", 17, 0xABCDE, "fe80:0000:0000:0000:0000:0000:0000:0001", 2**40, 0x1234, 1 << 30),
    PLAN,
    schemas.KvSource("prefill-1", "127.0.0.1:3", 2**61, 8192, 32, 30.0),
    schemas.KvSource("prefill-1", "127.0.0.1:3", 2**61, 8192, 32, 30.0, codes_offset=1 << 20, codes_bits=8),
    schemas.Release("r1", "all_local"),
    schemas.KeepLease("r1"),
    schemas.OpenPlan("r1", "auto", "m", "quest", 20, LAYOUT, 512, "prefill-1", "decode-1", ["background"], 0.2,
                     schemas.NO_FLOOR),
    schemas.Progress("r1", 3, 10, 4000),
    schemas.BackgroundBatch("r1", [4, 5, 9], 12),
    schemas.PlanEvent("r1", "all_local", ""),
    schemas.PlanRegistration(PLAN, "transferring", "m", "quest", "prefill-1", "decode-1", 20, 2, 16, b"\x03"),
    schemas.ProfileQuery("m", "quest", 2000),
    schemas.Profile("m.quest.2048", "m", "quest", 2048, 3, 2, 4, bytes(32), "calibration", 4, 1, 1.5),
    schemas.ProfileInfo("m.quest.2048", 3, "online", 4, 2, 1.5, False),
    schemas.BuildProfile("quest", 2048, 4, 16, 0.1, "smartgen.profile.progress.ab"),
    schemas.BuildProgress(1, 4, "prompt 2/4"),
    schemas.ProfileKey("m.quest.2048"),
    schemas.SelectionStats("m", "quest", 20, 2, 4, bytes(32), bytes(16)),
]


def all_message_types() -> set[type]:
    return {obj for obj in vars(messages).values() if dataclasses.is_dataclass(obj) and isinstance(obj, type)}


def test_examples_cover_every_message():
    """The round-trip list below holds one example of every message type in schemas/messages/."""
    assert {type(m) for m in EXAMPLES} == all_message_types()


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(message):
    """encode → decode gives back an equal message."""
    assert decode(type(message), encode(message)) == message


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_messages_are_frozen_and_slotted(message):
    """Messages are data: immutable, no per-instance dict."""
    assert not hasattr(message, "__dict__")
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(message, dataclasses.fields(message)[0].name, None)


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\x93\x01\x02\x03", encode(schemas.Ack())])
def test_garbage_is_a_schema_error(data):
    """Bytes that are not a Prefill raise SchemaError with a sentence, not KeyError/TypeError."""
    with pytest.raises(SchemaError):
        decode(schemas.Prefill, data)


def test_wrong_types_and_unknown_fields_are_refused():
    """A field of the wrong type, a bool for an int, or an unknown field is an error naming the field."""
    import msgpack

    good = msgpack.unpackb(encode(schemas.OpenKv("r", 3, 4, "full")))
    for bad, field in [({**good, "num_tokens": "3"}, "num_tokens"), ({**good, "num_tokens": True}, "num_tokens"),
                       ({**good, "extra": 1}, "extra"), ({k: v for k, v in good.items() if k != "request_id"}, "request_id")]:
        with pytest.raises(SchemaError, match=field):
            decode(schemas.OpenKv, msgpack.packb(bad))


def test_every_field_has_a_type_the_codec_knows():
    """Each message type's fields are made of types the codec validates (no silent Any)."""
    for cls in all_message_types():
        for name, tp in typing.get_type_hints(cls).items():
            assert tp is not typing.Any, f"{cls.__name__}.{name}"


def test_subjects():
    """Worker subjects put role, id and verb in their own tokens under the smartgen prefix."""
    assert subjects.worker("decode", "decode-ab12", "open") == "smartgen.decode.decode-ab12.open"
    assert subjects.stream("cmpl-1") == "smartgen.stream.cmpl-1"
    assert subjects.heartbeat("prefill") == "smartgen.heartbeat.prefill"
    assert subjects.is_token("decode-ab12") and not subjects.is_token("a.b") and not subjects.is_token("")
