"""The global block index as it was before holdings records: one etcd key per (block, holder).

    /kvmesh/<c>/blocks/<ns>/<hash_hex>/<node_id>  -> [publish time] or [publish time, tier] (msgpack), on the
                                                     holder's lease

Kept only as ``kvmesh bench index``'s baseline (the same fill, churn and lookups measured against
it, in the same run): a publisher writing batched transactions of per-block puts and deletes, and a
watch-fed mirror of hash -> holders with the same binary-search lookup.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import msgpack

from kvmesh.metadata.holdings import GONE
from kvmesh.metadata.keys import check_name
from kvmesh.metadata.mirror import PrefixMirror
from kvmesh.metadata.store import KeyValue, MetadataStore


def _prefix(cluster: str, namespace: str) -> str:
    return f"/kvmesh/{check_name('cluster', cluster)}/blocks/{check_name('namespace', namespace)}/"


class KeyPerBlockPublisher:
    """Flushed by its caller (no thread): ``update_keys`` then ``flush``."""

    def __init__(self, store: MetadataStore, cluster: str, namespace: str, node_id: str):
        self.store, self.node_id = store, check_name("node", node_id)
        self.prefix = _prefix(cluster, namespace)
        self.lease_id: int | None = None
        self._pending: dict[bytes, int] = {}
        self.num_published = 0

    def set_lease(self, lease_id: int) -> None:
        self.lease_id = lease_id

    def update_hashes(self, changes: Iterable[tuple[bytes, int]]) -> None:
        """(16-byte block hash, tier or holdings.GONE)."""
        for h, code in changes:
            self._pending.pop(h, None)
            self._pending[h] = code

    def flush(self) -> bool:
        batch, self._pending = list(self._pending.items()), {}
        now = time.time()
        values = {t: msgpack.packb([now, t] if t else [now]) for t in {c for _, c in batch if c != GONE}}
        puts = [KeyValue(f"{self.prefix}{h.hex()}/{self.node_id}", values[c]) for h, c in batch if c != GONE]
        deletes = [f"{self.prefix}{h.hex()}/{self.node_id}" for h, c in batch if c == GONE]
        if puts:
            self.store.put_many(puts, self.lease_id)
        if deletes:
            self.store.delete_many(deletes)
        self.num_published += len(puts)
        return True

    def close(self) -> None:
        pass


class KeyPerBlockIndex:
    def __init__(self, store: MetadataStore, cluster: str, namespace: str):
        self.prefix = _prefix(cluster, namespace)
        self._holders: dict[bytes, set[str]] = {}
        self.mirror = PrefixMirror(store, self.prefix, self._apply)

    def _apply(self, kind: str, key: str, value: bytes, lease: int = 0) -> None:
        if kind == "reset":
            self._holders = {}
            return
        hash_hex, _, node_id = key[len(self.prefix):].partition("/")
        h = bytes.fromhex(hash_hex)
        if kind == "delete":
            nodes = self._holders.get(h)
            if nodes is not None:
                nodes.discard(node_id)
                if not nodes:
                    del self._holders[h]
        else:
            self._holders.setdefault(h, set()).add(node_id)

    @property
    def num_blocks(self) -> int:
        return sum(len(n) for n in list(self._holders.values()))

    def lookup(self, block_hashes: Sequence[bytes], exclude: str = "") -> dict[str, int]:
        if not self.mirror.healthy or not block_hashes:
            return {}
        holders = self._holders
        first = holders.get(block_hashes[0])
        if not first:
            return {}
        return {node: _prefix_length(lambda i, n=node: n in holders.get(block_hashes[i], ()), len(block_hashes))
                for node in list(first) if node != exclude}

    def holds_any(self, node_id: str) -> bool:
        return any(node_id in nodes for nodes in list(self._holders.values()))

    def close(self) -> None:
        self.mirror.close()


def _prefix_length(holds, n: int) -> int:
    """Length of the prefix ``[0, k)`` with ``holds(i)`` true, by binary search (the caller checked block 0).

    Nodes publish whole chains and evict tails first, so what a node holds of a chain is a prefix; where the
    index is stale the answer is advisory anyway.
    """
    if holds(n - 1):
        return n
    lo, hi = 0, n - 1  # holds(lo) is true; holds(hi) is false
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if holds(mid):
            lo = mid
        else:
            hi = mid
    return lo + 1
