"""ClusterMembership: a node's part of the etcd metadata (docs/design.md §5).

Its record on a kept-alive lease (NodeRegistry), the publisher of the blocks it
holds, the global block index it looks prefixes up in, and the directory of
the other nodes: where their side channels, transfer endpoints and KV buffers
are (``peer``), and who left (``on_peer_left``, fed by lease expiry).
Construction connects nothing; ``start`` syncs the mirrors and registers.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvmesh.metadata.block_index import BlockIndex, BlockPublisher
from kvmesh.metadata.keys import InvalidNameError, KeyLayout
from kvmesh.metadata.sealed_store import open_store
from kvmesh.metadata.pins import PinRegistry
from kvmesh.metadata.records import ComputeProbe, NodeRecord, PinRecord, RecordError
from kvmesh.metadata.registry import NodeDirectory, NodeRegistry
from kvmesh.metadata.store import StoreUnavailable
from kvmesh.transfer.peers import PeerRecord

log = logging.getLogger("kvmesh.node")


def peer_record(record: NodeRecord) -> PeerRecord | None:
    """The transfer-relevant part of a node record (None if it publishes no KV buffer)."""
    layout = record.kv_layout
    if not (layout.base_addr and layout.num_blocks and layout.bytes_per_block):
        return None
    return PeerRecord(record.node_id, record.side_channel, record.transfer_endpoint, layout.base_addr,
                      layout.num_blocks, layout.bytes_per_block, layout.shared_memory, layout.landing_addr,
                      layout.num_landing_slots)


class ClusterMembership:
    def __init__(self, etcd: str, cluster: str, node_id: str, namespace: str, lease_ttl_s: int,
                 on_peer_left: Callable[[str], None],
                 on_pin_change: Callable[[str, str, PinRecord | None], None] | None = None, token: str = ""):
        """``token``: the cluster secret (etcd's credentials and the MAC on every value, ``metadata/sealed_store``)."""
        self.etcd, self.cluster, self.node_id, self.namespace = etcd, cluster, node_id, namespace
        self._token = token
        self.lease_ttl_s = lease_ttl_s
        self._on_peer_left = on_peer_left
        self._on_pin_change = on_pin_change
        self.pins: PinRegistry | None = None
        self._incarnations: dict[str, tuple[str, str]] = {}  # node id -> endpoints it was last seen with
        self.store = self.publisher = self.index = self.directory = self.registry = None

    def start(self, record: NodeRecord, sync_timeout_s: float = 30.0) -> ClusterMembership:
        self.store = open_store(self.etcd, self._token)
        self.publisher = BlockPublisher(self.store, self.cluster, self.namespace, self.node_id)
        self.index = BlockIndex(self.store, self.cluster, self.namespace)
        self.directory = NodeDirectory(self.store, self.cluster, on_event=self._on_event)
        self.registry = NodeRegistry(self.store, self.cluster, ttl_s=self.lease_ttl_s)
        self.registry.on_new_lease(self.publisher.set_lease)
        self.pins = PinRegistry(self.store, self.cluster, self.namespace, self._on_pin_change)
        for mirror in (self.index.mirror, self.directory.mirror):  # serve with a synced view of the cluster
            if not mirror.wait_healthy(sync_timeout_s):
                log.warning("%s: %s not synced with etcd yet; starting with local caches only",
                            self.node_id, mirror.prefix)
        deadline = time.monotonic() + sync_timeout_s
        while True:  # etcd slow to answer (a loaded machine, a restart): keep trying for the sync time
            try:
                self.registry.register(record)
                return self
            except StoreUnavailable:
                if time.monotonic() > deadline:
                    raise
                log.warning("%s: etcd did not answer the registration; trying again", self.node_id)
                time.sleep(0.5)

    def _on_event(self, kind: str, node_id: str, record: NodeRecord | None) -> None:
        """A departure, or a restart under the same id (new endpoints): the old incarnation is gone."""
        if node_id == self.node_id:
            return
        previous = self._incarnations.get(node_id)
        current = (record.side_channel, record.transfer_endpoint) if record is not None else None
        if current is None:
            self._incarnations.pop(node_id, None)
        else:
            self._incarnations[node_id] = current
        if kind == "left" or (previous is not None and current is not None and previous != current):
            self._on_peer_left(node_id)

    def peer(self, node_id: str) -> PeerRecord | None:
        """Where ``node_id``'s KV memory is: from the directory's mirror, or, for a node that registered so
        recently that its watch event has not arrived yet, from etcd itself (None: not a registered node)."""
        if self.directory is None:
            return None
        record = self.directory.nodes.get(node_id)
        if record is None:
            try:
                value = self.store.get_many([KeyLayout(self.cluster).node(node_id)])[0]
                record = NodeRecord.decode(value) if value is not None else None
            except (InvalidNameError, RecordError, StoreUnavailable):
                return None
        return peer_record(record) if record is not None else None

    def probe_of(self, node_id: str) -> ComputeProbe:
        """What ``node_id`` measured of itself (zeros for a node we do not know)."""
        record = self.directory.nodes.get(node_id) if self.directory is not None else None
        return record.probe if record is not None else ComputeProbe()

    def nodes(self, role: str) -> dict[str, NodeRecord]:
        return {n: r for n, r in self.directory.nodes.items() if r.role == role and n != self.node_id}

    def lookup_holders(self, block_hashes: list[bytes]) -> dict[str, int]:
        """Other nodes holding a prefix of these blocks: node id -> number of leading blocks."""
        return self.index.lookup(block_hashes, exclude=self.node_id)

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        if self.registry is not None:
            self.registry.deregister()
        for part in (self.index, self.directory, self.pins):
            if part is not None:
                part.close()
        if self.store is not None:
            self.store.close()
