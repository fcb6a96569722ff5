"""SealedStore: every value kvmesh writes to etcd carries a MAC under the cluster key; readers drop the rest.

    stored value = mac (16 bytes) || value
    mac = blake2b(len(key) || key || lease id || value, key=the cluster's record key, digest_size=16)

The MAC binds a value to its key (a node record copied under another node id, or a
block entry under another hash, does not verify) and to the lease it was written on
(a record of a dead node written back without its lease, or on another lease, does
not verify either). A process that can write to etcd but does not hold the cluster
secret can delete keys, but cannot make any reader believe a value it wrote: reads
omit such keys, and watch puts of such values reach the reader as deletes. Each is
counted in ``num_forged`` and logged (the first, then at powers of two).

Wraps any ``MetadataStore``; ``open_store`` builds the one every kvmesh process uses.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Sequence

from kvmesh.metadata.store import KeyValue, MetadataStore, WatchCallback, WatchEvent

log = logging.getLogger("kvmesh.metadata")

MAC_BYTES = 16


class SealedStore:
    def __init__(self, store: MetadataStore, record_key: bytes):
        """``record_key``: ``ClusterAuth.record_key`` (derived from the cluster secret)."""
        self.inner = store
        self.endpoint = getattr(store, "endpoint", "")
        self._key = record_key
        self.num_forged = 0

    def _mac(self, key: str, lease: int, value: bytes) -> bytes:
        h = hashlib.blake2b(key=self._key, digest_size=MAC_BYTES)
        encoded = key.encode()
        h.update(len(encoded).to_bytes(4, "big"))
        h.update(encoded)
        h.update((lease or 0).to_bytes(8, "big"))
        h.update(value)
        return h.digest()

    def seal(self, key: str, lease: int, value: bytes) -> bytes:
        return self._mac(key, lease, value) + value

    def verify(self, key: str, lease: int, stored: bytes) -> bytes | None:
        """The value written by a holder of the cluster key, or None (counted and logged)."""
        if len(stored) >= MAC_BYTES and hmac.compare_digest(stored[:MAC_BYTES],
                                                            self._mac(key, lease, stored[MAC_BYTES:])):
            return stored[MAC_BYTES:]
        self.num_forged += 1
        if self.num_forged & (self.num_forged - 1) == 0:
            log.warning("dropped %d value(s) in etcd that do not carry the cluster's MAC (last: %r); "
                        "someone without the cluster secret writes to etcd", self.num_forged, key)
        return None

    # ---- MetadataStore ------------------------------------------------------------------------------
    def grant_lease(self, ttl_s: int) -> int:
        return self.inner.grant_lease(ttl_s)

    def keepalive(self, lease_id: int) -> None:
        self.inner.keepalive(lease_id)

    def lease_alive(self, lease_id: int) -> bool:
        return self.inner.lease_alive(lease_id)

    def revoke_lease(self, lease_id: int) -> None:
        self.inner.revoke_lease(lease_id)

    def put_many(self, items: Sequence[KeyValue], lease_id: int | None = None) -> None:
        lease = lease_id or 0
        self.inner.put_many([KeyValue(kv.key, self.seal(kv.key, lease, kv.value)) for kv in items], lease_id)

    def delete_many(self, keys: Sequence[str]) -> None:
        self.inner.delete_many(keys)

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        items, revision = self.inner.get_prefix(prefix)
        out = []
        for kv in items:
            value = self.verify(kv.key, kv.lease, kv.value)
            if value is not None:
                out.append(KeyValue(kv.key, value, kv.lease))
        return out, revision

    def get_entries(self, keys: Sequence[str]) -> list[KeyValue | None]:
        out: list[KeyValue | None] = []
        for kv in self.inner.get_entries(keys):
            value = self.verify(kv.key, kv.lease, kv.value) if kv is not None else None
            out.append(KeyValue(kv.key, value, kv.lease) if value is not None else None)
        return out

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return [kv.value if kv is not None else None for kv in self.get_entries(keys)]

    def watch_prefix(self, prefix: str, start_revision: int, callback: WatchCallback):
        def on_events(batch: list[WatchEvent] | BaseException) -> None:
            if isinstance(batch, BaseException):
                callback(batch)
                return
            out = []
            for e in batch:
                if e.kind == "put":
                    value = self.verify(e.key, e.lease, e.value)
                    e = WatchEvent("put", e.key, value, e.revision, e.lease) if value is not None else \
                        WatchEvent("delete", e.key, b"", e.revision)
                out.append(e)
            callback(out)

        return self.inner.watch_prefix(prefix, start_revision, on_events)

    def close(self) -> None:
        self.inner.close()


def open_store(etcd: str, token: str, timeout_s: float = 2.0) -> SealedStore:
    """The etcd store of a kvmesh process: values sealed under the cluster secret ``token``, and etcd's own
    credentials derived from it (``metadata/etcd_auth.py``)."""
    from kvmesh.auth import ClusterAuth
    from kvmesh.metadata.etcd_store import EtcdStore

    return SealedStore(EtcdStore(etcd, timeout_s=timeout_s, token=token), ClusterAuth(token).record_key)
