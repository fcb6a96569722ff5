"""Side-channel wire messages (docs/design.md §6): one typed class each, MessagePack on the wire.

Encoded by ``kvmesh.wire`` and sealed with the cluster MAC (``kvmesh.auth``).
``decode`` validates type, field names and field types and raises MessageError
naming what is wrong, so a malformed message is refused without disturbing
anything else. ``request_id`` is the correlation id of one conversation.

One conversation per transfer, on the writer's side channel::

    requester                                       holder / prefill node
    PushRequest(grant, dst ids, hashes, wait)  ──>
    ComputeAndPush(grant, prompt, first block) ──>  Accepted | Refused(code)   (compute only, at once)
                                               <──  PushResult(final=False)    one per written chunk
                                               <──  PushResult(final=True)     the writer has stopped
    Abort ──>                                       the writer stops, answers its final PushResult

Destination addresses never travel: the writer reads the requester's transfer
endpoint and base address from the etcd node directory and bounds-checks the
block ids against the requester's published layout. With ``landing`` set, the ids
are slots of the requester's landing zone (``transfer/landing.py``), written through
the transfer engine only and always with a crc32 per block; without it they are KV
blocks, which a writer with a one-sided engine may only write through shared memory
(else it refuses with NEEDS_LANDING).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar

from kvmesh.tracing import check_trace_context
from kvmesh.wire import MessageError, encode, register
from kvmesh.wire import decode as _decode

MAX_BLOCKS_PER_REQUEST = 1 << 20
MAX_WAIT_MS = 60_000  # no grant lives longer: a holder waits and writes at most this long


class ErrorCode(str, Enum):
    """Why a transfer was refused or ended early (never classified by message text)."""

    NONE = ""
    UNKNOWN_REQUESTER = "unknown_requester"  # not in the holder's node directory
    OUT_OF_BOUNDS = "out_of_bounds"  # a block id past the requester's published buffer
    LAYOUT_MISMATCH = "layout_mismatch"  # block sizes differ: the nodes run different models
    BUSY = "busy"  # too many transfers in progress
    INVALID_PROMPT = "invalid_prompt"  # the prefill node cannot compute this prompt
    WRITE_FAILED = "write_failed"  # the transfer engine failed
    EXPIRED = "expired"  # the grant's deadline passed before every block was written
    ABORTED = "aborted"  # either side aborted
    NOT_A_PREFILL_NODE = "not_a_prefill_node"
    SHUTTING_DOWN = "shutting_down"
    MALFORMED = "malformed"  # the message did not decode or validate
    NEEDS_LANDING = "needs_landing"  # one-sided writes go to landing slots: ask again with ``landing``


_CODES = {c.value for c in ErrorCode}


def _check_code(kind: str, code: str) -> None:
    if code not in _CODES:
        raise MessageError(f"{kind}: unknown error code {code!r}")


def _check_grant(kind: str, grant_id: str, dst_block_ids: list[int], deadline_ms: int) -> None:
    if not grant_id:
        raise MessageError(f"{kind}: empty grant id")
    if not 0 < len(dst_block_ids) <= MAX_BLOCKS_PER_REQUEST:
        raise MessageError(f"{kind}: a transfer needs 1..{MAX_BLOCKS_PER_REQUEST} blocks")
    if any(b < 0 for b in dst_block_ids):
        raise MessageError(f"{kind}: negative block id")
    if len(set(dst_block_ids)) != len(dst_block_ids):
        raise MessageError(f"{kind}: repeated destination block id")
    if not 0 < deadline_ms <= MAX_WAIT_MS:
        raise MessageError(f"{kind}: deadline_ms must be within 1..{MAX_WAIT_MS}")


@dataclass(frozen=True)
class PushRequest:
    """Requester -> holder: write the blocks with these hashes into the granted blocks of mine."""

    TYPE: ClassVar[str] = "push_request"
    request_id: str
    requester_id: str  # resolved in the holder's node directory (address, base, layout)
    grant_id: str
    dst_block_ids: list[int]
    block_hashes: list[bytes]
    deadline_ms: int  # the grant's lifetime: never write after this (from receipt)
    wait_ms: int = 0  # how long to wait for blocks still being computed (<= deadline_ms)
    landing: bool = False  # dst ids are landing slots, not KV blocks
    in_place: bool = False  # a writer on our host may copy into our shared memory (we fence it by its process)
    trace_context: str = ""  # the requester's span (W3C traceparent: kvmesh/tracing.py); "": not traced
    chunk_blocks: int = 0  # write at most this many blocks per chunk (landing: we check one as the next arrives)

    def validate(self) -> None:
        _check_grant(self.TYPE, self.grant_id, self.dst_block_ids, self.deadline_ms)
        check_trace_context(self.TYPE, self.trace_context)
        if not isinstance(self.chunk_blocks, int) or not 0 <= self.chunk_blocks <= MAX_BLOCKS_PER_REQUEST:
            raise MessageError(f"push_request: chunk_blocks must be within 0..{MAX_BLOCKS_PER_REQUEST}")
        if not 0 <= self.wait_ms <= self.deadline_ms:
            raise MessageError("push_request: wait_ms must be within 0..deadline_ms")
        if len(self.dst_block_ids) != len(self.block_hashes):
            raise MessageError("push_request: dst_block_ids and block_hashes differ in length")
        if any(len(h) != 16 for h in self.block_hashes):
            raise MessageError("push_request: block hashes must be 16 bytes")


@dataclass(frozen=True)
class ComputeAndPush:
    """Decode node -> prefill node: compute this prompt and write blocks ``first_block..`` into my grant.

    The prefill node hashes the prompt itself; block ``first_block + i`` of the
    prompt's chain goes to ``dst_block_ids[i]``. Answered at once with Accepted or
    Refused, then like a PushRequest. With ``with_tail`` the last id takes the
    prompt's last block (the one holding its last token, partial or whole), written
    once the whole prompt is computed, and the final PushResult carries the token
    the prefill node picked greedily after the prompt (``first_token_id``): a
    greedy requester streams it and decodes from there, any other computes the
    last token itself; the blocks before it must run up to that block. ``wanted_within_ms``: computing the blocks itself
    would cost the requester about this long (its own time and the wait that puts on
    the streams it decodes: ``FetchPlan.local_cost``), so a prefill node
    that cannot deliver them sooner (its own backlog included) refuses with BUSY
    (0: no limit); as does one that could not deliver them within ``deadline_ms``.
    """

    TYPE: ClassVar[str] = "compute_and_push"
    request_id: str
    requester_id: str
    grant_id: str
    prompt_token_ids: list[int]
    first_block: int
    dst_block_ids: list[int]
    deadline_ms: int
    wanted_within_ms: int = 0
    landing: bool = False  # dst ids are landing slots, not KV blocks
    in_place: bool = False  # a writer on our host may copy into our shared memory (we fence it by its process)
    cache_salt: str = ""  # the request's (its chain's root is salted with it)
    trace_context: str = ""  # the requester's span (W3C traceparent: kvmesh/tracing.py); "": not traced
    with_tail: bool = False  # the last dst id takes the prompt's partial last block

    def validate(self) -> None:
        _check_grant(self.TYPE, self.grant_id, self.dst_block_ids, self.deadline_ms)
        check_trace_context(self.TYPE, self.trace_context)
        if not isinstance(self.cache_salt, str) or len(self.cache_salt) > 256:
            raise MessageError("compute_and_push: cache_salt must be a string of at most 256 characters")
        if not self.prompt_token_ids or any(t < 0 for t in self.prompt_token_ids):
            raise MessageError("compute_and_push: empty prompt or negative token id")
        if self.first_block < 0:
            raise MessageError("compute_and_push: negative first_block")
        if not isinstance(self.wanted_within_ms, int) or self.wanted_within_ms < 0:
            raise MessageError("compute_and_push: wanted_within_ms must be an int >= 0")


@dataclass(frozen=True)
class Accepted:
    """Prefill node -> requester: the prompt is admitted; blocks follow as they are computed."""

    TYPE: ClassVar[str] = "accepted"
    request_id: str

    def validate(self) -> None:
        pass


@dataclass(frozen=True)
class Refused:
    """Writer -> requester: nothing was or will be written for this conversation."""

    TYPE: ClassVar[str] = "refused"
    request_id: str
    code: str
    reason: str = ""

    def validate(self) -> None:
        _check_code(self.TYPE, self.code)


@dataclass(frozen=True)
class PushResult:
    """Writer -> requester: which blocks were written (a chunk while ``final`` is False).

    A final result means the writer has stopped: it will never write into this grant again.
    """

    TYPE: ClassVar[str] = "push_result"
    request_id: str
    written: list[bool]  # per requested block
    final: bool = True
    code: str = ""  # ErrorCode when the transfer ended early (the written flags still hold)
    error: str = ""
    write_us: int = 0  # time the writer spent in the transfer engine so far (the receiver's bandwidth sample)
    checksums: list[int] = field(default_factory=list)  # crc32 of each written block's source bytes (0: none)
    num_reused: int = 0  # final, ComputeAndPush: leading written blocks the writer had cached (not computed)
    first_token_id: int = -1  # final, ComputeAndPush with its tail written: the greedy token after the prompt, or -1
    first_token_logprob: float = 0.0  # ... and its logprob

    def validate(self) -> None:
        _check_code(self.TYPE, self.code)
        if not isinstance(self.first_token_id, int) or self.first_token_id < -1:
            raise MessageError("push_result: first_token_id must be a token id or -1")
        if self.write_us < 0:
            raise MessageError("push_result: negative write_us")
        if not 0 <= self.num_reused <= len(self.written):
            raise MessageError("push_result: num_reused must be in 0..len(written)")
        if self.checksums and (len(self.checksums) != len(self.written) or
                               not all(0 <= c < 2**32 for c in self.checksums)):
            raise MessageError("push_result: checksums must be one crc32 per requested block")


@dataclass(frozen=True)
class Abort:
    """Either side: stop working on this conversation (the writer answers with its final PushResult)."""

    TYPE: ClassVar[str] = "abort"
    request_id: str
    reason: str = ""

    def validate(self) -> None:
        pass


Message = PushRequest | ComputeAndPush | Accepted | Refused | PushResult | Abort
_MESSAGES = (PushRequest, ComputeAndPush, Accepted, Refused, PushResult, Abort)
register(*_MESSAGES)


def decode(data: bytes) -> Message:
    """Decode a side-channel message (any other kvmesh message type is refused)."""
    return _decode(data, _MESSAGES)


__all__ = ["Abort", "Accepted", "ComputeAndPush", "ErrorCode", "MAX_WAIT_MS", "Message", "MessageError",
           "PushRequest", "PushResult", "Refused", "decode", "encode"]
