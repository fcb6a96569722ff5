"""PrefixMirror: an in-memory copy of every key under a prefix, kept current by a watch.

Revision-consistent: range-read the prefix at revision R, then watch from R + 1,
so no event is missed or applied twice. When the watch breaks (etcd down, the
revision compacted) the mirror marks itself unhealthy and a background thread
resyncs (a fresh range read, a fresh watch) until it succeeds. Readers check
``healthy`` and treat an unhealthy mirror as "knows nothing".
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvmesh.metadata.store import MetadataStore, StoreUnavailable, WatchEvent

log = logging.getLogger("kvmesh.metadata")

# on_change(kind, key, value, lease): kind "put" | "delete" | "reset" (key/value empty: the copy was rebuilt);
# lease: the lease a put key is attached to (0: none, and for deletes)
ChangeCallback = Callable[[str, str, bytes, int], None]


class PrefixMirror:
    def __init__(self, store: MetadataStore, prefix: str, on_change: ChangeCallback,
                 retry_interval_s: float = 0.5, on_synced: Callable[[], None] | None = None):
        """``on_synced``: called (under the mirror's lock) after a listing was replayed through ``on_change``,
        before the watch's first event: for readers that resolve a listing as a whole."""
        self.store = store
        self.prefix = prefix
        self._on_change = on_change
        self._on_synced = on_synced
        self._retry = retry_interval_s
        self._lock = threading.Lock()
        self._healthy = threading.Event()
        self._stop = threading.Event()
        self._cancel_watch: Callable[[], None] | None = None
        self._generation = 0  # events from an older watch are ignored
        self.revision = 0
        self.num_resyncs = 0
        self._thread = threading.Thread(target=self._keep_synced, name=f"kvmesh-mirror{prefix}", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self._healthy.is_set()

    def wait_healthy(self, timeout_s: float) -> bool:
        return self._healthy.wait(timeout_s)

    def _keep_synced(self) -> None:
        while not self._stop.is_set():
            if not self._healthy.is_set():
                try:
                    self._resync()
                except StoreUnavailable:
                    pass
                except Exception:  # never let the sync thread die
                    log.exception("mirror %s: resync failed", self.prefix)
            self._stop.wait(self._retry)

    def _resync(self) -> None:
        items, revision = self.store.get_prefix(self.prefix)
        with self._lock:
            if self._cancel_watch is not None:
                self._cancel_watch()
            self._generation += 1
            generation = self._generation
            self.revision = revision
            self._on_change("reset", "", b"", 0)
            for kv in items:
                self._on_change("put", kv.key, kv.value, kv.lease)
            if self._on_synced is not None:
                self._on_synced()
        self._cancel_watch = self.store.watch_prefix(
            self.prefix, revision + 1, lambda batch: self._on_watch(generation, batch))
        self.num_resyncs += 1
        self._healthy.set()

    def _on_watch(self, generation: int, batch: list[WatchEvent] | BaseException) -> None:
        with self._lock:
            if generation != self._generation:
                return
            if isinstance(batch, BaseException):
                if self._stop.is_set():  # our own close cancelled the watch: nothing broke
                    return
                log.warning("mirror %s: watch broke (%s); resyncing", self.prefix, type(batch).__name__)
                self._healthy.clear()
                return
            try:
                for event in batch:
                    self._on_change(event.kind, event.key, event.value, event.lease)
                    self.revision = max(self.revision, event.revision)  # after: a reader of it sees the event
            except Exception:  # a change half applied: start over from a listing rather than drift
                log.exception("mirror %s: applying a change failed; resyncing", self.prefix)
                self._healthy.clear()

    def mark_unhealthy(self) -> None:
        """Force a resync (used when a caller learns the store was unreachable)."""
        self._healthy.clear()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self._cancel_watch is not None:
            self._cancel_watch()
