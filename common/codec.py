"""The one msgpack codec of pdserve's wire messages (frontend <-> worker, prefill <-> decode control).

A message is a dataclass with a `version` field; a part nested inside a message (a TokenOut inside
a TokenBatch) may have none and travels with its message's version. On the wire a message is a
msgpack map of its fields plus `type` (the class name). A `Codec` knows a closed set of classes and
has one strictness for all: an undecodable frame, a missing or unknown type, a version other than
the class's default (`VersionError`), a missing or ill-typed field raise `ValueError` on decode,
never a half-read message. Field types are checked one level deep against the annotation (`int`,
`str | None`, `list[int]` -> a list, ...); what a list holds is the reader's to check. Unknown
extra keys are ignored (a newer peer may add optional fields within one version).

Nested values: a registered dataclass inside a field (a list of them too) travels as its own typed
map. A field value whose class has `to_dict()` and a `from_dict(d)` classmethod (a frozen value
object such as SamplingParams) travels as that dict and is rebuilt by the field's annotation.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

import msgpack


class VersionError(ValueError):
    """A known message type with another version than ours."""


def _wire_types(hint: Any) -> tuple[type, ...] | None:
    """Python types a msgpack value of a field annotated `hint` may have; None: not checked."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        parts = [_wire_types(a) for a in typing.get_args(hint)]
        return None if any(p is None for p in parts) else tuple(t for p in parts for t in p)
    base = origin or hint
    if base is type(None):
        return (type(None),)
    if base is float:
        return (int, float)
    if base in (int, str, bytes, bool, list, dict):
        return (base,)
    return None  # Any, a nested message or value object: checked where it is decoded


class Codec:
    def __init__(self, name: str, *classes: type) -> None:
        self.name = name  # names this set in errors ("service message", "transfer message")
        self.types = {c.__name__: c for c in classes}
        self._values: dict[type, dict[str, type]] = {}  # class -> {field: value-object class}
        self._wire: dict[type, dict[str, tuple[type, ...]]] = {}  # class -> {field: allowed types}
        for c in classes:
            hints = typing.get_type_hints(c)
            self._values[c] = {f: t for f, t in hints.items() if isinstance(t, type) and hasattr(t, "from_dict")}
            self._wire[c] = {f: w for f, t in hints.items() if (w := _wire_types(t)) is not None}

    def encode(self, msg: Any) -> bytes:
        if type(msg).__name__ not in self.types:
            raise ValueError(f"not a {self.name}: {type(msg).__name__}")
        return msgpack.packb(self._to_wire(msg), use_bin_type=True)

    def decode(self, data: bytes) -> Any:
        try:
            obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
        except (msgpack.UnpackException, ValueError, TypeError) as e:
            raise ValueError(f"undecodable {self.name}: {e}") from e
        if not isinstance(obj, dict) or "type" not in obj:
            raise ValueError(f"{self.name} without a type")
        try:
            return self._from_wire(obj)
        except RecursionError as e:  # messages nested in messages, hundreds deep
            raise ValueError(f"{self.name} nested too deep") from e

    def _to_wire(self, obj: Any) -> Any:
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            if type(obj).__name__ not in self.types:
                return obj.to_dict()  # type: ignore[attr-defined]
            d = {f.name: self._to_wire(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
            d["type"] = type(obj).__name__
            return d
        if isinstance(obj, list | tuple):
            return [self._to_wire(x) for x in obj]
        return obj

    def _from_wire(self, d: dict) -> Any:
        name = d.pop("type")
        cls = self.types.get(name) if isinstance(name, str) else None
        if cls is None:
            raise ValueError(f"unknown {self.name} type {name!r}")
        want = next((f.default for f in dataclasses.fields(cls) if f.name == "version"), None)
        if want is not None and d.get("version") != want:
            raise VersionError(f"{name}: version {d.get('version')} != {want}")
        kw: dict[str, Any] = {}
        wire = self._wire[cls]
        for f in dataclasses.fields(cls):
            if f.name not in d:
                continue
            v = d[f.name]
            if f.name in wire and not isinstance(v, wire[f.name]):
                raise ValueError(f"{name}.{f.name}: {type(v).__name__} is not {f.type}")
            if f.name in self._values[cls]:
                v = self._value(name, f.name, self._values[cls][f.name], v)
            elif self._is_message(v):
                v = self._from_wire(v)
            elif isinstance(v, list) and v and self._is_message(v[0]):
                v = [self._from_wire(x) for x in v]
            kw[f.name] = v
        try:
            return cls(**kw)
        except TypeError as e:
            raise ValueError(f"{name}: {e}") from e

    def _is_message(self, v: Any) -> bool:
        return isinstance(v, dict) and v.get("type") in self.types

    @staticmethod
    def _value(msg: str, field: str, cls: type, v: Any) -> Any:
        if not isinstance(v, dict):
            raise ValueError(f"{msg}.{field}: expected a map, got {type(v).__name__}")
        try:
            return cls.from_dict(v)  # type: ignore[attr-defined]
        except (TypeError, ValueError) as e:
            raise ValueError(f"{msg}.{field}: {e}") from e
