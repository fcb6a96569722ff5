"""Typed values stored under the keys of ``metadata.keys`` (msgpack), with validating decode."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

import msgpack

from kvmesh.errors import KvmeshError


class RecordError(KvmeshError, ValueError):
    """A stored value that does not decode into its record type."""


@dataclass(frozen=True)
class NodeRecord:
    node_id: str
    role: str  # "prefill" | "decode" | "both"
    host: str
    transfer_endpoint: str
    side_channel: str
    request_endpoint: str = ""  # where clients and routers send GenerateRequest / AbortRequest / StatsRequest
    kv_layout: dict = field(default_factory=dict)  # num_blocks, block_size, num_layers, ...
    capacity_blocks: int = 0
    load: dict = field(default_factory=dict)  # queue length, free blocks, ...

    def encode(self) -> bytes:
        return msgpack.packb(dataclasses.asdict(self), use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> NodeRecord:
        record = _from_map(cls, data, "node record")
        if record.role not in ("prefill", "decode", "both"):
            raise RecordError(f"node record: unknown role {record.role!r}")
        if not all(isinstance(getattr(record, f), str) for f in ("node_id", "host", "transfer_endpoint",
                                                                  "side_channel", "request_endpoint")):
            raise RecordError("node record: ids and endpoints must be strings")
        for name in ("transfer_endpoint", "side_channel", "request_endpoint"):
            endpoint = getattr(record, name)
            if (endpoint or name != "request_endpoint") and not is_endpoint(endpoint):
                raise RecordError(f"node record: {name} {endpoint[:80]!r} is not host:port")
        if not isinstance(record.kv_layout, dict) or not isinstance(record.load, dict):
            raise RecordError("node record: kv_layout and load must be maps")
        return record


_ENDPOINT = re.compile(r"(?:[A-Za-z0-9][A-Za-z0-9.\-]{0,252}|\[[0-9A-Fa-f:.]{2,45}\]):([0-9]{1,5})")


def is_endpoint(text: str) -> bool:
    """``host:port`` (a name, an IPv4 address or a bracketed IPv6 address; port 1-65535), nothing else."""
    match = _ENDPOINT.fullmatch(text)
    return match is not None and 0 < int(match.group(1)) < 65536


@dataclass(frozen=True)
class BlockEntry:
    published_at: float  # unix time
    tier: int = 0  # the fastest tier of the holder that has the block: 0 compute buffer, 1 host memory, 2 disk

    def encode(self) -> bytes:
        return msgpack.packb([self.published_at, self.tier] if self.tier else [self.published_at])

    @classmethod
    def decode(cls, data: bytes) -> BlockEntry:
        try:
            value = msgpack.unpackb(data)
        except Exception as e:
            raise RecordError(f"block entry: not msgpack ({e})") from None
        if not (isinstance(value, list) and len(value) in (1, 2) and isinstance(value[0], (int, float))):
            raise RecordError("block entry: expected [published_at] or [published_at, tier]")
        tier = value[1] if len(value) == 2 else 0
        if not (isinstance(tier, int) and not isinstance(tier, bool) and 0 <= tier <= 2):
            raise RecordError(f"block entry: tier must be 0, 1 or 2, got {tier!r}")
        return cls(float(value[0]), tier)


def _from_map(cls, data: bytes, what: str):
    """A record dataclass from a msgpack map of its fields (RecordError naming ``what`` otherwise)."""
    try:
        return cls(**_unpack_map(data))
    except TypeError as e:
        raise RecordError(f"{what}: {e}") from None


def _unpack_map(data: bytes) -> dict:
    try:
        payload = msgpack.unpackb(data, raw=False)
    except Exception as e:
        raise RecordError(f"not msgpack ({e})") from None
    if not isinstance(payload, dict):
        raise RecordError("expected a msgpack map")
    return payload


@dataclass(frozen=True)
class PinRecord:
    """A pinned prefix: its tokens (nodes hash them in their own namespace) and who asked, when."""

    token_ids: list[int]
    label: str = ""
    pinned_at: float = 0.0

    def encode(self) -> bytes:
        return msgpack.packb(dataclasses.asdict(self), use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> PinRecord:
        record = _from_map(cls, data, "pin record")
        if not isinstance(record.token_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in record.token_ids):
            raise RecordError("pin record: token_ids must be a list of non-negative integers")
        return record
