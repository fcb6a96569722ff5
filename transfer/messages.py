"""Side-channel wire messages (DESIGN §6): one typed class each, MessagePack on the wire.

Encoded by ``kvmesh.wire``: a msgpack map with a ``type`` field; ``decode``
validates type, field names and field types and raises MessageError naming what
is wrong, so a malformed message is refused without disturbing anything else.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvmesh.wire import MessageError, encode, register
from kvmesh.wire import decode as _decode

MAX_BLOCKS_PER_REQUEST = 1 << 20


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


Message = PushRequest | PushResult | PrefillDone | Abort
register(PushRequest, PushResult, PrefillDone, Abort)
_MESSAGES = (PushRequest, PushResult, PrefillDone, Abort)


def decode(data: bytes) -> Message:
    """Decode a side-channel message (any other kvmesh message type is refused)."""
    return _decode(data, _MESSAGES)


__all__ = ["Abort", "Message", "MessageError", "PrefillDone", "PushRequest", "PushResult", "decode", "encode"]
