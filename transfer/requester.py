"""KVRequester: the receiving side of transfer conversations (decode nodes; prefill nodes pulling).

One IO thread owns a DEALER socket per peer side channel and dispatches every
answer by its correlation id, so answers that arrive after the caller gave up
still land somewhere: a late final PushResult releases the grant's quarantine.

    caller thread                        IO thread                      GrantTable
    push()/compute_and_push()
      issue grant ─────────────────────────────────────────────────────> OPEN
      send request ───────────────────>  DEALER ──> peer
      wait on the conversation's queue <─ PushResult chunks ───────────> confirm
      final in time ─────────────────────────────────────────────────────> close
      timeout / abort: send Abort, revoke ──────────────────────────────> QUARANTINED (Mooncake)
                                         late final ─────────────────────> acknowledge (released)
    peer's lease ends (``peer_gone``) ─────────────────────────────────────> writer_gone (released)

Every call returns a PushOutcome, also on failure: how many leading blocks are
really written (usable), which blocks are tainted (the caller must stop using
them: swap or free its references; the table holds them until the writer has
stopped), and the error, if any.
"""
from __future__ import annotations

from collections.abc import Callable

import itertools
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import NamedTuple

import zmq

from kvmesh.auth import AuthError, ClusterAuth
from kvmesh.kv.block_hash import BlockHash
from kvmesh.transfer import messages as m
from kvmesh.transfer.errors import TransferAborted, TransferError, TransferRefused, TransferTimeout
from kvmesh.transfer.grants import Grant, GrantTable
from kvmesh.transfer.peers import PeerDirectory, PeerRecord

log = logging.getLogger("kvmesh.transfer")

ACCEPT_TIMEOUT_S = 5.0  # a prefill node answers Accepted / Refused within this


class PushOutcome(NamedTuple):
    num_written: int  # leading blocks written (and never to be written again)
    tainted_block_ids: list[int]  # stop using these: a writer may still be writing them
    error: TransferError | None
    write_s: float = 0.0  # the writer's time in its transfer engine: bytes / write_s is the link's rate


class _PeerGone(Exception):
    pass


@dataclass(slots=True)
class _Conversation:
    request_id: str
    peer_id: str
    side_channel: str
    grant: Grant
    events: queue.Queue = field(default_factory=queue.Queue)
    abandoned: bool = False  # the caller gave up; only the final answer is still awaited


