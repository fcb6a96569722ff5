"""The global block index: who holds which KV block (docs/design.md §5, docs/metadata.md).

``BlockPublisher`` (one per node) streams the node's holdings as records on its lease
(``metadata/holdings.py``): each flush writes one log record of what changed (a block cached,
with the fastest tier holding it: 0 the compute buffer, 1 host memory, 2 disk; or gone), from a
background thread; once the log since the last snapshot outgrows the holdings, a snapshot of
everything held replaces it, and the records before it are deleted. The first record after a
(new) lease is a snapshot. While etcd is unreachable the changes wait in a bounded queue and
land when it returns; past the bound new publishes are dropped (and counted) until the next
snapshot, which carries everything held. A dead node's records go with its lease.

``BlockIndex`` answers "which nodes hold how long a prefix of this chain" from a watch-fed mirror
of every node's records (a binary search per holder over in-memory sets: microseconds): a fresh
or resynced mirror reads the newest complete snapshot of each node and the log after it, then
follows the watch. ``lookup_direct`` answers the same from one listing of etcd (fallback and
cross-check). An unhealthy mirror answers "no remote hits" at once. The index is advisory: a
holder re-checks its own pool before it pushes.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from kvmesh.metadata import holdings as hd
from kvmesh.metadata.keys import KeyLayout
from kvmesh.metadata.mirror import PrefixMirror
from kvmesh.metadata.records import RecordError
from kvmesh.metadata.store import KeyValue, MetadataStore, StoreUnavailable

log = logging.getLogger("kvmesh.metadata")

SNAPSHOT_MIN_ENTRIES = 65_536  # a log shorter than this never triggers a snapshot


class BlockPublisher:
    def __init__(self, store: MetadataStore, cluster: str, namespace: str, node_id: str,
                 max_pending: int = 200_000, flush_interval_s: float = 0.05,
                 snapshot_min_entries: int = SNAPSHOT_MIN_ENTRIES, start: bool = True):
        """``start``: run the background flusher (else the caller calls ``flush``)."""
        self.store = store
        self.keys = KeyLayout(cluster)
        self.namespace = namespace
        self.node_id = node_id
        self.keys.holdings_log(namespace, node_id, 0)  # validates the names up front
        self.lease_id: int | None = None
        self.max_pending = max_pending
        self.snapshot_min_entries = snapshot_min_entries
        self._pending: dict[int, int] = {}  # block key -> tier to publish, or holdings.GONE
        self.held: dict[int, int] = {}  # what this node holds now and in which tier: the next snapshot
        self.num_dropped = 0
        self.num_published = 0  # entries written (log and snapshot)
        self.num_records = 0
        self.num_snapshots = 0
        self._seq = 0
        self._snapshot_due = True  # the first record on a lease is a snapshot
        self._log_entries = 0  # entries in log records since the newest snapshot
        self._live_keys: list[str] = []  # this node's records since (and with) the newest snapshot
        self._stale_keys: list[str] = []  # records a newer snapshot made redundant, to delete
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()  # one flush at a time: records go out in the order of their seq
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._interval = flush_interval_s
        self._thread = threading.Thread(target=self._run, name=f"kvmesh-publisher-{node_id}", daemon=True)
        if start:
            self._thread.start()

    def set_lease(self, lease_id: int) -> None:
        """Use a (new) lease: the next record is a snapshot of everything held, on it."""
        with self._lock:
            self.lease_id = lease_id
            self._snapshot_due = True
            self._stale_keys += self._live_keys  # gone with an expired lease; deleting them again is harmless
            self._live_keys = []
        self._wake.set()

    def publish(self, block_hashes: Sequence[bytes], tier: int = 0) -> None:
        self.update([(h, tier) for h in block_hashes])

    def unpublish(self, block_hashes: Sequence[bytes]) -> None:
        self.update([(h, None) for h in block_hashes])

    def update(self, changes: Sequence[tuple[bytes, int | None]]) -> None:
        """(hash, tier now holding it, or None: gone from this node); an unchanged tier is not re-sent."""
        if changes:  # the engine loop calls this every step; nothing new must not wake the flusher
            self.update_keys([(hd.block_key(h), hd.GONE if tier is None else tier) for h, tier in changes])

    def update_keys(self, changes: Iterable[tuple[int, int]]) -> None:
        """``update`` by block key (``holdings.block_key``) and code (a tier, or ``holdings.GONE``)."""
        queued = False
        with self._lock:
            held, pending = self.held, self._pending
            for k, code in changes:
                if code == hd.GONE:
                    if held.pop(k, None) is None and k not in pending:
                        continue
                elif held.get(k) == code:
                    continue
                else:
                    held[k] = code
                if k in pending:
                    del pending[k]  # the newest intent wins, in the order of its arrival
                elif code != hd.GONE and len(pending) >= self.max_pending:
                    self.num_dropped += 1  # full: keep what is queued (chain heads first) ...
                    self._snapshot_due = True  # ... and let the next flush write everything held
                    continue
                pending[k] = code
                queued = True
        if queued:
            self._wake.set()

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def _next_seq(self) -> int:
        """Above every record this node wrote, in this life or a previous one (the clock's nanoseconds)."""
        self._seq = max(self._seq + 1, time.time_ns())
        return self._seq

    def flush(self) -> bool:
        """Write what is pending (a snapshot when one is due); True when nothing is left. Any thread."""
        with self._flush_lock:
            return self._flush()

    def _flush(self) -> bool:
        with self._lock:
            if self.lease_id is None:
                return not self._pending and not self._snapshot_due
            lease, snapshot = self.lease_id, self._snapshot_due
            if snapshot:
                entries = list(self.held.items())
                folded = dict(self._pending)
            elif self._pending:
                entries = list(self._pending.items())
            else:
                return True
        try:
            if snapshot:
                written = self._write_snapshot(entries, lease)
            else:
                written = self._write_log(entries, lease)
        except (StoreUnavailable, KeyError):  # etcd down, or the lease expired (the registry calls set_lease)
            return False
        with self._lock:
            if lease != self.lease_id:
                return False  # a new lease came meanwhile: its snapshot is due
            done = folded if snapshot else dict(entries)
            for k, code in done.items():
                if self._pending.get(k) == code:
                    del self._pending[k]
            self.num_published += len(entries)
            if snapshot:
                self._snapshot_due = False
                self._stale_keys += self._live_keys
                self._live_keys, self._log_entries = written, 0
                self.num_snapshots += 1
            else:
                self._live_keys += written
                self._log_entries += len(entries)
                if self._log_entries > max(len(self.held), self.snapshot_min_entries):
                    self._snapshot_due = True  # the log outgrew the holdings: fold it
            stale, self._stale_keys = self._stale_keys, []
        if stale:
            try:
                self.store.delete_many(stale)
            except StoreUnavailable:
                with self._lock:
                    self._stale_keys = stale + self._stale_keys
        with self._lock:
            return not self._pending and not self._snapshot_due

    def _write_log(self, entries: list[tuple[int, int]], lease: int) -> list[str]:
        step = hd.MAX_RECORD_ENTRIES
        return self._put([KeyValue(self.keys.holdings_log(self.namespace, self.node_id, self._next_seq()),
                                   hd.encode_record(entries[i : i + step])) for i in range(0, len(entries), step)],
                         lease)

    def _write_snapshot(self, entries: list[tuple[int, int]], lease: int) -> list[str]:
        step, seq = hd.MAX_RECORD_ENTRIES, self._next_seq()
        num_parts = max(1, -(-len(entries) // step))
        return self._put([KeyValue(self.keys.holdings_snapshot(self.namespace, self.node_id, seq, part, num_parts),
                                   hd.encode_record(entries[part * step : (part + 1) * step]))
                          for part in range(num_parts)], lease)

    def _put(self, records: list[KeyValue], lease: int) -> list[str]:
        """Write ``records`` on ``lease``; their keys."""
        self.store.put_many(records, lease)
        self.num_records += len(records)
        return [kv.key for kv in records]

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(0.5)
            self._wake.clear()
            if not self.flush():
                self._stop.wait(self._interval * 10)  # etcd down or no lease yet: back off a little
            else:
                self._stop.wait(self._interval)  # coalesce bursts into fewer records

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)


class BlockIndex:
    """Read side: a mirror of one namespace's holdings records."""

    def __init__(self, store: MetadataStore, cluster: str, namespace: str):
        self.store = store
        self.keys = KeyLayout(cluster)
        self.namespace = namespace
        self.prefix = self.keys.holdings_of_namespace(namespace)
        self._table = hd.HoldingsTable()
        self._replaying = False
        self.num_skipped = 0
        self.mirror = PrefixMirror(store, self.prefix, self._apply, on_synced=self._synced)

    def _apply(self, kind: str, key: str, value: bytes, lease: int = 0) -> None:
        if kind == "reset":
            self._table, self._replaying = hd.HoldingsTable(), True
            return
        apply_record(self._table, self.keys, self.namespace, kind, key, value, self._replaying, self._skip)

    def _skip(self, key: str, why: str) -> None:
        self.num_skipped += 1
        log.warning("skipping holdings key %r: %s", key, why)

    def _synced(self) -> None:
        self._table.finish_replay()
        self._replaying = False

    def lookup(self, block_hashes: Sequence[bytes], exclude: str = "") -> dict[str, int]:
        """node_id -> number of leading blocks of the chain it holds (0-length nodes omitted).

        Served from the mirror; an unhealthy mirror (etcd unreachable) answers {} at once.
        """
        if not self.mirror.healthy:
            return {}
        return self._table.lookup(block_hashes, exclude)

    def slowest_tier(self, block_hashes: Sequence[bytes], node_id: str) -> int:
        """The slowest tier ``node_id`` holds these blocks in, per the mirror (0 when it lists none)."""
        return self._table.slowest_tier(block_hashes, node_id)

    def holds_any(self, node_id: str) -> bool:
        """Whether the mirror lists ``node_id`` at all (it goes when its records go)."""
        return node_id in self._table.nodes

    @property
    def num_blocks(self) -> int:
        """(block, holder) pairs the mirror lists."""
        return len(self._table)

    @property
    def table_bytes(self) -> int:
        """Bytes of the mirror's block maps (the Python objects around them excluded)."""
        return self._table.nbytes

    def lookup_direct(self, block_hashes: Sequence[bytes], exclude: str = "") -> dict[str, int]:
        """The same answer read from etcd itself (fallback and cross-check); {} when etcd is down."""
        try:
            table = read_holdings(self.store, self.keys, self.namespace).table
        except StoreUnavailable:
            return {}
        return table.lookup(block_hashes, exclude)

    def close(self) -> None:
        self.mirror.close()


def apply_record(table: hd.HoldingsTable, keys: KeyLayout, namespace: str | None, kind: str, key: str,
                 value: bytes, replaying: bool, skip) -> None:
    """One watched or listed change of a holdings key into ``table`` (``skip(key, why)`` for junk; ``namespace``
    None takes every namespace's)."""
    parsed = keys.parse_holdings(key)
    if parsed is None or namespace is not None and parsed.namespace != namespace:
        skip(key, "not a holdings key of this namespace")
        return
    state = table.nodes.get(parsed.node_id)
    if kind == "delete":
        if state is not None:
            state.keys.discard(key)
            if not state.keys:  # every record gone: its lease ended (a live node keeps its newest snapshot)
                table.remove(parsed.node_id)
        return
    try:
        entries = hd.decode_record(value)
    except RecordError as e:
        skip(key, str(e))
        return
    state = table.state(parsed.node_id)
    state.keys.add(key)
    if parsed.kind == hd.SNAPSHOT:
        table.change(parsed.node_id, state.add_snapshot_part(parsed, *entries))
    elif replaying:
        state.logs[parsed.seq] = entries  # applied after the listing, past the newest whole snapshot
    else:
        table.change(parsed.node_id, state.apply_log(parsed.seq, *entries))


class Listing(NamedTuple):
    table: hd.HoldingsTable
    revision: int  # etcd's revision of the listing


def read_holdings(store: MetadataStore, keys: KeyLayout, namespace: str | None = None) -> Listing:
    """Every node's holdings in ``namespace`` (None: in every namespace; a node publishes in one), from one
    listing of etcd (raises StoreUnavailable)."""
    items, revision = store.get_prefix(keys.holdings_of_namespace(namespace) if namespace else keys.holdings_prefix)
    table = hd.HoldingsTable()
    for kv in items:
        apply_record(table, keys, namespace, "put", kv.key, kv.value, True, lambda key, why: None)
    table.finish_replay()
    return Listing(table, revision)
