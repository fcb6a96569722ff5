"""GrantTable: the receiving node's record of who may write which of its blocks (docs/design.md §6).

A grant lets one writer fill a list of this node's blocks for one transfer until
a deadline. The writer reports, chunk by chunk, which blocks it wrote
(``confirm``); a block it confirmed is never written again. When the requester
gives up (timeout, abort, refusal) it ``revoke``s the grant *before* it touches
the blocks again:

    backend refuses writes outside a grant (zmq)   revoked at once; nothing is tainted
    one-sided writes (Mooncake, shared memory)     the unconfirmed blocks are quarantined:
                                                   the table holds its own reference on
                                                   them until the writer acknowledges it
                                                   stopped (``acknowledge``) or its lease
                                                   ends (``writer_gone``)

A writer on this host has a liveness check (``writer_alive``: its process, through a
pidfd). Its lease ending then proves nothing (a stopped process loses its lease and,
resumed, finishes the write it had begun): its grants are revoked, not dropped, and
stay quarantined until its final result or until its process has exited (``sweep``).

    grant states:  OPEN ──close──> (gone)        writer's final result while open
                   OPEN ──revoke──> QUARANTINED ──acknowledge / writer_gone──> (gone)
                   OPEN ──revoke──> (gone)       refusable backend, or nothing unconfirmed

The caller of ``revoke`` keeps its own references and must stop using the
returned (tainted) block ids: swap them for fresh blocks and free its references;
the pool only hands them out again once the table has released its own.
"""
from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from kvmesh.kv.block_pool import BlockPool


class GrantState(Enum):
    OPEN = "open"
    QUARANTINED = "quarantined"


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


class GrantTable:
    def __init__(self, pool: BlockPool, base_addr: int, block_bytes: int, writes_refusable: bool):
        """``writes_refusable``: the transfer backend calls ``guard_write`` before every incoming write."""
        self.pool = pool
        self.base_addr = base_addr
        self.block_bytes = block_bytes
        self.writes_refusable = writes_refusable
        self._grants: dict[str, Grant] = {}
        self._lock = threading.Lock()
        self.num_refused_writes = 0
        self.num_quarantined_total = 0

    # ---- the requester's side ---------------------------------------------------------------------
    def issue(self, request_id: str, writer_id: str, block_ids: Sequence[int], ttl_s: float,
              writer_alive: Callable[[], bool] | None = None) -> Grant:
        """A new open grant for ``writer_id`` on ``block_ids`` (the caller keeps owning the blocks).

        ``writer_alive``: whether the writer's process still exists (writers on this host; None: unknown,
        its lease ending is taken as its end)."""
        grant = Grant(uuid.uuid4().hex, request_id, writer_id, list(block_ids), time.monotonic() + ttl_s,
                      writer_alive=writer_alive)
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
        """Stop accepting writes under this grant; returns the block ids the caller must not reuse.

        Empty when the backend refuses late writes or every block was confirmed. Otherwise
        the table takes its own reference on the unconfirmed blocks until the writer stops.
        """
        with self._lock:
            grant = self._grants.get(grant_id)
            if grant is None or grant.state is not GrantState.OPEN:
                return []
            tainted = grant.block_ids[grant.num_confirmed:]
            if self.writes_refusable or not tainted:
                del self._grants[grant_id]
                return []
            self.pool.touch(tainted)
            grant.state, grant.quarantined = GrantState.QUARANTINED, tuple(tainted)
            self.num_quarantined_total += len(tainted)
            return list(tainted)

    def acknowledge(self, grant_id: str) -> None:
        """The writer said it stopped (its final result, late): release a quarantine."""
        with self._lock:
            grant = self._grants.get(grant_id)
            if grant is None or grant.state is not GrantState.QUARANTINED:
                return
            del self._grants[grant_id]
        self.pool.free(grant.quarantined)

    def writer_gone(self, writer_id: str) -> int:
        """The writer's lease ended (it is dead or cut off): release its quarantines; returns how many blocks.

        Grants of a writer whose process is known to be alive stay: their conversations revoke them."""
        with self._lock:
            gone = [g for g in self._grants.values() if g.writer_id == writer_id and not _alive(g)]
            for g in gone:
                del self._grants[g.grant_id]
        released = [b for g in gone if g.state is GrantState.QUARANTINED for b in g.quarantined]
        self.pool.free(released)
        return len(released)

    def sweep(self) -> list[str]:
        """Release quarantines whose writer's process has exited since; returns their grant ids."""
        with self._lock:
            gone = [g for g in self._grants.values()
                    if g.state is GrantState.QUARANTINED and g.writer_alive is not None and not _alive(g)]
            for g in gone:
                del self._grants[g.grant_id]
        self.pool.free([b for g in gone for b in g.quarantined])
        return [g.grant_id for g in gone]

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
            if grant is None or grant.state is not GrantState.OPEN or time.monotonic() > grant.expires_at:
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
            return sum(len(g.quarantined) for g in self._grants.values())

    def check_integrity(self) -> None:
        with self._lock:
            for g in self._grants.values():
                assert 0 <= g.num_confirmed <= len(g.block_ids), f"grant {g.grant_id}: confirmed out of range"
                for b in g.quarantined:
                    assert self.pool.ref_count(b) >= 1, f"quarantined block {b} has no reference"


def _alive(grant: Grant) -> bool:
    return grant.writer_alive is not None and grant.writer_alive()
