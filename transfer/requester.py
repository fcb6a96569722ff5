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

Each conversation's grant gets the fence that proves its end (``transfer/grants.py``): a writer on
this host writes our pool blocks in place (PROCESS), a backend that refuses stray writes likewise
(REFUSABLE); a one-sided network write targets landing slots (LANDING, ``transfer/landing.py``),
and a block counts as written only once this thread has copied it into its pool block and its
crc32 matched the writer's. A writer that cannot honour a PROCESS grant (no shared memory with us)
refuses with NEEDS_LANDING and is asked again through landing slots.

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
from kvmesh.transfer.grants import Fence, Grant, GrantTable
from kvmesh.transfer.peers import PeerDirectory, PeerRecord

log = logging.getLogger("kvmesh.transfer")

ACCEPT_TIMEOUT_S = 5.0  # a prefill node answers Accepted / Refused within this
LAND_RETRY_S = 0.005  # a reported block whose bytes do not check out yet is copied again after this
LAND_GRACE_S = 0.25  # ... for at most this long after the writer's final answer


class PushOutcome(NamedTuple):
    num_written: int  # leading blocks written (and never to be written again)
    tainted_block_ids: list[int]  # stop using these: a writer may still be writing them
    error: TransferError | None
    write_s: float = 0.0  # the writer's time in its transfer engine: bytes / write_s is the link's rate
    num_reused: int = 0  # of num_written, leading blocks the writer had cached rather than computed (prefill)
    fence: str = ""  # what fenced the writes (``Fence``: refusable, process, landing)
    num_rounds: int = 0  # conversations it took (landing: one per slotful of blocks)
    first_token: tuple[int, float] | None = None  # ComputeAndPush with its tail written: the greedy token after the
    #                                               prompt and its logprob


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
        # Pushes into landing slots ask for chunks of this many blocks (0: the writer's choice), so that one is
        # copied and checked while the next is on the wire (``transfer/landing.py``: ``default_chunk_bytes``).
        self.landing_chunk_blocks = 0
        self.num_blocks_landed_early = 0  # landed while the writer was still writing (before its final answer)
        self.block_bytes = grants.block_bytes
        # A peer's record -> whether its process still exists, for writers on this host (None: cannot tell).
        self.writer_liveness: Callable[[PeerRecord], Callable[[], bool] | None] | None = None
        self.accepts_shared_writes = False  # our KV buffer is published in shared memory for same-host writers
        self._next_sweep = 0.0

    def start(self) -> KVRequester:
        self._thread.start()
        return self

    # ---- calls (any thread) ---------------------------------------------------------------------------
    def push(self, peer_id: str, block_ids: list[int], block_hashes: list[BlockHash], *, request_id: str,
             timeout_s: float = 10.0, wait_ms: int = 0, trace_context: str = "") -> PushOutcome:
        """Ask ``peer_id`` to write ``block_hashes`` into our ``block_ids`` (which the caller owns);
        ``trace_context``: the span the holder's own continues."""
        deadline_ms = max(1, min(int(timeout_s * 1000), m.MAX_WAIT_MS))
        wait_ms = min(wait_ms, deadline_ms)
        return self._converse(peer_id, block_ids, request_id, timeout_s, deadline_ms / 1000,
                              lambda cid, g, offset: m.PushRequest(
                                  cid, self.node_id, g.grant_id, list(g.block_ids),
                                  list(block_hashes[offset:offset + len(g.block_ids)]), deadline_ms, wait_ms,
                                  landing=g.fence is Fence.LANDING, in_place=g.fence is Fence.PROCESS,
                                  trace_context=trace_context,
                                  chunk_blocks=self.landing_chunk_blocks if g.fence is Fence.LANDING else 0))

    def compute_and_push(self, peer_id: str, block_ids: list[int], prompt_token_ids: list[int], first_block: int,
                         *, request_id: str, timeout_s: float, wanted_within_s: float = 0.0,
                         cache_salt: str = "", trace_context: str = "", with_tail: bool = False) -> PushOutcome:
        """Ask prefill node ``peer_id`` to compute the prompt and write blocks ``first_block..`` into ``block_ids``
        (``with_tail``: the last id takes the prompt's last block, and the outcome carries the token picked after
        the prompt, ``ComputeAndPush.with_tail``).

        ``wanted_within_s``: we would have them sooner by computing them ourselves; the prefill node refuses
        (BUSY) when it cannot beat that (0: no limit). A refusal comes back as a TransferRefused error with
        nothing written or tainted. ``trace_context``: the span the prefill node's own continues.
        """
        deadline_ms = max(1, min(int(timeout_s * 1000), m.MAX_WAIT_MS))
        wanted_ms = max(1, int(wanted_within_s * 1000)) if wanted_within_s > 0 else 0
        return self._converse(peer_id, block_ids, request_id, timeout_s, deadline_ms / 1000,
                              lambda cid, g, offset: m.ComputeAndPush(
                                  cid, self.node_id, g.grant_id, list(prompt_token_ids), first_block + offset,
                                  list(g.block_ids), deadline_ms, wanted_ms, landing=g.fence is Fence.LANDING,
                                  in_place=g.fence is Fence.PROCESS, cache_salt=cache_salt,
                                  trace_context=trace_context,
                                  with_tail=with_tail and offset + len(g.block_ids) == len(block_ids)),
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
    def _fence_for(self, writer_alive: Callable[[], bool] | None) -> Fence:
        """The proof this conversation's end will rest on (``transfer/grants.py``)."""
        if writer_alive is not None and self.accepts_shared_writes:
            return Fence.PROCESS  # a writer on this host copies into our shared buffer in place
        if self.grants.writes_refusable:
            return Fence.REFUSABLE
        return Fence.LANDING if self.grants.landing is not None else Fence.PROCESS

    def _converse(self, peer_id: str, block_ids: list[int], request_id: str, timeout_s: float, grant_s: float,
                  make_msg, compute: bool = False) -> PushOutcome:
        peer = self.directory.get(peer_id)
        if peer is None:
            return PushOutcome(0, [], TransferError("not a registered node", request_id=request_id, peer=peer_id))
        alive = self.writer_liveness(peer) if self.writer_liveness is not None else None
        fence = self._fence_for(alive)
        started = time.monotonic()

        def round_from(offset: int) -> tuple[PushOutcome, int]:
            """One conversation for block_ids[offset:] (landing: as many as slots are free); (outcome, asked)."""
            left = timeout_s - (time.monotonic() - started)
            if left <= 0:
                return PushOutcome(0, [], TransferTimeout("no time left", request_id=request_id, peer=peer_id)), 0
            slots = self.grants.landing.allocate(len(block_ids) - offset) if fence is Fence.LANDING else []
            if fence is Fence.LANDING and not slots:
                return PushOutcome(0, [], TransferError("every landing slot is in use", request_id=request_id,
                                                        peer=peer_id)), 0
            targets = block_ids[offset:offset + len(slots)] if slots else block_ids[offset:]
            return self._converse_once(peer, targets, slots, offset, request_id, left, min(grant_s, left), make_msg,
                                       compute, alive, fence), len(targets)

        outcome, asked = round_from(0)
        rounds = 1
        refused = outcome.error
        if isinstance(refused, TransferRefused) and refused.code == m.ErrorCode.NEEDS_LANDING.value and \
                fence is not Fence.LANDING and self.grants.landing is not None:
            fence = Fence.LANDING  # the writer cannot reach our shared memory: through landing slots instead
            outcome, asked = round_from(0)
            rounds += 1
        # Fewer landing slots than blocks: another round while the last one got all it asked for.
        got_all = asked > 0 and outcome.num_written == asked
        while fence is Fence.LANDING and outcome.error is None and got_all and outcome.num_written < len(block_ids):
            more, asked = round_from(outcome.num_written)
            rounds += 1
            got_all = asked > 0 and more.num_written == asked
            outcome = PushOutcome(outcome.num_written + more.num_written, more.tainted_block_ids, more.error,
                                  outcome.write_s + more.write_s, outcome.num_reused, first_token=more.first_token)
        return outcome._replace(fence=fence.value, num_rounds=rounds)

    def _converse_once(self, peer: PeerRecord, block_ids: list[int], slots: list[int], offset: int,
                       request_id: str, timeout_s: float, grant_s: float, make_msg, compute: bool,
                       alive: Callable[[], bool] | None, fence: Fence) -> PushOutcome:
        """One conversation: the writer fills ``block_ids`` (through ``slots`` when landing), blocks ``offset..``
        of the caller's request."""
        peer_id = peer.node_id
        cid = f"{request_id}/{next(self._ids)}"
        grant = self.grants.issue(cid, peer_id, slots or block_ids, grant_s + 1.0, writer_alive=alive, fence=fence)
        conv = _Conversation(cid, peer_id, peer.side_channel, grant)
        with self._lock:
            self._conversations[cid] = conv
        self._send(peer.side_channel, make_msg(cid, grant, offset))
        deadline = time.monotonic() + timeout_s
        accept_by = time.monotonic() + min(ACCEPT_TIMEOUT_S, timeout_s) if compute else None
        written = [False] * len(block_ids)
        checksums: list[int] = []
        num_landed = 0  # leading blocks in our KV buffer for good (copied out, and for slots checked)
        stuck_since = 0.0  # when the block at num_landed was first reported and did not check out
        write_s = 0.0
        error: TransferError | None = None
        while True:
            limit = min(deadline, accept_by) if accept_by is not None else deadline
            wait_s = max(0.0, limit - time.monotonic())
            if num_landed < _leading(written):  # reported blocks that did not check out yet: try again soon
                wait_s = min(wait_s, LAND_RETRY_S)
            try:
                msg = conv.events.get(timeout=wait_s)
            except queue.Empty:
                now = time.monotonic()
                if now < limit:
                    before = num_landed
                    num_landed = self._land(slots, block_ids, num_landed, _leading(written), checksums)
                    stuck_since = 0.0 if num_landed > before else stuck_since or now
                    if stuck_since and now - stuck_since > LAND_GRACE_S:  # damaged, not late: stop the writer
                        self.num_checksum_failures += 1
                        error = TransferError(f"block {num_landed} failed its checksum", request_id=cid,
                                              peer=peer_id)
                        break
                    continue
                what = "no Accepted/Refused" if accept_by is not None and limit == accept_by else "no final result"
                error = TransferTimeout(f"{what} within {limit - (deadline - timeout_s):.1f} s", request_id=cid,
                                        peer=peer_id)
                break
            if isinstance(msg, _PeerGone):  # its lease ended: dead, or (on this host) maybe only stopped
                held = self.grants.revoke(grant.grant_id)  # a dead writer's grant is gone already: []
                if held:
                    with self._lock:
                        conv.abandoned = cid in self._conversations  # its final may still come
                else:
                    self._drop(cid)
                return self._given_up(grant, slots, held, written, num_landed,
                                      TransferError("the writer left the cluster", request_id=cid, peer=peer_id),
                                      write_s)
            if isinstance(msg, m.Accepted):
                accept_by = None
            elif isinstance(msg, m.Refused):
                self._drop(cid)
                self.grants.close(grant.grant_id)
                self._free_slots(slots)
                return PushOutcome(0, [], TransferRefused(f"refused ({msg.code}): {msg.reason}", code=msg.code,
                                                          request_id=cid, peer=peer_id))
            elif isinstance(msg, m.PushResult):
                write_s = max(write_s, msg.write_us / 1e6)
                if len(msg.written) == len(written):
                    written = msg.written
                    checksums = msg.checksums or checksums
                    before = num_landed
                    num_landed = self._land(slots, block_ids, num_landed, _leading(written), checksums)
                    if not msg.final:
                        self.num_blocks_landed_early += num_landed - before
                if msg.final:
                    num = _leading(written)
                    if slots:
                        num = self._land_rest(slots, block_ids, num_landed, num, checksums, deadline)
                        self._free_slots(slots)
                    elif self.verify is not None and msg.checksums:
                        num = self.verify(block_ids[:num], msg.checksums[:num])
                    if num < _leading(written):  # the bytes that arrived are not what the writer sent: recompute
                        self.num_checksum_failures += 1
                        log.warning("%s: block %d of %s from %s failed its checksum: %d of %d blocks kept",
                                    self.node_id, num, cid, peer_id, num, _leading(written))
                    self.bytes_received += num * self.block_bytes
                    if msg.code:
                        cls = TransferAborted if msg.code == m.ErrorCode.ABORTED.value else TransferError
                        error = cls(f"{msg.code}: {msg.error}", request_id=cid, peer=peer_id)
                    first = (msg.first_token_id, msg.first_token_logprob) \
                        if msg.first_token_id >= 0 and num == len(written) else None
                    return PushOutcome(num, [], error, write_s,  # the dispatcher closed the grant
                                       min(msg.num_reused, num), first_token=first)
        # The caller gives up: stop the writer, fence the grant, keep listening for its final.
        with self._lock:
            conv.abandoned = cid in self._conversations
        self._send(peer.side_channel, m.Abort(cid, "requester gave up"))
        held = self.grants.revoke(grant.grant_id)
        return self._given_up(grant, slots, held, written, num_landed, error, write_s)

    def _given_up(self, grant: Grant, slots: list[int], held: list[int], written: list[bool], num_landed: int,
                  error: TransferError | None, write_s: float) -> PushOutcome:
        """The outcome of a conversation that ended without the writer's final answer (``held``: what the
        revoke fenced). Landing: only what was copied and checked counts, and no pool block is tainted."""
        if slots:
            fenced = set(held)
            self._free_slots([s for s in slots if s not in fenced])  # the grant had closed: nothing fenced
            self.bytes_received += num_landed * self.block_bytes
            return PushOutcome(num_landed, [], error, write_s)
        num = min(_leading(written), grant.num_confirmed) if held else _leading(written)
        return PushOutcome(num, held, error, write_s)

    def _land(self, slots: list[int], block_ids: list[int], num_landed: int, num_written: int,
              checksums: list[int]) -> int:
        """Move the blocks written since the last report into our KV buffer (while the rest are in flight):
        out of landing slots, checked (stopping at the first that does not check out), or out of a host mirror."""
        if num_written <= num_landed:
            return num_landed
        if slots:
            if len(checksums) < num_written:  # nothing to check them against: never usable
                return num_landed
            return num_landed + self.grants.landing.land(slots[num_landed:num_written],
                                                         block_ids[num_landed:num_written],
                                                         checksums[num_landed:num_written])
        if self.stage_in is not None:
            self.stage_in(block_ids[num_landed:num_written])
        return num_written

    def _land_rest(self, slots: list[int], block_ids: list[int], num_landed: int, num_written: int,
                   checksums: list[int], deadline: float) -> int:
        """After the writer's final answer: land what is left, trying again for a short while (bytes the writer
        handed over before answering may still be on their way into the slots)."""
        give_up = min(deadline, time.monotonic() + LAND_GRACE_S)
        while True:
            num_landed = self._land(slots, block_ids, num_landed, num_written, checksums)
            if num_landed >= num_written or time.monotonic() >= give_up:
                return num_landed
            time.sleep(LAND_RETRY_S)

    def _free_slots(self, slots: list[int]) -> None:
        if slots:
            self.grants.landing.free(slots)

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
                            dealer = dealers[address] = self._auth.curve_client(self._ctx.socket(zmq.DEALER))
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
