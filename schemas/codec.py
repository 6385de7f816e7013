"""The only module that imports msgpack.

A message is a frozen dataclass; on the wire it is a msgpack map of its fields.
`decode` validates what it reads (every field present, every value of its declared type)
and raises `SchemaError` with a sentence naming the field, so a handler can answer
garbage with an error reply instead of crashing.
"""
from __future__ import annotations

import dataclasses
import enum
import types
import typing
from functools import cache
from typing import Any, TypeVar

import msgpack

T = TypeVar("T")


class SchemaError(ValueError):
    """Bytes that do not decode into the expected message."""


def encode(message: Any) -> bytes:
    if not dataclasses.is_dataclass(message):
        raise TypeError(f"encode() takes a schemas dataclass, not {type(message).__name__}")
    return msgpack.packb(_to_plain(message), use_bin_type=True)


def decode(cls: type[T], data: bytes) -> T:
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad bytes
        raise SchemaError(f"{cls.__name__}: not valid msgpack ({exc})") from None
    return _from_plain(cls, raw, cls.__name__)


def from_plain(cls: type[T], value: Any) -> T:
    """A message from plain data (e.g. a JSON body), validated like `decode` does."""
    return _from_plain(cls, value, cls.__name__)


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, enum.Enum):
        return value.value
    return value


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _from_plain(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise SchemaError(f"{where}: expected a map, got {type(value).__name__}")
        hints = _hints(tp)
        kwargs = {}
        for f in dataclasses.fields(tp):
            if f.name in value:
                kwargs[f.name] = _from_plain(hints[f.name], value[f.name], f"{where}.{f.name}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise SchemaError(f"{where}: missing field {f.name!r}")
        unknown = set(value) - {f.name for f in dataclasses.fields(tp)}
        if unknown:
            raise SchemaError(f"{where}: unknown fields {_some(unknown)}")
        return tp(**kwargs)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(tp):
            try:
                return _from_plain(option, value, where)
            except SchemaError:
                continue
        raise SchemaError(f"{where}: {value!r:.60} matches none of {tp}")
    if origin in (list, tuple):
        (item_tp, *_) = typing.get_args(tp)
        if not isinstance(value, list):
            raise SchemaError(f"{where}: expected a list, got {type(value).__name__}")
        items = [_from_plain(item_tp, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise SchemaError(f"{where}: expected a map, got {type(value).__name__}")
        return {_from_plain(key_tp, k, where): _from_plain(val_tp, v, f"{where}[{k!r:.40}]") for k, v in value.items()}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except (ValueError, TypeError):
            raise SchemaError(f"{where}: {value!r:.60} is not one of {', '.join(str(m.value) for m in tp)}") from None
    if tp is type(None):
        if value is not None:
            raise SchemaError(f"{where}: expected nil")
        return None
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SchemaError(f"{where}: expected a number, got {type(value).__name__}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SchemaError(f"{where}: expected an integer, got {type(value).__name__}")
        return value
    if tp in (str, bool, bytes):
        if not isinstance(value, tp):
            raise SchemaError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
        return value
    if tp is Any:
        return value
    raise TypeError(f"{where}: the codec does not know type {tp}")


def _some(names: set[Any], limit: int = 4) -> str:
    """A few of `names`, each cut short: an error names the culprits without echoing a hostile payload."""
    shown = [f"{name!r:.40}" for name in sorted(names, key=repr)[:limit]]
    return ", ".join(shown) + (f" and {len(names) - limit} more" if len(names) > limit else "")
