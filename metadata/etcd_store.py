"""etcd v3 MetadataStore over ``etcd-sdk-python`` (the maintained etcd3 API; works with protobuf >= 5).

Batches go in one transaction of at most ``MAX_TXN_OPS`` operations (etcd's default
``--max-txn-ops`` is 128) and roughly ``MAX_TXN_BYTES`` of payload (etcd refuses
requests over 1.5 MiB by default); larger batches are split. Every RPC has a
deadline, and connection failures become StoreUnavailable.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence

import grpc

from kvmesh.auth import TOKEN_ENV
from kvmesh.metadata.etcd_auth import authenticate, is_token_rejected
from kvmesh.metadata.store import CompactedError, KeyValue, StoreUnavailable, WatchCallback, WatchEvent

MAX_TXN_OPS = 128
MAX_TXN_BYTES = 1 << 20
PAGE_KEYS = 64  # a listing's first page; the next ones are sized to ~PAGE_BYTES from what the first weighed
MAX_PAGE_KEYS = 8192
PAGE_BYTES = 16 << 20
MAX_RECEIVE_BYTES = 64 << 20  # a page of large values (holdings records) or a watch response stays under this


def split_batches(items: Sequence, size_of=lambda x: 0) -> list[list]:
    """Cut ``items`` into batches within etcd's op-count and byte limits."""
    batches: list[list] = [[]]
    used = 0
    for item in items:
        size = size_of(item)
        if batches[-1] and (len(batches[-1]) >= MAX_TXN_OPS or used + size > MAX_TXN_BYTES):
            batches.append([])
            used = 0
        batches[-1].append(item)
        used += size
    return batches if batches[0] else []


