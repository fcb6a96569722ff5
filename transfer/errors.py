"""Typed transfer errors: every one names the request and the peer."""
from __future__ import annotations

from kvmesh.errors import KvmeshError


class TransferError(KvmeshError, RuntimeError):
    def __init__(self, message: str, *, request_id: str = "", peer: str = "", status: int | None = None):
        detail = ", ".join(x for x in (f"request {request_id}" if request_id else "", f"peer {peer}" if peer else "",
                                       f"status {status}" if status is not None else "") if x)
        super().__init__(f"{message} ({detail})" if detail else message)
        self.request_id, self.peer, self.status = request_id, peer, status


class TransferTimeout(TransferError):
    """No answer within the deadline: the peer may be dead or stuck.

    ``pending``: a write that is still running natively (a Future), when there is one.
    """

    pending = None


class TransferRefused(TransferError):
    """The writer refused the transfer up front (``code``: a ``messages.ErrorCode``); nothing was written."""

    def __init__(self, message: str, *, code: str, request_id: str = "", peer: str = ""):
        super().__init__(message, request_id=request_id, peer=peer)
        self.code = code


class TransferAborted(TransferError):
    """The other side aborted the request."""


def check_status(status: int, *, what: str, request_id: str = "", peer: str = "") -> None:
    """The one adapter for native int status codes: 0 is success, anything else raises."""
    if status != 0:
        raise TransferError(f"{what} failed", request_id=request_id, peer=peer, status=status)
