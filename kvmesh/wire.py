"""The wire codec every kvmesh message uses: typed dataclasses <-> MessagePack maps.

A message class is a frozen dataclass with a ``TYPE`` class variable and a
``validate()`` method, registered with ``register``. A field may also hold a record:
a frozen dataclass of scalar fields registered with ``register_record`` (the field's
annotation names its class, optionally ``| None``), sent as a map. ``decode`` checks
the type tag, the field names and every field's type (a record's too) before building
the object, so bad input is refused with a MessageError that says what is wrong.
"""
from __future__ import annotations

import dataclasses

import msgpack

from kvmesh.errors import KvmeshError


class MessageError(KvmeshError, ValueError):
    """A message that cannot be decoded or fails validation."""


_REGISTRY: dict[str, type] = {}
_RECORDS: dict[str, type] = {}  # record classes by name, as field annotations name them
_SCALARS = {"str": str, "int": int, "bool": bool, "float": (float, int), "bytes": bytes, "dict": dict}


def register(*classes: type) -> None:
    for cls in classes:
        if _REGISTRY.setdefault(cls.TYPE, cls) is not cls:
            raise ValueError(f"message type {cls.TYPE!r} registered twice")


def register_record(*classes: type) -> None:
    for cls in classes:
        if _RECORDS.setdefault(cls.__name__, cls) is not cls:
            raise ValueError(f"record {cls.__name__!r} registered twice")


def encode(msg) -> bytes:
    payload = _fields_of(msg)
    payload["type"] = msg.TYPE
    return msgpack.packb(payload, use_bin_type=True)


def _fields_of(obj) -> dict:
    return {f.name: _fields_of(v) if dataclasses.is_dataclass(v := getattr(obj, f.name)) else v
            for f in dataclasses.fields(obj)}


def decode(data: bytes, expected: tuple[type, ...] | None = None):
    """Decode one message; with ``expected``, refuse any other message type."""
    try:
        payload = msgpack.unpackb(data, raw=False)
    except Exception as e:  # msgpack raises several unrelated types
        raise MessageError(f"not a msgpack message: {e}") from None
    if not isinstance(payload, dict):
        raise MessageError(f"expected a map, got {type(payload).__name__}")
    cls = _REGISTRY.get(payload.pop("type", None))
    if cls is None or (expected is not None and cls not in expected):
        known = ", ".join(c.TYPE for c in expected) if expected else ", ".join(_REGISTRY)
        raise MessageError(f"unknown or unexpected message type (expected: {known})")
    msg = _build(cls.TYPE, cls, payload)
    msg.validate()
    return msg


def _build(kind: str, cls: type, payload: dict):
    """``cls`` from a map whose names and types were checked (records among its fields built the same way)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(payload) - set(fields)
    if unknown:
        raise MessageError(f"{kind}: unknown fields {sorted(unknown)}")
    missing = [n for n, f in fields.items() if n not in payload
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise MessageError(f"{kind}: missing fields {missing}")
    for name, value in payload.items():
        annotation = fields[name].type
        record = _RECORDS.get(annotation.removesuffix(" | None"))
        if record is None:
            _check_type(kind, name, annotation, value)
        elif value is None and annotation.endswith(" | None"):
            pass
        elif isinstance(value, dict):
            payload[name] = _build(f"{kind}.{name}", record, value)
        else:
            raise MessageError(f"{kind}.{name}: expected a {record.__name__} map, got {type(value).__name__}")
    return cls(**payload)


def _check_type(kind: str, name: str, annotation: str, value) -> None:
    if annotation.startswith("list["):
        inner = _SCALARS[annotation[5:-1]]
        ok = isinstance(value, list) and all(isinstance(v, inner) and not _bool_as_int(v, inner) for v in value)
    else:
        expected = _SCALARS[annotation]
        ok = isinstance(value, expected) and not _bool_as_int(value, expected)
    if not ok:
        raise MessageError(f"{kind}.{name}: expected {annotation}, got {type(value).__name__}")


def _bool_as_int(value, expected) -> bool:
    return isinstance(value, bool) and expected is int
