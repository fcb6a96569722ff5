"""The global block index: who holds which KV block (docs/design.md §5).

``BlockPublisher`` (one per node) writes ``/blocks/<ns>/<hash>/<node>`` for the
full blocks the node holds (the value names the fastest tier holding it: 0 the
compute buffer, 1 host memory, 2 disk; docs/tiers.md) and deletes them when the
block leaves the node, in batched
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
        self._pending: OrderedDict[bytes, int | None] = OrderedDict()  # hash -> tier to publish, None: unpublish
        self.held: dict[bytes, int] = {}  # what this node holds now (ordered) and in which tier, for a new lease
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
            for h, tier in self.held.items():
                self._queue(h, tier)
        self._wake.set()

    def publish(self, block_hashes: Sequence[bytes], tier: int = 0) -> None:
        self.update([(h, tier) for h in block_hashes])

    def unpublish(self, block_hashes: Sequence[bytes]) -> None:
        self.update([(h, None) for h in block_hashes])

    def update(self, changes: Sequence[tuple[bytes, int | None]]) -> None:
        """(hash, tier now holding it, or None: gone from this node); an unchanged tier is not re-sent."""
        if not changes:
            return  # the engine loop calls this every step; nothing new must not wake the flusher
        queued = False
        with self._lock:
            for h, tier in changes:
                if tier is None:
                    if self.held.pop(h, None) is None and h not in self._pending:
                        continue
                elif self.held.get(h) == tier:
                    continue
                else:
                    self.held[h] = tier
                self._queue(h, tier)
                queued = True
        if queued:
            self._wake.set()

    def _queue(self, block_hash: bytes, tier: int | None) -> None:
        put = tier is not None
        if block_hash in self._pending:
            del self._pending[block_hash]  # the newest intent wins
        elif put and len(self._pending) >= self.max_pending:
            self.num_dropped += 1  # full: keep the chain heads already queued, drop this later block
            return
        self._pending[block_hash] = tier

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
        now = time.time()
        values = {tier: BlockEntry(now, tier).encode() for tier in {t for _, t in batch if t is not None}}
        key = self.keys.block
        puts = [KeyValue(key(self.namespace, h, self.node_id), values[t]) for h, t in batch if t is not None]
        deletes = [key(self.namespace, h, self.node_id) for h, t in batch if t is None]
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
            for h, tier in batch:
                if h in self._pending and self._pending[h] == tier:
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
        self._holders: dict[bytes, dict[str, int]] = {}  # hash -> node -> tier
        self.num_skipped = 0
        self.mirror = PrefixMirror(store, self.prefix, self._apply)

    def _apply(self, kind: str, key: str, value: bytes, lease: int = 0) -> None:
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
                nodes.pop(parsed.node_id, None)
                if not nodes:
                    del self._holders[parsed.block_hash]
            return
        try:
            entry = BlockEntry.decode(value)
        except RecordError as e:
            self.num_skipped += 1
            log.warning("skipping block key %r: %s", key, e)
            return
        self._holders.setdefault(parsed.block_hash, {})[parsed.node_id] = entry.tier

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

    def slowest_tier(self, block_hashes: Sequence[bytes], node_id: str) -> int:
        """The slowest tier ``node_id`` holds these blocks in, per the mirror (0 when it lists none)."""
        holders = self._holders
        return max((holders.get(h, {}).get(node_id, 0) for h in block_hashes), default=0)

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
