"""NodeRegistry: a node's record under ``/kvmesh/<c>/nodes/<id>`` on a lease kept alive.

If the lease is lost (etcd was down longer than the TTL) a new one is granted
and the record re-written; ``on_new_lease`` listeners (the block publisher) then
re-publish what they hold. Watchers learn of joins and deaths through a mirror
of the nodes prefix.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvmesh.metadata.keys import KeyLayout
from kvmesh.metadata.mirror import PrefixMirror
from kvmesh.metadata.records import NodeRecord, RecordError
from kvmesh.metadata.store import KeyValue, MetadataStore, StoreUnavailable

log = logging.getLogger("kvmesh.metadata")


class NodeRegistry:
    def __init__(self, store: MetadataStore, cluster: str, ttl_s: int = 10):
        self.store = store
        self.keys = KeyLayout(cluster)
        self.ttl_s = ttl_s
        self.lease_id: int | None = None
        self.record: NodeRecord | None = None
        self._listeners: list[Callable[[int], None]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def on_new_lease(self, listener: Callable[[int], None]) -> None:
        self._listeners.append(listener)

    def register(self, record: NodeRecord) -> int:
        """Write the record on a fresh lease and keep it alive; returns the lease id."""
        self.keys.node(record.node_id)  # validates the id
        self.record = record
        self._new_lease()
        self._thread = threading.Thread(target=self._keepalive, name=f"kvmesh-lease-{record.node_id}", daemon=True)
        self._thread.start()
        return self.lease_id

    def update(self, record: NodeRecord) -> None:
        """Re-write the record (load changes) on the current lease."""
        self.record = record
        self.store.put_many([KeyValue(self.keys.node(record.node_id), record.encode())], self.lease_id)

    def _new_lease(self) -> None:
        self.lease_id = self.store.grant_lease(self.ttl_s)
        self.store.put_many([KeyValue(self.keys.node(self.record.node_id), self.record.encode())], self.lease_id)
        for listener in self._listeners:
            listener(self.lease_id)

    def _keepalive(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self.store.keepalive(self.lease_id)
            except KeyError:
                log.warning("node %s: lease expired; registering again", self.record.node_id)
                try:
                    self._new_lease()
                except StoreUnavailable:
                    pass
            except StoreUnavailable:
                pass  # keep trying; the lease lives ttl_s past the last refresh

    def deregister(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.lease_id is not None:
            try:
                self.store.revoke_lease(self.lease_id)
            except StoreUnavailable:
                pass  # the lease expires by itself
            self.lease_id = None


class NodeDirectory:
    """Everyone's node records, from a mirror; ``on_event(kind, node_id, record)`` for joins and deaths."""

    def __init__(self, store: MetadataStore, cluster: str,
                 on_event: Callable[[str, str, NodeRecord | None], None] | None = None):
        self.keys = KeyLayout(cluster)
        self.nodes: dict[str, NodeRecord] = {}
        self._on_event = on_event
        self.mirror = PrefixMirror(store, self.keys.nodes_prefix, self._apply)

    def _apply(self, kind: str, key: str, value: bytes) -> None:
        if kind == "reset":
            self.nodes = {}
            return
        node_id = self.keys.parse_node(key)
        if node_id is None:
            log.warning("skipping a key that is not a node key: %r", key)
            return
        if kind == "delete":
            if self.nodes.pop(node_id, None) is not None and self._on_event:
                self._on_event("left", node_id, None)
            return
        try:
            record = NodeRecord.decode(value)
        except RecordError as e:
            log.warning("skipping node %s: %s", node_id, e)
            return
        joined = node_id not in self.nodes
        self.nodes[node_id] = record
        if self._on_event:
            self._on_event("joined" if joined else "updated", node_id, record)

    def close(self) -> None:
        self.mirror.close()


def wait_for_nodes(etcd: str, cluster: str, node_ids: set[str], timeout_s: float = 120.0) -> None:
    """Block until every node in ``node_ids`` is registered in ``cluster`` (launchers use it)."""
    import time

    from kvmesh.metadata.etcd_store import EtcdStore

    store = EtcdStore(etcd)
    directory = NodeDirectory(store, cluster)
    try:
        deadline = time.monotonic() + timeout_s
        while not node_ids <= set(directory.nodes):
            if time.monotonic() > deadline:
                raise TimeoutError(f"nodes {sorted(node_ids - set(directory.nodes))} did not register "
                                   f"within {timeout_s} s")
            time.sleep(0.05)
    finally:
        directory.close()
        store.close()
