"""TransferAgent: a node's end of KV movement (DESIGN §2, §6).

As a **holder** it serves push requests on its side channel (a ZMQ ROUTER): it
matches the wanted hashes against its own pool (the global index may be stale),
pins what it has, writes it into the requester's blocks with one batched
transfer per chunk of coalesced runs, waits up to ``wait_ms`` for blocks still
being computed, and answers which blocks it wrote. Pins are always released.

As a **requester** it asks a peer to push (``request_push``) or pulls a prefix into
freshly allocated blocks (``pull_prefix``); on any failure it frees what it
allocated and raises a typed TransferError, so nothing leaks.

    requester                          holder
    PushRequest(dst ids, hashes) ──>   match + pin, write runs ──> requester's buffer
                                 <──   PushResult(final=False)      (per chunk)
                                 <──   PushResult(final=True, written[])
    Abort ──> / <── Abort              either side, any time
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import zmq

from kvmesh.kv.block_hash import BlockHash
from kvmesh.kv.block_pool import NO_BLOCK, BlockPool
from kvmesh.router_endpoint import RouterEndpoint
from kvmesh.transfer import messages as m
from kvmesh.transfer.coalesce import coalesce, to_descriptors
from kvmesh.transfer.engine import TransferEngine
from kvmesh.transfer.errors import TransferAborted, TransferError, TransferTimeout

log = logging.getLogger("kvmesh.transfer")


@dataclass(frozen=True)
class PeerInfo:
    node_id: str
    side_channel: str  # "host:port" of the peer's TransferAgent


class TransferAgent:
    def __init__(self, node_id: str, pool: BlockPool, kv_buffer: torch.Tensor, engine: TransferEngine,
                 host: str = "127.0.0.1", num_workers: int = 4):
        self.node_id = node_id
        self.pool = pool
        self.engine = engine
        self.kv_buffer = kv_buffer
        self.block_bytes = kv_buffer[0].numel() * kv_buffer.element_size()
        self.base_addr = engine.register(kv_buffer)
        log.info("%s: transfer engine %s at %s, transport %s (%s)", node_id, engine.name, engine.endpoint,
                 engine.transport, engine.transport_reason)
        self._ctx = zmq.Context.instance()
        self._local = threading.local()
        self._identities: dict[str, bytes] = {}
        self._aborted: set[str] = set()
        self._lock = threading.Lock()
        self._workers = ThreadPoolExecutor(num_workers, thread_name_prefix=f"kvmesh-push-{node_id}")
        self.num_malformed = 0
        self.bytes_sent = 0  # as a holder
        self.bytes_received = 0  # as a requester (blocks peers wrote into our buffer)
        self._endpoint = RouterEndpoint(host, self._on_message, f"side-channel-{node_id}")
        self.side_channel = self._endpoint.endpoint

    @property
    def info(self) -> PeerInfo:
        return PeerInfo(self.node_id, self.side_channel)

    # ---- holder ---------------------------------------------------------------------------------
    def _on_message(self, identity: bytes, payload: bytes) -> None:
        try:
            msg = m.decode(payload)
        except m.MessageError as e:
            self.num_malformed += 1
            log.warning("%s: refused a malformed side-channel message: %s", self.node_id, e)
            self._endpoint.send(identity, m.encode(m.Abort("", f"malformed message: {e}")))
            return
        if isinstance(msg, m.PushRequest):
            with self._lock:
                self._identities[msg.request_id] = identity
            self._workers.submit(self._push, msg)
        elif isinstance(msg, m.Abort):
            with self._lock:
                self._aborted.add(msg.request_id)
        else:
            log.warning("%s: unexpected %s on the side channel", self.node_id, msg.TYPE)

    def _reply(self, request_id: str, msg: m.Message) -> None:
        with self._lock:
            identity = self._identities.get(request_id)
        if identity is not None:
            self._endpoint.send(identity, m.encode(msg))

    def _is_aborted(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._aborted

    def _push(self, req: m.PushRequest) -> None:
        """Push whatever of ``req`` this node holds, as it becomes available; always unpins."""
        num = len(req.block_hashes)
        written = [False] * num
        pinned: list[int] = []
        error = ""
        deadline = time.monotonic() + req.wait_ms / 1000
        try:
            while True:
                new = self.pool.match_and_pin(req.block_hashes, skip=len(pinned))
                if new:
                    start = len(pinned)
                    pinned += new
                    runs = coalesce(new, req.dst_block_ids[start : len(pinned)])
                    self.engine.write(req.transfer_endpoint,
                                      to_descriptors(runs, self.base_addr, req.dst_base_addr, self.block_bytes,
                                                     self.engine.max_descriptor_bytes),
                                      request_id=req.request_id)
                    written[start : len(pinned)] = [True] * len(new)
                    self.bytes_sent += len(new) * self.block_bytes
                    if len(pinned) < num:
                        self._reply(req.request_id, m.PushResult(req.request_id, list(written), final=False))
                if len(pinned) == num or self._is_aborted(req.request_id):
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self.pool.wait_for_cached(min(remaining, 0.05))
        except Exception as e:  # a failed write: report it, never crash the holder
            error = f"{type(e).__name__}: {e}"
            log.warning("%s: push %s failed: %s", self.node_id, req.request_id, error)
        finally:
            self.pool.unpin(pinned)
        if self._is_aborted(req.request_id):
            error = error or "aborted by the requester"
        self._reply(req.request_id, m.PushResult(req.request_id, written, final=True, error=error))
        with self._lock:
            self._identities.pop(req.request_id, None)
            self._aborted.discard(req.request_id)

    def abort(self, request_id: str, reason: str = "aborted by the holder") -> None:
        """Holder-side abort: stop pushing and tell the requester."""
        with self._lock:
            self._aborted.add(request_id)
        self._reply(request_id, m.Abort(request_id, reason))

    # ---- requester -------------------------------------------------------------------------------------
    def request_push(self, peer: PeerInfo, dst_block_ids: list[int], block_hashes: list[BlockHash], *,
                     request_id: str | None = None, timeout_s: float = 10.0, wait_ms: int = 0) -> list[bool]:
        """Ask ``peer`` to write ``block_hashes`` into our ``dst_block_ids``; returns per-block written flags.

        Raises TransferTimeout (no final answer in ``timeout_s``; an Abort is sent),
        TransferAborted (the holder aborted) or TransferError (the holder's write failed).
        The destination blocks stay the caller's to free.
        """
        request_id = request_id or uuid.uuid4().hex
        req = m.PushRequest(request_id, self.node_id, self.engine.endpoint, self.base_addr, self.block_bytes,
                            list(dst_block_ids), list(block_hashes), wait_ms)
        req.validate()
        sock = self._side_channel_to(peer)
        ok = False
        try:
            sock.send(m.encode(req))
            deadline = time.monotonic() + timeout_s
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not sock.poll(remaining * 1000):
                    sock.send(m.encode(m.Abort(request_id, "requester timed out")))
                    raise TransferTimeout(f"no final push result within {timeout_s} s", request_id=request_id,
                                          peer=peer.node_id)
                msg = m.decode(sock.recv())
                if msg.request_id not in (request_id, ""):
                    continue  # a late answer to an earlier request on this socket
                if isinstance(msg, m.Abort):
                    raise TransferAborted(msg.reason or "aborted", request_id=request_id, peer=peer.node_id)
                if isinstance(msg, m.PushResult) and msg.final:
                    ok = True
                    if msg.error:
                        raise TransferError(f"push failed: {msg.error}", request_id=request_id, peer=peer.node_id)
                    self.bytes_received += sum(msg.written) * self.block_bytes
                    return msg.written
        finally:
            if not ok:  # a socket that timed out or was aborted on is not reused
                self._forget_side_channel(peer)

    def _side_channel_to(self, peer: PeerInfo) -> zmq.Socket:
        """This thread's DEALER to ``peer``'s side channel, connected once and reused."""
        sockets = self._local.__dict__.setdefault("dealers", {})
        sock = sockets.get(peer.side_channel)
        if sock is None:
            sock = sockets[peer.side_channel] = self._ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.connect(f"tcp://{peer.side_channel}")
        return sock

    def _forget_side_channel(self, peer: PeerInfo) -> None:
        sock = self._local.__dict__.get("dealers", {}).pop(peer.side_channel, None)
        if sock is not None:
            sock.close()

    def pull_prefix(self, peer: PeerInfo, block_hashes: list[BlockHash], *, parent_block_id: int = NO_BLOCK,
                    timeout_s: float = 10.0, wait_ms: int = 0, request_id: str | None = None) -> list[int]:
        """Fetch the longest prefix of ``block_hashes`` that ``peer`` holds into new local blocks.

        The written blocks are cached in our pool (their parent: ``parent_block_id``) and
        returned with one reference each, owned by the caller. Unwritten blocks are freed;
        on any error every allocated block is freed before the error propagates.
        """
        block_ids = self.pool.allocate(len(block_hashes))
        try:
            written = self.request_push(peer, block_ids, block_hashes, request_id=request_id, timeout_s=timeout_s,
                                        wait_ms=wait_ms)
        except BaseException:
            self.pool.free(block_ids)
            raise
        num_ok = written.index(False) if False in written else len(written)
        kept, extra = block_ids[:num_ok], block_ids[num_ok:]
        self.pool.free(extra)
        holders = self.pool.cache_blocks(kept, block_hashes[:num_ok], parent_block_id)
        duplicates = [(own, h) for own, h in zip(kept, holders) if own != h]
        if duplicates:  # we already held some: keep our copy, drop the fetched one
            self.pool.touch([h for _, h in duplicates])
            self.pool.free([own for own, _ in duplicates])
        return holders

    def close(self) -> None:
        self._endpoint.close()
        self._workers.shutdown(wait=True, cancel_futures=True)
