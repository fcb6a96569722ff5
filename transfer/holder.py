"""KVHolder: the writer's side of a transfer conversation (any node holding blocks; prefill nodes).

For each PushRequest / ComputeAndPush on the side channel it resolves the
requester in the node directory (address, base, buffer size: never from the
message), bounds-checks the granted block ids, and then writes the wanted blocks
as they become matchable in its own pool, in chain order, one batched transfer
per chunk (at most the request's ``chunk_blocks``), each chunk reported with a
PushResult. Pending pushes are driven by one watcher thread that sleeps on the
holder's own change counter (no thread is parked per push), bumped by its
messages, its finished writes and the node when blocks become matchable
(``blocks_cached``); the writes themselves run on a small worker pool. A
ComputeAndPush ``with_tail`` is written its prompt's last block after the
chain, once the compute hook holds it (``ComputeHook.tail_block``), and told
the token picked after the prompt in its final answer (``first_token``).

Before every write the push's abort flag and deadline are checked; its deadline
starts when the message arrives and is capped at MAX_WAIT_MS. The final
PushResult is the writer's promise that it will not write again: it goes out only
when no write of the push is running (a Mooncake batch that outlived its timeout
holds it back until the batch really ends). Source blocks (``block_source``: the
pool, then lower KV tiers) are held while written and always released. A requester
on this host that publishes its buffer in shared memory is written with one copy
(``shared``, ``transfer/shared_memory.py``) instead of through the engine.

Where the destination is (``landing`` on the request): landing slots of the requester are
written through the engine, each chunk with the crc32 of every block it sends (the requester
copies a slot into its KV buffer only when it checks out). KV blocks themselves are written
only where the requester can fence the write: through shared memory when the request says
``in_place`` (the requester fences it by our process), or through an engine that refuses stray
writes (zmq); a one-sided engine otherwise refuses them (NEEDS_LANDING).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Protocol

from kvmesh.kv.block_hash import BlockHash
from kvmesh.kv.block_pool import BlockPool
from kvmesh.kv.change_signal import ChangeSignal
from kvmesh.kv.tiers.tiered_cache import SendBlocks
from kvmesh.tracing import NO_SPAN, Tracer
from kvmesh.transfer import messages as m
from kvmesh.transfer.block_source import BlockSource, PoolSource, TieredSource
from kvmesh.transfer.coalesce import address_descriptors
from kvmesh.transfer.engine import TransferEngine
from kvmesh.transfer.errors import TransferError, TransferRefused, TransferTimeout
from kvmesh.transfer.peers import PeerDirectory, PeerRecord
from kvmesh.transfer.shared_memory import SharedMemoryWriter

log = logging.getLogger("kvmesh.transfer")

MAX_PENDING_PUSHES = 512


class ComputeHook(Protocol):
    """What a prefill node plugs into its holder to serve ComputeAndPush."""

    def admit(self, msg: m.ComputeAndPush) -> list[BlockHash]:
        """Validate and start computing the prompt; returns the hashes of the granted blocks.

        Raises TransferRefused (with an ErrorCode) when the prompt cannot be taken; called on a
        worker thread, must return quickly (the requester waits for Accepted/Refused).
        """

    def release(self, request_id: str) -> None:
        """The conversation ended (done, aborted, expired): drop whatever admit started."""

    def tail_block(self, request_id: str) -> int | None:
        """The pool block holding the prompt's partial last block, once the whole prompt is computed (referenced
        until ``release``); None before, or when the conversation asked for no tail."""

    def num_reused(self, request_id: str) -> int:
        """Of the granted blocks, how many (leading) this node had (cached, promoted or pulled) rather than
        computed for this conversation; asked before ``release``."""

    def first_token(self, request_id: str) -> tuple[int, float] | None:
        """The token picked greedily after the whole prompt, and its logprob, once computed; None before, or when
        the conversation asked for no tail. Asked before ``release``."""


@dataclass(slots=True)
class _Push:
    request_id: str
    identity: bytes
    requester: PeerRecord
    grant_id: str
    dst_block_ids: list[int]
    expires_at: float  # never write after this
    wait_until: float  # stop waiting for missing blocks after this
    block_hashes: list[BlockHash] = field(default_factory=list)
    written: list[bool] = field(default_factory=list)
    num_written: int = 0
    ready: bool = True  # False while a compute admission runs
    busy: bool = False  # a write (or a native batch that outlived its timeout) is running
    abort_reason: str = ""
    code: str = ""
    error: str = ""
    compute: bool = False
    write_s: float = 0.0  # time spent in the transfer engine
    checksums: list[int] = field(default_factory=list)  # per block, when the holder checksums what it sends
    landing: bool = False  # dst ids are the requester's landing slots
    in_place: bool = False  # the requester fences same-host copies into its shared memory (else: the engine)
    chunk_blocks: int = 0  # at most this many blocks per write (0: every block available)
    tail: bool = False  # ComputeAndPush ``with_tail``: the last dst id takes the prompt's partial last block
    span: object = NO_SPAN  # its trace span (kvmesh/tracing.py), when the requester's request is traced


class KVHolder:
    def __init__(self, node_id: str, pool: BlockPool, engine: TransferEngine, base_addr: int, block_bytes: int,
                 directory: PeerDirectory, reply: Callable[[bytes, m.Message], None], num_workers: int = 4,
                 stage_out: Callable[[list[int]], None] | None = None, tracer: Tracer | None = None,
                 tiers=None, compute: ComputeHook | None = None):
        """``reply(identity, msg)`` sends on the side channel (any thread). ``stage_out(block_ids)`` copies
        pool blocks into the registered memory before they are written (``transfer/kv_memory.py``). ``tracer``:
        a ``holder.push`` span per push of a traced request. ``tiers``: the node's lower KV tiers
        (``TieredCache``), whose blocks pushes send past the pool's cached prefix (None: the pool's only).
        ``compute``: what serves ComputeAndPush (None: refused, NOT_A_PREFILL_NODE)."""
        self.tracer = tracer or Tracer("")
        self.node_id = node_id
        self.pool = pool
        self.engine = engine
        self.base_addr = base_addr
        self.block_bytes = block_bytes
        self.directory = directory
        self.stage_out = stage_out
        self.source: BlockSource = PoolSource(pool, base_addr, block_bytes, stage_out) if tiers is None else \
            TieredSource(pool, base_addr, block_bytes, tiers, stage_out)
        # crc32 of the blocks at these source addresses (None: cannot checksum). Sent with every PushResult into
        # landing slots, and with the others too when ``checksum_all``.
        self.checksum: Callable[[list[int]], list[int]] | None = None
        self.checksum_all = False
        self.engine_refusable = hasattr(engine, "set_write_guard")  # receivers of this backend refuse stray writes
        self.compute = compute
        self.shared: SharedMemoryWriter | None = None  # same-host writes (None: always the engine)
        self._reply = reply
        self._pushes: dict[str, _Push] = {}
        self._lock = threading.Lock()
        self._workers = ThreadPoolExecutor(num_workers, thread_name_prefix=f"kvmesh-push-{node_id}")
        self._checksums = ThreadPoolExecutor(num_workers, thread_name_prefix=f"kvmesh-push-crc-{node_id}")
        self._stop = threading.Event()
        self._work = ChangeSignal()  # bumped whenever a pending push may be able to move on
        self._watcher = threading.Thread(target=self._watch, name=f"kvmesh-holder-{node_id}", daemon=True)
        self.bytes_sent = 0
        self.num_refused: dict[str, int] = {}

    def start(self) -> KVHolder:
        self._watcher.start()
        return self

    def blocks_cached(self) -> None:
        """Blocks became matchable in the pool (any thread): pushes waiting for them look again."""
        self._work.notify()

    @property
    def num_pending(self) -> int:
        return len(self._pushes)

    # ---- messages (side-channel thread) -----------------------------------------------------------------
    def on_message(self, identity: bytes, msg: m.Message) -> None:
        if isinstance(msg, m.Abort):
            self._abort(identity, msg)
            return
        is_compute = isinstance(msg, m.ComputeAndPush)
        now = time.monotonic()
        wait_ms = msg.deadline_ms if is_compute else msg.wait_ms
        code, reason, requester = self._authorise(msg)
        if code is m.ErrorCode.NONE and is_compute and self.compute is None:
            code, reason = m.ErrorCode.NOT_A_PREFILL_NODE, f"{self.node_id} does not compute prompts"
        if code is not m.ErrorCode.NONE:
            self._refuse(identity, msg.request_id, code, reason)
            return
        push = _Push(msg.request_id, identity, requester, msg.grant_id, list(msg.dst_block_ids),
                     now + msg.deadline_ms / 1000, now + wait_ms / 1000, written=[False] * len(msg.dst_block_ids),
                     ready=not is_compute, compute=is_compute, landing=msg.landing, in_place=msg.in_place)
        if is_compute:
            push.tail = msg.with_tail
        else:
            push.block_hashes = list(msg.block_hashes)
            push.chunk_blocks = msg.chunk_blocks
        push.span = self.tracer.start("holder.push", msg.trace_context, {
            "kvmesh.node": self.node_id, "kvmesh.requester": msg.requester_id, "kvmesh.blocks": len(msg.dst_block_ids),
            "kvmesh.landing": msg.landing, "kvmesh.compute": is_compute})
        with self._lock:
            if msg.request_id in self._pushes:
                code = m.ErrorCode.BUSY
            else:
                self._pushes[msg.request_id] = push
        if code is not m.ErrorCode.NONE:
            self._refuse(identity, msg.request_id, code, "request id already in progress")
        elif is_compute:
            self._workers.submit(self._admit, push, msg)
        else:
            self._work.notify()

    def _authorise(self, msg) -> tuple[m.ErrorCode, str, PeerRecord | None]:
        requester = self.directory.get(msg.requester_id)
        if requester is None:
            return m.ErrorCode.UNKNOWN_REQUESTER, f"{msg.requester_id!r} is not a registered node", None
        if msg.landing and max(msg.dst_block_ids) >= requester.num_landing_slots:
            return (m.ErrorCode.OUT_OF_BOUNDS, f"slot id past {requester.node_id}'s {requester.num_landing_slots} "
                    "landing slots", None)
        if not msg.landing and max(msg.dst_block_ids) >= requester.num_blocks:
            return m.ErrorCode.OUT_OF_BOUNDS, f"block id past {requester.node_id}'s {requester.num_blocks}", None
        if requester.block_bytes != self.block_bytes:
            return m.ErrorCode.LAYOUT_MISMATCH, f"block bytes {requester.block_bytes} != {self.block_bytes}", None
        if msg.landing and self.checksum is None:
            return m.ErrorCode.WRITE_FAILED, "this holder cannot checksum what it sends into landing slots", None
        if not msg.landing and not self.engine_refusable and not (msg.in_place and self._can_share(requester)):
            return m.ErrorCode.NEEDS_LANDING, "one-sided writes into KV blocks are refused: use landing slots", None
        if len(self._pushes) >= MAX_PENDING_PUSHES:
            return m.ErrorCode.BUSY, f"{MAX_PENDING_PUSHES} transfers already in progress", None
        if self._stop.is_set():
            return m.ErrorCode.SHUTTING_DOWN, "shutting down", None
        return m.ErrorCode.NONE, "", requester

    def _can_share(self, requester: PeerRecord) -> bool:
        return self.shared is not None and self.shared.can_write(requester)

    def _refuse(self, identity: bytes, request_id: str, code: m.ErrorCode, reason: str) -> None:
        self.num_refused[code.value] = self.num_refused.get(code.value, 0) + 1
        log.log(logging.INFO if code is m.ErrorCode.BUSY else logging.WARNING, "%s: refused transfer %s: %s (%s)",
                self.node_id, request_id, code.value, reason)  # busy: the protocol's answer, counted; not a fault
        self._reply(identity, m.Refused(request_id, code.value, reason))

    def _admit(self, push: _Push, msg: m.ComputeAndPush) -> None:
        """Worker thread: a prefill node takes the prompt (or refuses it) and answers at once."""
        try:
            hashes = self.compute.admit(msg)
            if len(hashes) != len(push.dst_block_ids) - push.tail:
                raise TransferRefused("the prompt's blocks do not match the granted ones",
                                      code=m.ErrorCode.INVALID_PROMPT.value)
        except Exception as e:
            code = e.code if isinstance(e, TransferRefused) else m.ErrorCode.INVALID_PROMPT.value
            with self._lock:
                self._pushes.pop(push.request_id, None)
            self.compute.release(push.request_id)
            self._refuse(push.identity, push.request_id, m.ErrorCode(code), str(e))
            return
        push.block_hashes = hashes
        self._reply(push.identity, m.Accepted(push.request_id))
        push.ready = True
        self._work.notify()

    def _abort(self, identity: bytes, msg: m.Abort) -> None:
        with self._lock:
            push = self._pushes.get(msg.request_id)
            if push is not None:
                push.abort_reason = msg.reason or "aborted by the requester"
        if push is None:  # nothing running: say so, so the requester can release a quarantine
            self._reply(identity, m.PushResult(msg.request_id, [], final=True, code=m.ErrorCode.ABORTED.value))
        else:
            self._work.notify()

    # ---- the watcher: decides, never writes ------------------------------------------------------------------
    def _watch(self) -> None:
        seen = -1
        while not self._stop.is_set():
            seen = self._work.wait(seen, 0.25)
            now = time.monotonic()
            with self._lock:
                pushes = [p for p in self._pushes.values() if not p.busy and p.ready]
            for push in pushes:
                more = self._num_available(push) > push.num_written
                if push.abort_reason or push.code or now > push.expires_at or \
                        push.num_written == len(push.written) or (not more and now > push.wait_until):
                    self._finish(push, now)
                elif more:
                    push.busy = True
                    self._workers.submit(self._write_next, push)

    def _num_available(self, push: _Push) -> int:
        """Leading blocks of the push this node can send now: its chain's, then its tail once computed."""
        num = self.source.num_available(push.block_hashes)
        if push.tail and num == len(push.block_hashes) and self.compute.tail_block(push.request_id) is not None:
            num += 1
        return num

    def _acquire(self, push: _Push, max_blocks: int) -> SendBlocks:
        """The push's next blocks from the source; past its chain, the tail (held by the compute hook until the
        conversation is released)."""
        if not push.tail or push.num_written < len(push.block_hashes):
            return self.source.acquire(push.block_hashes, push.num_written, max_blocks)
        block_id = self.compute.tail_block(push.request_id)
        if block_id is None:
            return SendBlocks([], lambda: None)
        if self.stage_out is not None:
            self.stage_out([block_id])
        return SendBlocks([self.base_addr + block_id * self.block_bytes], lambda: None)

    def _finish(self, push: _Push, now: float) -> None:
        if not push.code:
            if push.abort_reason:
                push.code, push.error = m.ErrorCode.ABORTED.value, push.abort_reason
            elif push.num_written < len(push.written) and now > push.expires_at:
                push.code, push.error = m.ErrorCode.EXPIRED.value, "deadline passed before every block was written"
        with self._lock:
            self._pushes.pop(push.request_id, None)
        num_reused, first = 0, None
        if push.compute:
            num_reused = min(self.compute.num_reused(push.request_id), push.num_written)
            if push.tail and push.num_written == len(push.written):  # the tail written: the token after it too
                first = self.compute.first_token(push.request_id)
            self.compute.release(push.request_id)
        if push.span is not NO_SPAN:
            push.span.set_attributes({"kvmesh.blocks_written": push.num_written, "kvmesh.write_ms": push.write_s * 1e3,
                                      "kvmesh.bytes_sent": push.num_written * self.block_bytes,
                                      "kvmesh.checksummed": bool(push.checksums), "kvmesh.code": push.code})
            push.span.end()
        self._reply(push.identity, m.PushResult(push.request_id, list(push.written), final=True, code=push.code,
                                                error=push.error, write_us=int(push.write_s * 1e6),
                                                checksums=list(push.checksums), num_reused=num_reused,
                                                **({} if first is None else {"first_token_id": first[0],
                                                                             "first_token_logprob": first[1]})))

    # ---- writes (worker threads) ----------------------------------------------------------------------
    def _write_next(self, push: _Push) -> None:
        release = None
        keep_busy = False
        checksums: Future | None = None
        try:
            left = len(push.written) - push.num_written
            acquired = self._acquire(push, min(left, push.chunk_blocks) if push.chunk_blocks else left)
            release = acquired.release
            num = len(acquired.src_addrs)
            remaining = push.expires_at - time.monotonic()
            if not num or push.abort_reason or remaining <= 0:
                return
            start, end = push.num_written, push.num_written + num
            base = push.requester.landing_addr if push.landing else push.requester.base_addr
            dst_addrs = [base + b * self.block_bytes for b in push.dst_block_ids[start:end]]
            shared = not push.landing and push.in_place and self._can_share(push.requester)
            if not push.landing and not shared and not self.engine_refusable:
                raise TransferError("the requester's shared memory cannot be written any more",
                                    request_id=push.request_id, peer=push.requester.node_id)
            descriptors = address_descriptors(acquired.src_addrs, dst_addrs, self.block_bytes,
                                              0 if shared else self.engine.max_descriptor_bytes)
            # Of the bytes about to be sent, held until the write ends: the receiver compares. Computed while
            # the write runs. Always for landing slots; a shared-memory copy never leaves the machine and is not
            # checksummed (unless earlier chunks of this push went over the network).
            wanted = push.landing or (self.checksum_all and (not shared or bool(push.checksums)))
            if acquired.checksums is not None and wanted:  # the source keeps them (a lower tier's)
                checksums = Future()
                checksums.set_result(acquired.checksums)
            else:
                checksums = self._checksums.submit(self.checksum, acquired.src_addrs) \
                    if self.checksum is not None and wanted else None
            started = time.perf_counter()
            try:
                if shared:
                    self.shared.write(push.requester, descriptors, request_id=push.request_id,
                                      deadline=push.expires_at)
                else:
                    self.engine.write(push.requester.transfer_endpoint, descriptors, request_id=push.request_id,
                                      grant_id=push.grant_id, timeout_s=remaining)
                push.write_s += time.perf_counter() - started
            except TransferTimeout as e:
                if e.pending is not None:  # still running natively: stay busy and hold the sources until it ends
                    keep_busy = True
                    held, release = release, None
                    e.pending.add_done_callback(lambda _f: self._write_ended(push, held))
                raise
            if checksums is not None:
                if not push.checksums:
                    push.checksums = [0] * len(push.written)
                push.checksums[start:end] = checksums.result()
            push.written[start:end] = [True] * num
            push.num_written = end
            self.bytes_sent += num * self.block_bytes
            if end < len(push.written):
                self._reply(push.identity, m.PushResult(push.request_id, list(push.written), final=False,
                                                        write_us=int(push.write_s * 1e6),
                                                        checksums=list(push.checksums)))
        except Exception as e:  # a failed write ends the push with an error; the holder keeps serving
            push.code, push.error = m.ErrorCode.WRITE_FAILED.value, f"{type(e).__name__}: {e}"
            log.warning("%s: push %s failed: %s", self.node_id, push.request_id, push.error)
        finally:
            if checksums is not None:
                wait([checksums])  # it reads the sources: done before they are released
            try:
                if release is not None:
                    release()
            finally:
                if not keep_busy:
                    push.busy = False
                    self._work.notify()

    def _write_ended(self, push: _Push, release: Callable[[], None]) -> None:
        release()
        push.busy = False
        self._work.notify()

    def close(self) -> None:
        self._stop.set()
        self._work.notify()
        if self._watcher.is_alive():
            self._watcher.join(timeout=2)
        self._workers.shutdown(wait=True, cancel_futures=True)
        self._checksums.shutdown(wait=True)
        with self._lock:
            pushes = list(self._pushes.values())
        for push in pushes:  # tell requesters we stopped (they release their grants)
            push.code = push.code or m.ErrorCode.SHUTTING_DOWN.value
            self._finish(push, time.monotonic())
