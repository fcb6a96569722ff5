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
class KVLayoutRecord:
    """Where a node's KV memory is and how it is shaped: what a peer needs to write into it."""

    num_blocks: int = 0
    block_size: int = 0
    num_layers: int = 0
    bytes_per_block: int = 0
    base_addr: int = 0
    transport: str = ""
    dtype: str = ""
    device: str = ""
    kv_memory: str = ""
    shared_memory: str = ""  # same-host writers open it (transfer/shared_memory.py); "" nowhere
    landing_addr: int = 0  # one-sided writers target slots there (transfer/landing.py)
    num_landing_slots: int = 0
    tp_size: int = 1  # the node's tensor-parallel ranks; its registered buffer holds every KV head whatever the size


@dataclass(frozen=True)
class ModelCard:
    """The weights a node serves: routers and peers only mix nodes whose fingerprints agree."""

    model: str = ""
    fingerprint: str = ""
    root_hash: str = ""  # hex: the chain root of the block hashes (docs/design.md §4)
    index_namespace: str = ""  # the global index's key-safe name of the hash namespace


@dataclass(frozen=True)
class ComputeProbe:
    """What a node measured of itself at start-up (and keeps current): the cost models' seeds."""

    prefill_tokens_per_s: float = 0.0
    decode_step_s: float = 0.0
    disk_read_bytes_per_s: float = 0.0  # its disk tier's reads (0: no disk tier)
    prompt_tokens_per_step: int = 0  # a prompt's tokens per engine step at most (0: no cap, prompts run in turn)


_PARTS = {"kv_layout": KVLayoutRecord, "model": ModelCard, "probe": ComputeProbe}


@dataclass(frozen=True)
class NodeRecord:
    node_id: str
    role: str  # "prefill" | "decode" | "both" | "draining" (a decode node becoming a prefill node)
    host: str
    transfer_endpoint: str
    side_channel: str
    request_endpoint: str = ""  # where clients and routers send GenerateRequest / AbortRequest / StatsRequest
    kv_layout: KVLayoutRecord = field(default_factory=KVLayoutRecord)
    model: ModelCard = field(default_factory=ModelCard)
    probe: ComputeProbe = field(default_factory=ComputeProbe)
    capacity_blocks: int = 0
    load: dict = field(default_factory=dict)  # queue length, free blocks, ...

    def encode(self) -> bytes:
        return msgpack.packb(dataclasses.asdict(self), use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> NodeRecord:
        """The one codec of a node record: every part typed and checked, or RecordError."""
        fields = _unpack_map(data)
        for name, part in _PARTS.items():
            fields[name] = _typed_part(part, fields.get(name, {}), name)
        try:
            record = cls(**fields)
        except TypeError as e:
            raise RecordError(f"node record: {e}") from None
        if record.role not in ("prefill", "decode", "both", "draining"):
            raise RecordError(f"node record: unknown role {record.role!r}")
        if not all(isinstance(getattr(record, f), str) for f in ("node_id", "host", "transfer_endpoint",
                                                                  "side_channel", "request_endpoint")):
            raise RecordError("node record: ids and endpoints must be strings")
        for name in ("transfer_endpoint", "side_channel", "request_endpoint"):
            endpoint = getattr(record, name)
            if (endpoint or name != "request_endpoint") and not is_endpoint(endpoint):
                raise RecordError(f"node record: {name} {endpoint[:80]!r} is not host:port")
        if not isinstance(record.load, dict):
            raise RecordError("node record: load must be a map")
        return record


def _typed_part(cls, value, what: str):
    """A record part from its map: known fields only, each of its declared type (ints may stand for floats)."""
    if not isinstance(value, dict):
        raise RecordError(f"node record: {what} must be a map")
    types = {f.name: f.type for f in dataclasses.fields(cls)}
    unknown = set(value) - set(types)
    if unknown:
        raise RecordError(f"node record: unknown {what} fields {sorted(unknown)[:5]}")
    out = {}
    for name, raw in value.items():
        kind = types[name]
        if kind == "float" and isinstance(raw, int) and not isinstance(raw, bool):
            raw = float(raw)
        if type(raw).__name__ != kind:
            raise RecordError(f"node record: {what}.{name} must be {kind}, got {type(raw).__name__}")
        if kind in ("int", "float") and raw < 0:
            raise RecordError(f"node record: {what}.{name} must be >= 0")
        out[name] = raw
    return cls(**out)


_ENDPOINT = re.compile(r"(?:[A-Za-z0-9][A-Za-z0-9.\-]{0,252}|\[[0-9A-Fa-f:.]{2,45}\]):([0-9]{1,5})")


def is_endpoint(text: str) -> bool:
    """``host:port`` (a name, an IPv4 address or a bracketed IPv6 address; port 1-65535), nothing else."""
    match = _ENDPOINT.fullmatch(text)
    return match is not None and 0 < int(match.group(1)) < 65536


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
