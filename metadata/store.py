"""MetadataStore: the few key-value operations kvmesh needs, over etcd or in memory.

Both backends give the same guarantees kvmesh relies on: atomic batches
(transactions), leases that take their keys with them when they expire, and
prefix watches that start from a revision, so a mirror can do "range read at
revision R, then watch from R + 1" without missing or repeating an event.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from kvmesh.errors import KvmeshError


class StoreUnavailable(KvmeshError, ConnectionError):
    """The metadata store cannot be reached (etcd down, network cut)."""


class KeyValue(NamedTuple):
    key: str
    value: bytes
    lease: int = 0  # the lease the key is attached to (reads fill it in; 0: none)


@dataclass(frozen=True, slots=True)
class WatchEvent:
    kind: str  # "put" | "delete"
    key: str
    value: bytes  # empty for deletes
    revision: int
    lease: int = 0


class CompactedError(KvmeshError):
    """A watch asked for a revision the store has compacted away: range-read again."""


# A watch callback gets a batch of events, or an exception when the watch broke.
WatchCallback = Callable[[list[WatchEvent] | BaseException], None]


class MetadataStore(Protocol):
    def grant_lease(self, ttl_s: int) -> int: ...

    def keepalive(self, lease_id: int) -> None:
        """Refresh a lease; raises StoreUnavailable, or KeyError when the lease has expired."""

    def revoke_lease(self, lease_id: int) -> None: ...

    def lease_alive(self, lease_id: int) -> bool:
        """Whether the lease still exists (raises StoreUnavailable)."""

    def put_many(self, items: Sequence[KeyValue], lease_id: int | None = None) -> None:
        """Write all items in one atomic batch (callers keep batches within the store's limits)."""

    def delete_many(self, keys: Sequence[str]) -> None: ...

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix`` and the revision the read saw."""

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """Point reads of several keys in one round trip."""

    def get_entries(self, keys: Sequence[str]) -> list[KeyValue | None]:
        """Point reads with each key's lease (None: absent)."""

    def watch_prefix(self, prefix: str, start_revision: int, callback: WatchCallback) -> Callable[[], None]:
        """Deliver every change under ``prefix`` from ``start_revision`` on; returns a cancel function."""

    def close(self) -> None: ...
