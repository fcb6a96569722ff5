"""RequestStatus: the one state machine of a request (docs/design.md §7) and its one transition point.

    WAITING ──> WAITING_FOR_REMOTE_KV ──> RUNNING ──> FINISHED
       │                                   │  ^
       │                                   v  │
       └──────────────────────> RUNNING  PREEMPTED ──> WAITING
    any live state ──> FAILED | ABORTED

A transfer that fails still goes WAITING_FOR_REMOTE_KV -> RUNNING, with whatever
prefix arrived (possibly none) counted as computed; the rest is computed locally.
A request whose KV came with its first token (a prefill node's greedy pick) that
ended it goes WAITING_FOR_REMOTE_KV -> FINISHED.
"""
from __future__ import annotations

import enum

from kvmesh.errors import KvmeshError


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    FAILED = "failed"
    ABORTED = "aborted"

    @property
    def is_final(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.FAILED, RequestStatus.ABORTED)


class IllegalTransitionError(KvmeshError, RuntimeError):
    pass


_S = RequestStatus
_ALLOWED: dict[RequestStatus, frozenset[RequestStatus]] = {
    _S.WAITING: frozenset({_S.RUNNING, _S.WAITING_FOR_REMOTE_KV, _S.FAILED, _S.ABORTED}),
    # (FINISHED: the token that came with its KV ended it, ``LLMEngine.accept_first_token``)
    _S.WAITING_FOR_REMOTE_KV: frozenset({_S.RUNNING, _S.FINISHED, _S.FAILED, _S.ABORTED}),
    _S.RUNNING: frozenset({_S.FINISHED, _S.PREEMPTED, _S.FAILED, _S.ABORTED}),
    _S.PREEMPTED: frozenset({_S.WAITING, _S.FAILED, _S.ABORTED}),
    _S.FINISHED: frozenset(),
    _S.FAILED: frozenset(),
    _S.ABORTED: frozenset(),
}


def transition(seq, new_status: RequestStatus) -> None:
    """Move ``seq`` (anything with ``status`` and ``request_id``) to ``new_status`` or raise."""
    if new_status not in _ALLOWED[seq.status]:
        raise IllegalTransitionError(
            f"request {seq.request_id}: illegal transition {seq.status.name} -> {new_status.name}")
    seq.status = new_status
