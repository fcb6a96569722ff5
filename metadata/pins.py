"""PinRegistry: the cluster's pinned prefixes, kept in etcd (docs/design.md §5).

The router writes and deletes pins (``kvmesh pin``, its admin API); every node mirrors the
pins of its hash namespace and applies them to its own pool, so a node that joins later, or
restarts, pins the same prefixes. Pins carry no lease: they last until unpinned.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvmesh.metadata.keys import KeyLayout
from kvmesh.metadata.mirror import PrefixMirror
from kvmesh.metadata.records import PinRecord, RecordError
from kvmesh.metadata.store import KeyValue, MetadataStore

log = logging.getLogger("kvmesh.metadata")


class PinRegistry:
    def __init__(self, store: MetadataStore, cluster: str, namespace: str,
                 on_change: Callable[[str, str, PinRecord | None], None] | None = None):
        """``on_change(kind, prefix_id, record)``: "put" (record) or "delete" (None), from the mirror's thread.

        A resync after an etcd outage replays every pin as a put; a pin deleted during the outage
        stays applied on this node until it is deleted again or the node restarts."""
        self.store = store
        self.keys = KeyLayout(cluster)
        self.namespace = namespace
        self._on_change = on_change
        self._lock = threading.Lock()
        self.pins: dict[str, PinRecord] = {}
        self.mirror = PrefixMirror(store, self.keys.pins_of_namespace(namespace), self._apply)

    def put(self, prefix_id: str, record: PinRecord) -> None:
        self.store.put_many([KeyValue(self.keys.pin(self.namespace, prefix_id), record.encode())])

    def delete(self, prefix_id: str) -> None:
        self.store.delete_many([self.keys.pin(self.namespace, prefix_id)])

    def snapshot(self) -> dict[str, PinRecord]:
        """The pins as this process's mirror has them (a write of a moment ago may not be here yet)."""
        with self._lock:
            return dict(self.pins)

    def read(self) -> dict[str, PinRecord]:
        """The pins as the store has them now (every write made before this call included; malformed ones
        left out)."""
        items, _ = self.store.get_prefix(self.keys.pins_of_namespace(self.namespace))
        pins = {}
        for kv in items:
            pin_id = self.keys.parse_pin(kv.key, self.namespace)
            try:
                if pin_id is not None:
                    pins[pin_id] = PinRecord.decode(kv.value)
            except RecordError:
                continue
        return pins

    def _apply(self, kind: str, key: str, value: bytes, lease: int = 0) -> None:
        record = None
        with self._lock:
            if kind == "reset":
                self.pins.clear()
                return
            pin_id = self.keys.parse_pin(key, self.namespace)
            if pin_id is None:
                return
            if kind == "delete":
                self.pins.pop(pin_id, None)
            else:
                try:
                    record = self.pins[pin_id] = PinRecord.decode(value)
                except RecordError as e:
                    log.warning("ignoring the malformed pin %s: %s", key, e)
                    return
        if self._on_change is not None:
            self._on_change(kind, pin_id, record)

    def close(self) -> None:
        self.mirror.close()
