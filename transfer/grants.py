"""GrantTable: the receiving node's record of who may write where in its memory (docs/design.md §6).

A grant lets one writer fill a list of this node's blocks (or landing slots) for one
transfer until a deadline. The writer reports, chunk by chunk, which it wrote
(``confirm``). When the requester gives up (timeout, abort, refusal) it ``revoke``s the
grant *before* it touches the blocks again. What a revoke does depends on the grant's
fence, the proof that no byte of the transfer lands after release:

    REFUSABLE  pool blocks; the backend refuses writes   revoked at once; nothing is tainted
               outside an open grant, under the table's
               lock (zmq across hosts)
    PROCESS    pool blocks written in place by a writer  the unconfirmed blocks are quarantined:
               on this host (shared memory: a synchronous the table holds its own reference on
               copy in the writer's process)               them until the writer's final answer
                                                          (``acknowledge``), its process exit
                                                          (``sweep``) or, for a writer whose
                                                          process we cannot watch, its lease end
    LANDING    landing slots (``transfer/landing.py``):  every slot is fenced from reuse until the
               one-sided network writes (Mooncake, RDMA) writer's final answer, its lease end or
               reach KV blocks only by a verified copy    LANDING_FENCE_S; the pool's blocks were
                                                          never written by the peer: nothing tainted

    grant states:  OPEN ──close──> (gone)        writer's final result while open
                   OPEN ──revoke──> QUARANTINED ──acknowledge / writer_gone / sweep──> (gone)
                   OPEN ──revoke──> (gone)       REFUSABLE, or nothing unconfirmed (PROCESS)

The caller of ``revoke`` keeps its own references (PROCESS) and must stop using the
returned (tainted) block ids: swap them for fresh blocks and free its references; the
pool only hands them out again once the table has released its own. The table takes and
drops those references through ``run_on_owner``: on a node, messages the engine thread (the
pool's owner) runs at its next step boundary, in the order sent; a conversation revokes before
its load reports, so the table's reference is taken before the caller's is dropped. A LANDING grant's
slots belong to the conversation while the grant is open or closed, to the table once
it is revoked.
"""
from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from kvmesh.kv.block_pool import BlockPool
from kvmesh.transfer.landing import LandingZone


LANDING_FENCE_S = 120.0  # a fenced landing slot is written again after this at the latest (verified anyway)


class GrantState(Enum):
    OPEN = "open"
    QUARANTINED = "quarantined"


class Fence(Enum):
    """What proves that a revoked grant's transfer has stopped writing (the table above)."""

    REFUSABLE = "refusable"
    PROCESS = "process"
    LANDING = "landing"


@dataclass(slots=True)
class Grant:
    grant_id: str
    request_id: str
    writer_id: str
    block_ids: list[int]
    expires_at: float  # time.monotonic()
    num_confirmed: int = 0  # leading blocks the writer reported written
    state: GrantState = GrantState.OPEN
    quarantined: tuple[int, ...] = ()
    writer_alive: Callable[[], bool] | None = None  # a same-host writer's process still exists
    fence: Fence = Fence.PROCESS
    quarantined_at: float = 0.0  # time.monotonic() of the revoke


