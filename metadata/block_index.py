"""The global block index: who holds which KV block (docs/design.md §5).

``BlockPublisher`` (one per node) writes ``/blocks/<ns>/<hash>/<node>`` for the
full blocks the node holds and deletes them when it evicts, in batched
transactions on the node's lease, from a background thread. While etcd is
unreachable the operations wait in a bounded queue and land when it returns;
past the bound new publishes are dropped (and counted), so the heads of chains
stay queued and the index never lists a chain's tail without its head. On a new
lease everything the node still holds is published again, in the order it came.

``BlockIndex`` answers "which nodes hold how long a prefix of this chain" from a
watch-fed mirror (microseconds), with a direct read of etcd as fallback and
cross-check. An unhealthy mirror answers "no remote hits" at once. The index is
advisory: a holder re-checks its own pool before it pushes.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

from kvmesh.metadata.keys import KeyLayout
from kvmesh.metadata.mirror import PrefixMirror
from kvmesh.metadata.records import BlockEntry, RecordError
from kvmesh.metadata.store import KeyValue, MetadataStore, StoreUnavailable

log = logging.getLogger("kvmesh.metadata")


class BlockPublisher:
    def __init__(self, store: MetadataStore, cluster: str, namespace: str, node_id: str,
                 max_pending: int = 200_000, flush_interval_s: float = 0.05):
        self.store = store
        self.keys = KeyLayout(cluster)
        self.namespace = namespace
        self.node_id = node_id
        self.keys.block(namespace, b"\0" * 16, node_id)  # validates the names up front
        self.lease_id: int | None = None
        self.max_pending = max_pending
        self._pending: OrderedDict[bytes, bool] = OrderedDict()  # hash -> True publish / False unpublish
        self.held: dict[bytes, None] = {}  # what this node holds now (ordered), to re-publish on a new lease
        self.num_dropped = 0
        self.num_published = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._interval = flush_interval_s
        self._thread = threading.Thread(target=self._run, name=f"kvmesh-publisher-{node_id}", daemon=True)
        self._thread.start()

    def set_lease(self, lease_id: int) -> None:
        """Use a (new) lease; everything held is queued for publishing again."""
        with self._lock:
            self.lease_id = lease_id
            for h in self.held:
                self._queue(h, True)
        self._wake.set()

    def publish(self, block_hashes: Sequence[bytes]) -> None:
        if not block_hashes:
            return  # the engine loop calls this every step; nothing new must not wake the flusher
        with self._lock:
            for h in block_hashes:
                self.held[h] = None
                self._queue(h, True)
        self._wake.set()

    def unpublish(self, block_hashes: Sequence[bytes]) -> None:
        if not block_hashes:
            return
        with self._lock:
            for h in block_hashes:
                self.held.pop(h, None)
                self._queue(h, False)
        self._wake.set()

    def _queue(self, block_hash: bytes, put: bool) -> None:
        if block_hash in self._pending:
            del self._pending[block_hash]  # the newest intent wins
        elif put and len(self._pending) >= self.max_pending:
            self.num_dropped += 1  # full: keep the chain heads already queued, drop this later block
            return
        self._pending[block_hash] = put

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def flush(self) -> bool:
        """Write what is pending; True when nothing is left. Safe to call from any thread."""
        with self._lock:
            if self.lease_id is None or not self._pending:
                return not self._pending
            batch = list(self._pending.items())
            lease = self.lease_id
        now = BlockEntry(time.time()).encode()
        puts = [KeyValue(self.keys.block(self.namespace, h, self.node_id), now) for h, put in batch if put]
        deletes = [self.keys.block(self.namespace, h, self.node_id) for h, put in batch if not put]
        try:
            if puts:
                self.store.put_many(puts, lease)
            if deletes:
                self.store.delete_many(deletes)
        except StoreUnavailable:
            return False
        except KeyError:  # the lease expired: the registry grants a new one and calls set_lease
            return False
        with self._lock:
            for h, put in batch:
                if self._pending.get(h) is put:
                    del self._pending[h]
            self.num_published += len(puts)
            return not self._pending

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(0.5)
            self._wake.clear()
            if not self.flush():
                self._stop.wait(self._interval * 10)  # etcd down or no lease yet: back off a little
            else:
                self._stop.wait(self._interval)  # coalesce bursts into fewer transactions

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)


class BlockIndex:
    """Read side: a mirror of one namespace's block keys."""

    def __init__(self, store: MetadataStore, cluster: str, namespace: str):
        self.store = store
        self.keys = KeyLayout(cluster)
        self.namespace = namespace
        self.prefix = self.keys.blocks_of_namespace(namespace)
        self._holders: dict[bytes, set[str]] = {}
        self.num_skipped = 0
        self.mirror = PrefixMirror(store, self.prefix, self._apply)

    def _apply(self, kind: str, key: str, value: bytes) -> None:
        if kind == "reset":
            self._holders = {}
            return
        parsed = self.keys.parse_block(key)
        if parsed is None or parsed.namespace != self.namespace:
            self.num_skipped += 1
            log.warning("skipping a key that is not a block key: %r", key)
            return
        if kind == "delete":
            nodes = self._holders.get(parsed.block_hash)
            if nodes is not None:
                nodes.discard(parsed.node_id)
                if not nodes:
                    del self._holders[parsed.block_hash]
            return
        try:
            BlockEntry.decode(value)
        except RecordError as e:
            self.num_skipped += 1
            log.warning("skipping block key %r: %s", key, e)
            return
        self._holders.setdefault(parsed.block_hash, set()).add(parsed.node_id)

    def lookup(self, block_hashes: Sequence[bytes], exclude: str = "") -> dict[str, int]:
        """node_id -> number of leading blocks of the chain it holds (0-length nodes omitted).

        Served from the mirror; an unhealthy mirror (etcd unreachable) answers {} at once.
        """
        if not self.mirror.healthy or not block_hashes:
            return {}
        holders = self._holders
        first = holders.get(block_hashes[0])
        if not first:
            return {}
        out = {}
        for node in list(first):
            if node == exclude:
                continue
            out[node] = _prefix_length(lambda i, n=node: n in holders.get(block_hashes[i], ()), len(block_hashes))
        return out

    def lookup_direct(self, block_hashes: Sequence[bytes], exclude: str = "") -> dict[str, int]:
        """The same answer read from etcd itself (fallback and cross-check); {} when etcd is down."""
        cache: dict[int, set[str]] = {}

        def holders_at(i: int) -> set[str]:
            if i not in cache:
                items, _ = self.store.get_prefix(f"{self.prefix}{block_hashes[i].hex()}/")
                cache[i] = {p.node_id for kv in items if (p := self.keys.parse_block(kv.key)) is not None}
            return cache[i]

        try:
            if not block_hashes:
                return {}
            return {node: _prefix_length(lambda i, n=node: n in holders_at(i), len(block_hashes))
                    for node in holders_at(0) if node != exclude}
        except StoreUnavailable:
            return {}

    def close(self) -> None:
        self.mirror.close()


def _prefix_length(holds, n: int) -> int:
    """Length of the prefix ``[0, k)`` with ``holds(i)`` true, by binary search.

    Nodes publish whole chains and evict tails first, so what a node holds of a
    chain is a prefix; where the index is stale the answer is advisory anyway.
    """
    if holds(n - 1):
        return n
    lo, hi = 0, n - 1  # holds(lo) is true (the caller checked block 0); holds(hi) is false
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if holds(mid):
            lo = mid
        else:
            hi = mid
    return lo + 1