class EtcdStore:
    def __init__(self, endpoint: str = "127.0.0.1:2379", timeout_s: float = 2.0, token: str = ""):
        """``token``: the cluster secret; etcd's credentials are derived from it (``metadata/etcd_auth.py``)
        and sent once etcd asks for them. Nothing is contacted here."""
        import pyetcd

        host, _, port = endpoint.rpartition(":")
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._client = pyetcd.client(host=host or "127.0.0.1", port=int(port), timeout=timeout_s,
                                     grpc_options=[("grpc.max_receive_message_length", MAX_RECEIVE_BYTES)])
        # The client refuses an endpoint for 300 s after one failure; retry it after a moment instead.
        for endpoint in self._client.endpoints.values():
            endpoint.time_retry = 0.2
        self._leases: dict[int, object] = {}
        self._token = token
        self._auth_lock = threading.Lock()
        self.authenticated = False  # etcd asked for credentials and took ours

    def _call(self, fn, *args, **kwargs):
        try:
            return self._call_once(fn, *args, **kwargs)
        except grpc.RpcError as e:
            if not is_token_rejected(e):
                raise
            self._authenticate(e)
            return self._call_once(fn, *args, **kwargs)

    def _authenticate(self, refused: BaseException) -> None:
        """etcd wants credentials (first call, or our auth token expired): log in with the derived ones."""
        if not self._token:
            raise StoreUnavailable(f"etcd at {self.endpoint} requires authentication and this process has no "
                                   f"cluster secret (${TOKEN_ENV})") from None
        with self._auth_lock:
            try:
                if not authenticate(self._client, self._token, self.timeout_s):
                    raise refused
            except grpc.RpcError as e:
                if _is_unavailable(e):
                    raise StoreUnavailable(f"etcd at {self.endpoint} is unreachable: {type(e).__name__}") from None
                raise StoreUnavailable(f"etcd at {self.endpoint} refused our credentials: {e.details()} "
                                       f"(another cluster secret?)") from None
            self.authenticated = True

    def _call_once(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # grpc and pyetcd raise several types for "cannot reach etcd"
            if _is_unavailable(e):
                raise StoreUnavailable(f"etcd at {self.endpoint} is unreachable: {type(e).__name__}") from None
            if isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.NOT_FOUND and "lease" in str(e.details()):
                raise KeyError("lease not found (expired or revoked)") from None
            raise

    def grant_lease(self, ttl_s: int) -> int:
        lease = self._call(self._client.lease, ttl_s)
        self._leases[lease.id] = lease
        return lease.id

    def keepalive(self, lease_id: int) -> None:
        responses = self._call(lambda: list(self._client.refresh_lease(lease_id)))
        if not responses or responses[0].TTL <= 0:
            raise KeyError(f"lease {lease_id} has expired")

    def lease_alive(self, lease_id: int) -> bool:
        return self._call(self._client.get_lease_info, lease_id).TTL > 0

    def revoke_lease(self, lease_id: int) -> None:
        self._call(self._client.revoke_lease, lease_id)
        self._leases.pop(lease_id, None)

    def put_many(self, items: Sequence[KeyValue], lease_id: int | None = None) -> None:
        tx = self._client.transactions
        for batch in split_batches(items, lambda kv: len(kv.key) + len(kv.value)):
            ops = [tx.put(kv.key, kv.value, lease=lease_id) for kv in batch]
            self._call(self._client.transaction, compare=[], success=ops, failure=[])

    def delete_many(self, keys: Sequence[str]) -> None:
        tx = self._client.transactions
        for batch in split_batches(keys, len):
            self._call(self._client.transaction, compare=[], success=[tx.delete(k) for k in batch], failure=[])

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix``, read in pages at one revision: a consistent listing of any size. Pages
        hold about ``PAGE_BYTES`` (sized from the pages before; etcd counts the whole range for every page, so
        small keys come thousands at a time); one over ``MAX_RECEIVE_BYTES`` is asked again smaller; a revision
        compacted between pages raises CompactedError."""
        from pyetcd.utils import prefix_range_end

        items: list[KeyValue] = []
        start, end, revision, limit = prefix.encode(), prefix_range_end(prefix.encode()), None, PAGE_KEYS
        while True:
            try:
                response = self._call(self._client.get_range_response, start, end, limit=limit, revision=revision)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and limit > 1:
                    limit = max(1, limit // 4)  # large values: fewer per page
                    continue
                if revision is not None and "compacted" in str(e.details()).lower():
                    raise CompactedError(f"revision {revision} was compacted while {prefix} was listed") from None
                raise
            if revision is None:
                revision = response.header.revision
            page = [KeyValue(kv.key.decode(), bytes(kv.value), kv.lease) for kv in response.kvs]
            items += page
            if not response.more or not page:
                return items, revision
            weight = sum(len(kv.key) + len(kv.value) for kv in page) / len(page)
            limit = max(1, min(MAX_PAGE_KEYS, int(PAGE_BYTES / max(weight, 1.0))))
            start = response.kvs[-1].key + b"\0"

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return [kv.value if kv is not None else None for kv in self.get_entries(keys)]

    def get_entries(self, keys: Sequence[str]) -> list[KeyValue | None]:
        out: list[KeyValue | None] = []
        tx = self._client.transactions
        for batch in split_batches(keys, len):
            _, responses = self._call(self._client.transaction, compare=[], success=[tx.get(k) for k in batch],
                                      failure=[])
            for key, found in zip(batch, responses):
                out.append(KeyValue(key, bytes(found[0][0]), found[0][1].lease_id) if found else None)
        return out

    def watch_prefix(self, prefix: str, start_revision: int, callback: WatchCallback):
        import pyetcd.events as ev
        import pyetcd.exceptions as ex

        def on_response(response) -> None:
            if isinstance(response, BaseException):
                if isinstance(response, ex.RevisionCompactedError) or "compacted" in str(response).lower():
                    callback(CompactedError(f"revision {start_revision} is compacted"))
                else:
                    callback(response)
                return
            if getattr(response, "compact_revision", 0):
                callback(CompactedError(f"revision {start_revision} compacted"))
                return
            events = []
            for e in response.events:
                kind = "delete" if isinstance(e, ev.DeleteEvent) else "put"
                events.append(WatchEvent(kind, e.key.decode(), bytes(e.value) if kind == "put" else b"",
                                         e.mod_revision, e.lease if kind == "put" else 0))
            if events:
                callback(events)

        watch_id = self._call(self._client.add_watch_prefix_callback, prefix, on_response,
                              start_revision=start_revision)
        return lambda: self._cancel(watch_id)

    def _cancel(self, watch_id) -> None:
        try:
            self._client.cancel_watch(watch_id)
        except Exception:
            pass  # the watch already died with its connection

    def close(self) -> None:
        self._client.close()


def _is_unavailable(e: BaseException) -> bool:
    import pyetcd.exceptions as ex

    if isinstance(e, (ex.ConnectionFailedError, ex.ConnectionTimeoutError)):
        return True
    if isinstance(e, ValueError) and "failed node" in str(e):  # the client's own "endpoint recently failed"
        return True
    return isinstance(e, grpc.RpcError) and e.code() in (grpc.StatusCode.UNAVAILABLE,
                                                         grpc.StatusCode.DEADLINE_EXCEEDED)
