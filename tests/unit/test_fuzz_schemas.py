"""Property-based fuzzing of the codec: for every message type in schemas/messages/, decoding anything
raises SchemaError or gives a message of that type, and every valid message round-trips.

Strategies are built from the dataclasses' type hints, so a new message or field is fuzzed without
touching this file. Per decoder: EXAMPLES arbitrary byte strings, EXAMPLES arbitrary msgpack values, and
MESSAGES_PER_TYPE valid messages plus as many with a field broken (pytest --hypothesis-show-statistics
shows the counts).
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import SchemaError, decode, encode, messages

EXAMPLES = 300  # arbitrary inputs, each given to every decoder
MESSAGES_PER_TYPE = 100  # valid messages (and as many broken ones) per message type
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
MESSAGE_TYPES = sorted((obj for obj in vars(messages).values()
                        if dataclasses.is_dataclass(obj) and isinstance(obj, type)), key=lambda cls: cls.__name__)
INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1  # what msgpack can carry

# Anything msgpack can carry: maps keyed by str or bytes (what decode accepts as keys), nested.
PLAIN = st.recursive(
    st.none() | st.booleans() | st.integers(INT64_MIN, UINT64_MAX) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6) | st.binary(max_size=6), inner,
                                                                max_size=3),
    max_leaves=6)


def valid(tp: typing.Any) -> st.SearchStrategy:
    """Values of type `tp` as the codec's senders produce them (NaN left out: it is not equal to itself)."""
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        return st.builds(tp, **{f.name: valid(hints[f.name]) for f in dataclasses.fields(tp)})
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*map(valid, args))
    if origin is list:  # NOTE: short lists: lists of messages holding lists multiply the generation cost
        return st.lists(valid(args[0]), max_size=2 if dataclasses.is_dataclass(args[0]) else 3)
    if origin is dict:
        return st.dictionaries(valid(args[0]), valid(args[1]), max_size=3)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return st.sampled_from(list(tp))
    leaves = {type(None): st.none(), bool: st.booleans(), int: st.integers(INT64_MIN, UINT64_MAX),
              float: st.floats(allow_nan=False), str: st.text(max_size=16), bytes: st.binary(max_size=32)}
    return leaves[tp]


def broken(data: st.DataObject, plain: dict) -> dict:
    """A valid message's map with one field replaced, dropped or added: garbage close to the real thing."""
    plain = dict(plain)
    name = data.draw(st.sampled_from(sorted(plain)) | st.text(max_size=8))
    action = data.draw(st.sampled_from(["replace", "drop", "nest"]))
    if action == "drop":
        plain.pop(name, None)
    elif action == "nest" and isinstance(plain.get(name), dict) and plain[name]:
        nested = dict(plain[name])
        nested[data.draw(st.sampled_from(sorted(nested)))] = data.draw(PLAIN)
        plain[name] = nested
    else:
        plain[name] = data.draw(PLAIN)
    return plain


@functools.cache
def message_of(cls: type) -> st.SearchStrategy:
    return valid(cls)


def decodes_or_refuses(cls: type, data: bytes) -> None:
    try:
        message = decode(cls, data)
    except SchemaError:
        return
    assert type(message) is cls


@FUZZ
@given(raw=st.binary(max_size=128))
def test_arbitrary_bytes_raise_only_schema_error(raw):
    """Any bytes at all, given to every decoder: a message of its type or SchemaError, never another exception."""
    for cls in MESSAGE_TYPES:
        decodes_or_refuses(cls, raw)


@FUZZ
@given(plain=PLAIN)
def test_arbitrary_msgpack_raises_only_schema_error(plain):
    """Valid msgpack of any shape, given to every decoder: a message of its type or SchemaError only."""
    raw = msgpack.packb(plain, use_bin_type=True)
    for cls in MESSAGE_TYPES:
        decodes_or_refuses(cls, raw)


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda cls: cls.__name__)
@settings(FUZZ, max_examples=MESSAGES_PER_TYPE)
@given(data=st.data())
def test_valid_messages_round_trip_and_broken_ones_are_refused(cls, data):
    """A message drawn from the dataclass's type hints decodes back equal; the same message with one field
    replaced, dropped or nested garbage decodes or raises SchemaError, never another exception."""
    message = data.draw(message_of(cls))
    raw = encode(message)
    assert decode(cls, raw) == message
    decodes_or_refuses(cls, msgpack.packb(broken(data, msgpack.unpackb(raw)), use_bin_type=True))


@pytest.mark.parametrize("keys", [{"x": 1, b"y": 2}, {b"a": 1, "b": 2, "c": 3}])
def test_unknown_keys_of_mixed_types_are_a_schema_error(keys):
    """Found by the fuzzer: unknown str and bytes keys together made the error message's sort raise TypeError."""
    with pytest.raises(SchemaError, match="unknown fields"):
        decode(messages.Ack, msgpack.packb(keys, use_bin_type=True))


def test_errors_do_not_echo_a_huge_payload():
    """A map with a huge unknown key gives a short error sentence (it goes into a reply header)."""
    with pytest.raises(SchemaError) as raised:
        decode(messages.Abort, msgpack.packb({"request_id": "r", "reason": "x", "y" * 100_000: 1}))
    assert len(str(raised.value)) < 200
