"""In-memory MetadataStore for a single process: revisions, leases with expiry, prefix watches.

A watch starts from the revision it names, as etcd's does: the changes since then that are still in the
bounded history are delivered first (older ones: a ``CompactedError``), so a reader that listed at R and
watches from R + 1 misses nothing written in between."""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence

from kvmesh.metadata.store import CompactedError, KeyValue, WatchCallback, WatchEvent

MAX_HISTORY = 100_000  # events kept for watches that start in the past


class MemoryStore:
    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._data: dict[str, tuple[bytes, int | None]] = {}  # key -> (value, lease)
        self._revision = 1
        self._leases: dict[int, tuple[float, int]] = {}  # id -> (deadline, ttl)
        self._next_lease = 1
        self._watches: dict[int, tuple[str, WatchCallback]] = {}
        self._next_watch = 1
        self._history: deque[WatchEvent] = deque(maxlen=MAX_HISTORY)

    def grant_lease(self, ttl_s: int) -> int:
        with self._lock:
            lease = self._next_lease
            self._next_lease += 1
            self._leases[lease] = (time.monotonic() + ttl_s, ttl_s)
            return lease

    def keepalive(self, lease_id: int) -> None:
        with self._lock:
            self._expire()
            if lease_id not in self._leases:
                raise KeyError(f"lease {lease_id} has expired")
            ttl = self._leases[lease_id][1]
            self._leases[lease_id] = (time.monotonic() + ttl, ttl)

    def lease_alive(self, lease_id: int) -> bool:
        with self._lock:
            self._expire()
            return lease_id in self._leases

    def revoke_lease(self, lease_id: int) -> None:
        with self._lock:
            self._leases.pop(lease_id, None)
            self._drop_keys_of({lease_id})

    def put_many(self, items: Sequence[KeyValue], lease_id: int | None = None) -> None:
        with self._lock:
            self._expire()
            if lease_id is not None and lease_id not in self._leases:
                raise KeyError(f"lease {lease_id} has expired")
            self._revision += 1
            events = []
            for key, value, *_ in items:
                self._data[key] = (value, lease_id)
                events.append(WatchEvent("put", key, value, self._revision, lease_id or 0))
            self._notify(events)

    def delete_many(self, keys: Sequence[str]) -> None:
        with self._lock:
            self._revision += 1
            events = [WatchEvent("delete", k, b"", self._revision) for k in keys if self._data.pop(k, None)]
            self._notify(events)

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        with self._lock:
            self._expire()
            items = [KeyValue(k, v, lease or 0) for k, (v, lease) in sorted(self._data.items()) if k.startswith(prefix)]
            return items, self._revision

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return [kv.value if kv is not None else None for kv in self.get_entries(keys)]

    def get_entries(self, keys: Sequence[str]) -> list[KeyValue | None]:
        with self._lock:
            self._expire()
            return [KeyValue(k, self._data[k][0], self._data[k][1] or 0) if k in self._data else None for k in keys]

    def watch_prefix(self, prefix: str, start_revision: int, callback: WatchCallback):
        with self._lock:
            if len(self._history) == MAX_HISTORY and start_revision < self._history[0].revision:
                callback(CompactedError(f"revision {start_revision} is compacted"))
                return lambda: None
            missed = [e for e in self._history if e.revision >= start_revision and e.key.startswith(prefix)]
            if missed:
                callback(missed)
            watch_id = self._next_watch
            self._next_watch += 1
            self._watches[watch_id] = (prefix, callback)
        return lambda: self._watches.pop(watch_id, None)

    def close(self) -> None:
        self._watches.clear()

    def _expire(self) -> None:
        now = time.monotonic()
        dead = {lease for lease, (deadline, _) in self._leases.items() if deadline < now}
        for lease in dead:
            del self._leases[lease]
        if dead:
            self._drop_keys_of(dead)

    def _drop_keys_of(self, leases: set[int]) -> None:
        keys = [k for k, (_, lease) in self._data.items() if lease in leases]
        if keys:
            self.delete_many(keys)

    def _notify(self, events: list[WatchEvent]) -> None:
        self._history.extend(events)
        for prefix, callback in list(self._watches.values()):
            mine = [e for e in events if e.key.startswith(prefix)]
            if mine:
                callback(mine)