class KVRequester:
    def __init__(self, node_id: str, grants: GrantTable, directory: PeerDirectory, auth: ClusterAuth):
        self.node_id = node_id
        self.grants = grants
        self.directory = directory
        self._auth = auth
        self._ctx = zmq.Context.instance()
        self._conversations: dict[str, _Conversation] = {}
        self._lock = threading.Lock()
        self._outbox_addr = f"inproc://kvmesh-requester-{uuid.uuid4().hex}"
        self._outbox = self._ctx.socket(zmq.PULL)
        self._outbox.bind(self._outbox_addr)
        self._local = threading.local()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvmesh-requester-{node_id}", daemon=True)
        self._ids = itertools.count()
        self.bytes_received = 0
        # (block ids, the writer's crc32s) -> how many leading blocks match; None: trust what arrives.
        self.verify: Callable[[list[int], list[int]], int] | None = None
        # Copies blocks reported written out of the registered memory (a device buffer's host mirror).
        self.stage_in: Callable[[list[int]], None] | None = None
        self.num_checksum_failures = 0
        self.block_bytes = grants.block_bytes
        # A peer's record -> whether its process still exists, for writers on this host (None: cannot tell).
        self.writer_liveness: Callable[[PeerRecord], Callable[[], bool] | None] | None = None
        self._next_sweep = 0.0

    def start(self) -> KVRequester:
        self._thread.start()
        return self

    # ---- calls (any thread) ---------------------------------------------------------------------------
    def push(self, peer_id: str, block_ids: list[int], block_hashes: list[BlockHash], *, request_id: str,
             timeout_s: float = 10.0, wait_ms: int = 0) -> PushOutcome:
        """Ask ``peer_id`` to write ``block_hashes`` into our ``block_ids`` (which the caller owns)."""
        deadline_ms = max(1, min(int(timeout_s * 1000), m.MAX_WAIT_MS))
        wait_ms = min(wait_ms, deadline_ms)
        return self._converse(peer_id, block_ids, request_id, timeout_s, deadline_ms / 1000,
                              lambda cid, g: m.PushRequest(cid, self.node_id, g.grant_id, list(block_ids),
                                                           list(block_hashes), deadline_ms, wait_ms))

    def compute_and_push(self, peer_id: str, block_ids: list[int], prompt_token_ids: list[int], first_block: int,
                         *, request_id: str, timeout_s: float, wanted_within_s: float = 0.0) -> PushOutcome:
        """Ask prefill node ``peer_id`` to compute the prompt and write blocks ``first_block..`` into ``block_ids``.

        ``wanted_within_s``: we would have them sooner by computing them ourselves; the prefill node refuses
        (BUSY) when it cannot beat that (0: no limit). A refusal comes back as a TransferRefused error with
        nothing written or tainted.
        """
        deadline_ms = max(1, min(int(timeout_s * 1000), m.MAX_WAIT_MS))
        wanted_ms = max(1, int(wanted_within_s * 1000)) if wanted_within_s > 0 else 0
        return self._converse(peer_id, block_ids, request_id, timeout_s, deadline_ms / 1000,
                              lambda cid, g: m.ComputeAndPush(cid, self.node_id, g.grant_id, list(prompt_token_ids),
                                                              first_block, list(block_ids), deadline_ms, wanted_ms),
                              compute=True)

    def abort(self, request_id: str, reason: str = "aborted by the requester") -> int:
        """Abort every conversation of ``request_id`` (its callers then receive the writers' finals)."""
        with self._lock:
            convs = [c for c in self._conversations.values() if c.request_id.startswith(request_id + "/")]
        for conv in convs:
            self._send(conv.side_channel, m.Abort(conv.request_id, reason))
        return len(convs)

    def peer_gone(self, peer_id: str) -> None:
        """The directory says ``peer_id``'s lease ended: fail its conversations, release its quarantines.

        A writer on this host whose process still exists (stopped, cut off from etcd) may resume and finish a
        write: its conversations revoke their grants and keep waiting for its final answer."""
        released = self.grants.writer_gone(peer_id)
        with self._lock:
            convs = [c for c in self._conversations.values() if c.peer_id == peer_id]
            for c in convs:
                if c.abandoned and not self.grants.has(c.grant.grant_id):
                    del self._conversations[c.request_id]
        for conv in convs:
            conv.events.put(_PeerGone())
        if released:
            log.warning("%s: released %d quarantined blocks of departed node %s", self.node_id, released, peer_id)

    # ---- one conversation --------------------------------------------------------------------------------
    def _converse(self, peer_id: str, block_ids: list[int], request_id: str, timeout_s: float, grant_s: float,
                  make_msg, compute: bool = False) -> PushOutcome:
        peer = self.directory.get(peer_id)
        if peer is None:
            return PushOutcome(0, [], TransferError("not a registered node", request_id=request_id, peer=peer_id))
        cid = f"{request_id}/{next(self._ids)}"
        alive = self.writer_liveness(peer) if self.writer_liveness is not None else None
        grant = self.grants.issue(cid, peer_id, block_ids, grant_s + 1.0, writer_alive=alive)
        conv = _Conversation(cid, peer_id, peer.side_channel, grant)
        with self._lock:
            self._conversations[cid] = conv
        self._send(peer.side_channel, make_msg(cid, grant))
        deadline = time.monotonic() + timeout_s
        accept_by = time.monotonic() + min(ACCEPT_TIMEOUT_S, timeout_s) if compute else None
        written = [False] * len(block_ids)
        num_landed = 0  # leading blocks already copied out of the registered memory
        write_s = 0.0
        error: TransferError | None = None
        while True:
            limit = min(deadline, accept_by) if accept_by is not None else deadline
            try:
                msg = conv.events.get(timeout=max(0.0, limit - time.monotonic()))
            except queue.Empty:
                what = "no Accepted/Refused" if accept_by is not None and limit == accept_by else "no final result"
                error = TransferTimeout(f"{what} within {limit - (deadline - timeout_s):.1f} s", request_id=cid,
                                        peer=peer_id)
                break
            if isinstance(msg, _PeerGone):  # its lease ended: dead, or (on this host) maybe only stopped
                tainted = self.grants.revoke(grant.grant_id)  # a dead writer's grant is gone already: []
                if tainted:
                    with self._lock:
                        conv.abandoned = cid in self._conversations  # its final may still come
                else:
                    self._drop(cid)
                num = min(_leading(written), grant.num_confirmed) if tainted else _leading(written)
                return PushOutcome(num, tainted, TransferError("the writer left the cluster", request_id=cid,
                                                               peer=peer_id))
            if isinstance(msg, m.Accepted):
                accept_by = None
            elif isinstance(msg, m.Refused):
                self._drop(cid)
                self.grants.close(grant.grant_id)
                return PushOutcome(0, [], TransferRefused(f"refused ({msg.code}): {msg.reason}", code=msg.code,
                                                          request_id=cid, peer=peer_id))
            elif isinstance(msg, m.PushResult):
                write_s = max(write_s, msg.write_us / 1e6)
                if len(msg.written) == len(written):
                    written = msg.written
                    num_landed = self._land(block_ids, num_landed, _leading(written))
                if msg.final:
                    num = _leading(written)
                    if self.verify is not None and msg.checksums:
                        good = self.verify(block_ids[:num], msg.checksums[:num])
                        if good < num:  # the bytes that arrived are not what the writer sent: recompute them
                            self.num_checksum_failures += 1
                            log.warning("%s: block %d of %s from %s failed its checksum: %d of %d blocks kept",
                                        self.node_id, good, cid, peer_id, good, num)
                            num = good
                    self.bytes_received += num * self.block_bytes
                    if msg.code:
                        cls = TransferAborted if msg.code == m.ErrorCode.ABORTED.value else TransferError
                        error = cls(f"{msg.code}: {msg.error}", request_id=cid, peer=peer_id)
                    return PushOutcome(num, [], error, write_s)  # the dispatcher closed the grant
        # The caller gives up: stop the writer, fence the grant, keep listening for its final.
        with self._lock:
            conv.abandoned = cid in self._conversations
        self._send(peer.side_channel, m.Abort(cid, "requester gave up"))
        tainted = self.grants.revoke(grant.grant_id)
        num = min(_leading(written), grant.num_confirmed) if tainted else _leading(written)
        return PushOutcome(num, tainted, error, write_s)

    def _land(self, block_ids: list[int], num_landed: int, num_written: int) -> int:
        """Stage in the blocks written since the last report (while the rest are still in flight)."""
        if self.stage_in is not None and num_written > num_landed:
            self.stage_in(block_ids[num_landed:num_written])
        return max(num_landed, num_written)

    def _drop(self, cid: str) -> None:
        with self._lock:
            self._conversations.pop(cid, None)

    # ---- the IO thread ------------------------------------------------------------------------------------
    def _send(self, side_channel: str, msg: m.Message) -> None:
        sock = getattr(self._local, "push", None)
        if sock is None:
            sock = self._local.push = self._ctx.socket(zmq.PUSH)
            sock.linger = 1000
            sock.connect(self._outbox_addr)
        sock.send_multipart([side_channel.encode(), self._auth.seal(m.encode(msg))])

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._outbox, zmq.POLLIN)
        dealers: dict[str, zmq.Socket] = {}
        by_socket: dict[zmq.Socket, str] = {}
        while not self._stop.is_set():
            self._sweep()
            for sock in dict(poller.poll(100)):
                if sock is self._outbox:
                    while self._outbox.poll(0):
                        address, payload = self._outbox.recv_multipart()
                        address = address.decode()
                        dealer = dealers.get(address)
                        if dealer is None:
                            dealer = dealers[address] = self._ctx.socket(zmq.DEALER)
                            dealer.linger = 0
                            dealer.connect(f"tcp://{address}")
                            by_socket[dealer] = address
                            poller.register(dealer, zmq.POLLIN)
                        dealer.send(payload)
                else:
                    while sock.poll(0):
                        self._dispatch(by_socket[sock], sock.recv())
        for dealer in dealers.values():
            dealer.close()

    def _sweep(self) -> None:
        """Twice a second: quarantines whose writer's process has exited are released (IO thread)."""
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + 0.5
        released = set(self.grants.sweep())
        if released:
            with self._lock:
                for cid in [c.request_id for c in self._conversations.values() if c.grant.grant_id in released]:
                    del self._conversations[cid]
            log.warning("%s: released %d quarantines of writers that exited", self.node_id, len(released))

    def _dispatch(self, address: str, frame: bytes) -> None:
        try:
            msg = m.decode(self._auth.open_reply(frame, address))
        except (AuthError, m.MessageError) as e:
            log.warning("%s: dropped an answer from %s: %s", self.node_id, address, e)
            return
        with self._lock:
            conv = self._conversations.get(msg.request_id)
            if conv is not None and isinstance(msg, m.PushResult) and msg.final:
                del self._conversations[msg.request_id]
        if conv is None:
            return
        if isinstance(msg, m.PushResult):
            self.grants.confirm(conv.grant.grant_id, msg.written)
            if msg.final:  # the writer has stopped: an open grant closes, a quarantined one is released
                self.grants.close(conv.grant.grant_id)
                self.grants.acknowledge(conv.grant.grant_id)
        if not conv.abandoned:
            conv.events.put(msg)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        self._outbox.close()


def _leading(flags: list[bool]) -> int:
    return flags.index(False) if False in flags else len(flags)
