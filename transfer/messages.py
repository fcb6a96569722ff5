"""Side-channel wire messages (DESIGN §6): one typed class each, MessagePack on the wire.

Every message is a msgpack map with a ``type`` field. ``decode`` validates type,
field names and field types, and raises MessageError naming what is wrong, so a
malformed message is refused without disturbing anything else.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import msgpack

from kvmesh.errors import KvmeshError

MAX_BLOCKS_PER_REQUEST = 1 << 20


class MessageError(KvmeshError, ValueError):
    """A side-channel message that cannot be decoded or fails validation."""


@dataclass(frozen=True)
class PushRequest:
    """Requester -> holder: write the blocks with these hashes into these block ids of mine."""

    TYPE: ClassVar[str] = "push_request"
    request_id: str
    requester_id: str
    transfer_endpoint: str  # where the holder's transfer engine writes to
    dst_base_addr: int  # requester's registered KV buffer
    block_bytes: int
    dst_block_ids: list[int]
    block_hashes: list[bytes]
    wait_ms: int = 0  # how long to wait for blocks still being computed

    def validate(self) -> None:
        if len(self.dst_block_ids) != len(self.block_hashes):
            raise MessageError("dst_block_ids and block_hashes differ in length")
        if not 0 < len(self.block_hashes) <= MAX_BLOCKS_PER_REQUEST:
            raise MessageError(f"a push request needs 1..{MAX_BLOCKS_PER_REQUEST} blocks")
        if any(len(h) != 16 for h in self.block_hashes):
            raise MessageError("block hashes must be 16 bytes")
        if any(b < 0 for b in self.dst_block_ids) or self.block_bytes <= 0 or self.dst_base_addr < 0:
            raise MessageError("negative block id, address or block size")
        if self.wait_ms < 0:
            raise MessageError("wait_ms must be >= 0")


@dataclass(frozen=True)
class PushResult:
    """Holder -> requester: which blocks were written (progress while ``final`` is False)."""

    TYPE: ClassVar[str] = "push_result"
    request_id: str
    written: list[bool]  # per requested block
    final: bool = True
    error: str = ""  # set when the push failed (the written flags still hold)

    def validate(self) -> None:
        pass


@dataclass(frozen=True)
class PrefillDone:
    """Prefill node -> decode node: the prompt's KV is pushed; here is the first token."""

    TYPE: ClassVar[str] = "prefill_done"
    request_id: str
    first_token: int
    logprob: float
    num_computed_tokens: int

    def validate(self) -> None:
        if self.first_token < 0 or self.num_computed_tokens < 0:
            raise MessageError("negative token id or token count")


@dataclass(frozen=True)
class Abort:
    """Either side: stop working on this request."""

    TYPE: ClassVar[str] = "abort"
    request_id: str
    reason: str = ""

    def validate(self) -> None:
        pass


MESSAGE_TYPES: dict[str, type] = {cls.TYPE: cls for cls in (PushRequest, PushResult, PrefillDone, Abort)}
Message = PushRequest | PushResult | PrefillDone | Abort


def encode(msg: Message) -> bytes:
    payload = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}
    payload["type"] = msg.TYPE
    return msgpack.packb(payload, use_bin_type=True)


def decode(data: bytes) -> Message:
    try:
        payload = msgpack.unpackb(data, raw=False)
    except Exception as e:  # msgpack raises several unrelated types
        raise MessageError(f"not a msgpack message: {e}") from None
    if not isinstance(payload, dict):
        raise MessageError(f"expected a map, got {type(payload).__name__}")
    cls = MESSAGE_TYPES.get(payload.pop("type", None))
    if cls is None:
        raise MessageError(f"unknown message type (known: {', '.join(MESSAGE_TYPES)})")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(payload) - set(fields)
    if unknown:
        raise MessageError(f"{cls.TYPE}: unknown fields {sorted(unknown)}")
    missing = [n for n, f in fields.items() if n not in payload
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise MessageError(f"{cls.TYPE}: missing fields {missing}")
    for name, value in payload.items():
        _check_type(cls.TYPE, name, fields[name].type, value)
    msg = cls(**payload)
    msg.validate()
    return msg


_SCALARS = {"str": str, "int": int, "bool": bool, "float": (float, int), "bytes": bytes}


def _check_type(kind: str, name: str, annotation: str, value) -> None:
    if annotation.startswith("list["):
        inner = _SCALARS[annotation[5:-1]]
        ok = isinstance(value, list) and all(isinstance(v, inner) and not _is_bool_for_int(v, inner) for v in value)
    else:
        expected = _SCALARS[annotation]
        ok = isinstance(value, expected) and not _is_bool_for_int(value, expected)
    if not ok:
        raise MessageError(f"{kind}.{name}: expected {annotation}, got {type(value).__name__}")


def _is_bool_for_int(value, expected) -> bool:
    return isinstance(value, bool) and expected is int


__all__ = ["Abort", "Message", "MessageError", "PrefillDone", "PushRequest", "PushResult", "decode", "encode"]
