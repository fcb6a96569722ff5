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
                self._restore_record()
            except KeyError:
                log.warning("node %s: lease expired; registering again", self.record.node_id)
                try:
                    self._new_lease()
                except StoreUnavailable:
                    pass
            except StoreUnavailable:
                pass  # keep trying; the lease lives ttl_s past the last refresh

    def _restore_record(self) -> None:
        """Write our record back if someone deleted or replaced it (readers drop values without our MAC).
        Never raises: the keepalive loop it runs in must outlive any failure here."""
        key = self.keys.node(self.record.node_id)
        try:
            current = self.store.get_entries([key])[0]
            if current is None or current.lease != self.lease_id or current.value != self.record.encode():
                log.warning("node %s: our record in etcd was deleted or replaced; writing it back",
                            self.record.node_id)
                self.store.put_many([KeyValue(key, self.record.encode())], self.lease_id)
        except KeyError:
            raise  # the lease is gone: the loop registers again
        except Exception as e:  # etcd down or our store closing: the next round tries again
            log.debug("node %s: could not check our record: %s", self.record.node_id, e)

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
    """Everyone's node records, from a mirror; ``on_event(kind, node_id, record)`` for joins and deaths.

    A node has left when its record is gone *and* its lease has ended: a record deleted while its lease
    lives (by a process that can write to etcd, not by the node) is ignored and counted in
    ``num_deletes_ignored``; the node's registry writes it back, and until then its lease is checked every
    ``recheck_s``, so a node that dies meanwhile still leaves. Records that fail validation are dropped
    before anyone connects to them (``num_invalid``)."""

    recheck_s = 1.0

    def __init__(self, store: MetadataStore, cluster: str,
                 on_event: Callable[[str, str, NodeRecord | None], None] | None = None):
        self.keys = KeyLayout(cluster)
        self.store = store
        self.nodes: dict[str, NodeRecord] = {}
        self._leases: dict[str, int] = {}
        self._orphans: set[str] = set()  # deleted while their lease lived: not believed yet
        self._closed = threading.Event()
        self.num_deletes_ignored = 0
        self.num_invalid = 0
        self._on_event = on_event
        self.mirror = PrefixMirror(store, self.keys.nodes_prefix, self._apply)

    def _lease_ended(self, node_id: str) -> bool:
        lease = self._leases.get(node_id, 0)
        try:
            return not (lease and self.store.lease_alive(lease))
        except Exception:  # cannot tell (etcd down, our store closing): gone; a live node registers again
            return True

    def _left(self, node_id: str) -> None:
        self._orphans.discard(node_id)
        self._leases.pop(node_id, None)
        if self.nodes.pop(node_id, None) is not None and self._on_event:
            self._on_event("left", node_id, None)

    def _recheck(self, node_id: str) -> None:
        """A record deleted under a live lease: it left once the lease ends, unless the record came back."""
        if self._closed.is_set() or node_id not in self._orphans:
            return
        if self._lease_ended(node_id):
            self._left(node_id)
            return
        timer = threading.Timer(self.recheck_s, self._recheck, (node_id,))
        timer.daemon = True
        timer.start()

    def _apply(self, kind: str, key: str, value: bytes, lease: int = 0) -> None:
        if kind == "reset":
            self.nodes, self._leases = {}, {}
            return
        node_id = self.keys.parse_node(key)
        if node_id is None:
            log.warning("skipping a key that is not a node key: %r", key)
            return
        if kind == "delete":
            if node_id not in self.nodes:
                return
            if self._lease_ended(node_id):
                self._left(node_id)
            else:
                self.num_deletes_ignored += 1
                log.warning("the record of node %s was deleted while its lease lives: ignored", node_id)
                self._orphans.add(node_id)
                self._recheck(node_id)
            return
        try:
            record = NodeRecord.decode(value)
            if record.node_id != node_id:
                raise RecordError(f"names node {record.node_id!r}")
        except RecordError as e:
            self.num_invalid += 1
            log.warning("skipping node %s: %s", node_id, e)
            return
        self._leases[node_id] = lease
        self._orphans.discard(node_id)
        joined = node_id not in self.nodes
        self.nodes[node_id] = record
        if self._on_event:
            self._on_event("joined" if joined else "updated", node_id, record)

    def close(self) -> None:
        self._closed.set()
        self.mirror.close()


def wait_for_nodes(etcd: str, cluster: str, node_ids: set[str], timeout_s: float = 120.0, token: str = "") -> None:
    """Block until every node in ``node_ids`` is registered in ``cluster`` (launchers use it)."""
    import time

    from kvmesh.metadata.sealed_store import open_store

    store = open_store(etcd, token)
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