class GrantTable:
    def __init__(self, pool: BlockPool, base_addr: int, block_bytes: int, writes_refusable: bool,
                 landing: LandingZone | None = None,
                 run_on_owner: Callable[[Callable[[], None]], None] | None = None):
        """``writes_refusable``: the transfer backend calls ``guard_write`` before every incoming write.
        ``landing``: where LANDING grants' slots go back to (None: this node issues none). ``run_on_owner``:
        runs a change of the pool on the thread that owns it, in the order given (None: at once, here)."""
        self.pool = pool
        self._run_on_owner = run_on_owner or _run_here
        self.base_addr = base_addr
        self.block_bytes = block_bytes
        self.writes_refusable = writes_refusable
        self.landing = landing
        self._grants: dict[str, Grant] = {}
        self._lock = threading.Lock()
        self.num_refused_writes = 0
        self.num_quarantined_total = 0

    # ---- the requester's side ---------------------------------------------------------------------
    def issue(self, request_id: str, writer_id: str, block_ids: Sequence[int], ttl_s: float,
              writer_alive: Callable[[], bool] | None = None, fence: Fence | None = None) -> Grant:
        """A new open grant for ``writer_id`` on ``block_ids`` (pool blocks, or landing slots for a LANDING
        fence; the caller keeps owning them while the grant is open).

        ``writer_alive``: whether the writer's process still exists (writers on this host; None: unknown,
        its lease ending is taken as its end). ``fence``: None picks REFUSABLE where the backend refuses writes,
        PROCESS otherwise."""
        if fence is None:
            fence = Fence.REFUSABLE if self.writes_refusable else Fence.PROCESS
        if fence is Fence.REFUSABLE and not self.writes_refusable:
            raise ValueError("this node's transfer backend cannot refuse writes")
        if fence is Fence.LANDING and self.landing is None:
            raise ValueError("this node has no landing zone")
        grant = Grant(uuid.uuid4().hex, request_id, writer_id, list(block_ids), time.monotonic() + ttl_s,
                      writer_alive=writer_alive, fence=fence)
        with self._lock:
            self._grants[grant.grant_id] = grant
        return grant

    def confirm(self, grant_id: str, written: Sequence[bool]) -> None:
        """The writer reported these per-block flags; its leading written blocks are final."""
        num = written.index(False) if False in written else len(written)
        with self._lock:
            grant = self._grants.get(grant_id)
            if grant is not None and grant.state is GrantState.OPEN:
                grant.num_confirmed = max(grant.num_confirmed, num)

    def close(self, grant_id: str) -> None:
        """The writer's final result arrived while the grant was open: it will write no more."""
        with self._lock:
            grant = self._grants.get(grant_id)
            if grant is not None and grant.state is GrantState.OPEN:
                del self._grants[grant_id]

    def revoke(self, grant_id: str) -> list[int]:
        """Stop accepting writes under this grant; returns the ids the table now holds apart.

        PROCESS: the unconfirmed pool blocks, on which the table takes its own reference until the
        writer stops; the caller must not reuse them. LANDING: every slot of the grant, taken over
        from the caller. Empty for REFUSABLE grants, grants already closed or with nothing unconfirmed.
        """
        with self._lock:
            grant = self._grants.get(grant_id)
            if grant is None or grant.state is not GrantState.OPEN:
                return []
            held = grant.block_ids if grant.fence is Fence.LANDING else grant.block_ids[grant.num_confirmed:]
            if grant.fence is Fence.REFUSABLE or not held:
                del self._grants[grant_id]
                return []
            if grant.fence is Fence.LANDING:
                self.landing.fence(held)
            else:
                self._run_on_owner(lambda: self.pool.touch(held))
            grant.state, grant.quarantined = GrantState.QUARANTINED, tuple(held)
            grant.quarantined_at = time.monotonic()
            self.num_quarantined_total += len(held)
            return list(held)

    def acknowledge(self, grant_id: str) -> None:
        """The writer said it stopped (its final result, late): release a quarantine."""
        with self._lock:
            grant = self._grants.get(grant_id)
            if grant is None or grant.state is not GrantState.QUARANTINED:
                return
            del self._grants[grant_id]
        self._release([grant])

    def writer_gone(self, writer_id: str) -> int:
        """The writer's lease ended (it is dead or cut off): release its quarantines; returns how many blocks.

        Grants of a writer whose process is known to be alive stay: their conversations revoke them."""
        with self._lock:
            gone = [g for g in self._grants.values() if g.writer_id == writer_id and not _alive(g)]
            for g in gone:
                del self._grants[g.grant_id]
        return self._release(gone)

    def sweep(self) -> list[str]:
        """Release quarantines whose writer's process has exited since, and landing fences older than
        LANDING_FENCE_S; returns their grant ids."""
        now = time.monotonic()
        with self._lock:
            gone = [g for g in self._grants.values() if g.state is GrantState.QUARANTINED and (
                (g.writer_alive is not None and not _alive(g)) or
                (g.fence is Fence.LANDING and now - g.quarantined_at > LANDING_FENCE_S))]
            for g in gone:
                del self._grants[g.grant_id]
        self._release(gone)
        return [g.grant_id for g in gone]

    def _release(self, grants: list[Grant]) -> int:
        """Give the held ids of these (removed) grants back: slots to the landing zone, blocks to the pool."""
        slots = [s for g in grants if g.fence is Fence.LANDING for s in g.quarantined]
        blocks = [b for g in grants if g.fence is not Fence.LANDING for b in g.quarantined]
        if slots:
            self.landing.unfence(slots)
        if blocks:
            self._run_on_owner(lambda: self.pool.free(blocks))
        return len(slots) + len(blocks)

    def has(self, grant_id: str) -> bool:
        with self._lock:
            return grant_id in self._grants

    # ---- the backend's side (refusable writes) -------------------------------------------------------
    def guard_write(self, grant_id: str, ranges: Sequence[tuple[int, int]], do_write: Callable[[], None]) -> None:
        """Run ``do_write`` only if every (addr, length) lies in blocks of an open, unexpired grant.

        Holds the table's lock while writing, so a revoke never overlaps a write. Raises
        PermissionError (the backend refuses the batch) otherwise.
        """
        with self._lock:
            grant = self._grants.get(grant_id)
            if grant is None or grant.state is not GrantState.OPEN or time.monotonic() > grant.expires_at or \
                    grant.fence is Fence.LANDING:
                self.num_refused_writes += 1
                raise PermissionError(f"no open grant {grant_id[:8]}")
            allowed = set(grant.block_ids)
            for addr, length in ranges:
                first, rest = divmod(addr - self.base_addr, self.block_bytes)
                last = (addr + length - 1 - self.base_addr) // self.block_bytes
                if addr < self.base_addr or rest or length % self.block_bytes or \
                        not all(b in allowed for b in range(first, last + 1)):
                    self.num_refused_writes += 1
                    raise PermissionError(f"write at {addr:#x} (+{length}) is outside grant {grant_id[:8]}")
            do_write()

    # ---- queries ------------------------------------------------------------------------------------
    @property
    def num_open(self) -> int:
        return sum(1 for g in self._grants.values() if g.state is GrantState.OPEN)

    @property
    def num_quarantined_blocks(self) -> int:
        with self._lock:
            return sum(len(g.quarantined) for g in self._grants.values() if g.fence is not Fence.LANDING)

    @property
    def num_fenced_slots(self) -> int:
        """Landing slots held apart for given-up transfers."""
        with self._lock:
            return sum(len(g.quarantined) for g in self._grants.values() if g.fence is Fence.LANDING)

    def check_integrity(self) -> None:
        with self._lock:
            for g in self._grants.values():
                assert 0 <= g.num_confirmed <= len(g.block_ids), f"grant {g.grant_id}: confirmed out of range"
                if g.fence is Fence.LANDING:
                    assert all(0 <= s < self.landing.num_slots for s in g.quarantined), "fenced slot out of range"
                    continue
                for b in g.quarantined:
                    assert self.pool.block_state(b).ref_count >= 1, f"quarantined block {b} has no reference"
        if self.landing is not None:
            self.landing.check_integrity()


def _run_here(change: Callable[[], None]) -> None:
    change()


def _alive(grant: Grant) -> bool:
    return grant.writer_alive is not None and grant.writer_alive()
