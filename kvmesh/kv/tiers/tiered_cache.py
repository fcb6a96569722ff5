"""TieredCache: a node's KV below its compute buffer (docs/tiers.md).

    tier 0  the engine's KV buffer (BlockPool)     GPU memory, or host memory on CPU
    tier 1  host memory (HostMedium)               registered with the transfer engine
    tier 2  one file on a local disk (DiskMedium)  O_DIRECT, re-adopted after a restart

Movement (one demoter thread does every write below tier 0, so no tier has two writers):

    tier 0 --copy ahead of eviction--> tier 1 --LRU victim moves--> tier 2 --LRU victim--> dropped
       ^                                  |                            |
       +------- promote (restore) --------+----------------------------+   (checksum verified)

The demoter copies the cached blocks at the head of tier 0's free queue (the next
victims) before allocation takes them; a copy is kept only if the block still holds
the same hash and was not reallocated meanwhile (``BlockPool.block_state``: its epoch). A
block evicted from tier 0 before it was copied is dropped and counted: demotion never
blocks a step. Chains stay whole across tiers: a lower-tier block's parent is always
somewhere on this node (tier 0 included); when a block leaves the node, its
descendants in lower tiers go with it.

Locks: BlockPool's lock, then this cache's. Never held during IO: slots are
reserved (or entries pinned) under the lock, bytes move outside it, the result is
committed under it again.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from kvmesh.errors import OutOfBlocksError
from kvmesh.kv.block_pool import NO_BLOCK, BlockPool
from kvmesh.kv.tiers.media import DiskLayout, DiskMedium, HostMedium
from kvmesh.kv.block_checksums import BlockChecksums
from kvmesh.kv.tiers.tier_store import TierEntry, TierStore, block_checksum
from kvmesh.openmp_pool import serial_this_thread
from kvmesh.rate_meter import RateMeter

log = logging.getLogger("kvmesh.tiers")

HOST, DISK = 1, 2


AUTO_HOST_KV_BUFFERS = 2  # a default host tier holds this many KV buffers' worth of blocks ...
AUTO_HOST_MEMORY_SHARE = 0.05  # ... and at most this share of the machine's memory


def auto_host_bytes(kv_buffer_bytes: int) -> int:
    """The default host tier (``--host-kv-gib auto``): ``AUTO_HOST_KV_BUFFERS`` KV buffers, at most
    ``AUTO_HOST_MEMORY_SHARE`` of this machine's physical memory."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        memory = 0
    return int(min(AUTO_HOST_KV_BUFFERS * kv_buffer_bytes, AUTO_HOST_MEMORY_SHARE * memory))


@dataclass(frozen=True)
class TierConfig:
    host_bytes: int = 0  # 0: no host tier
    disk_bytes: int = 0  # 0: no disk tier
    disk_path: str = ""  # folder of the tier file ("": a temporary folder, removed on close, nothing re-adopted)
    verify: bool = True  # check every block's checksum when it is promoted or served
    staging_blocks: int = 32  # registered buffer that disk blocks are read into before a push
    demote_window: int = 1024  # how far down tier 0's free queue (the next victims) each round looks
    look_gap_s: float = 0.01  # the demoter's least time between two looks at the next victims
    idle_look_s: float = 5.0  # and its longest while tier 0's free queue does not move

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0 or self.disk_bytes > 0


class RestoreResult(NamedTuple):
    num_blocks: int  # leading blocks restored into tier 0
    num_host: int
    num_disk: int
    num_corrupt: int  # checksum mismatches (dropped, never used)
    seconds: float


class Promotion(NamedTuple):
    block_ids: list[int]  # cached in tier 0, one reference each, owned by the caller
    restored: RestoreResult


class SendBlocks(NamedTuple):
    """Blocks held for one push: their source addresses in registered memory; call ``release`` after the write.
    ``checksums``: their crc32s where the source keeps them (a lower tier's, taken at demotion), else None."""

    src_addrs: list[int]
    release: Callable[[], None]
    checksums: list[int] | None = None


class TieredCache:
    def __init__(self, pool: BlockPool, kv_buffer: torch.Tensor, cfg: TierConfig, root_hash: bytes,
                 name: str = "node", checksums: BlockChecksums | None = None,
                 on_index_change: Callable[[], None] | None = None):
        """``checksums``: the node's stored checksums of tier-0 blocks: demotion takes a block's from there
        (computing it once where none is stored) and promotion leaves the one it checked there.
        ``on_index_change()``: called by the demoter thread (no lock held) while blocks' tiers changed and
        ``take_index_changes`` has not taken them yet (moves down, a re-adopted disk file)."""
        self.pool, self.cfg, self.name = pool, cfg, name
        self.checksums = checksums
        num_blocks = kv_buffer.shape[0]
        self.block_bytes = kv_buffer[0].numel() * kv_buffer.element_size()
        self._kv_bytes = kv_buffer.view(torch.uint8).view(num_blocks, self.block_bytes)
        self._lock = threading.Lock()
        self._demote_lock = threading.Lock()  # one demotion round at a time (the thread, or a test)
        self._where: dict[bytes, TierStore] = {}  # every lower-tier block -> its one store
        self._children: dict[bytes, set[bytes]] = {}  # parent hash -> lower-tier blocks whose parent it is
        self._dirty: set[bytes] = set()  # blocks whose best tier may have changed (for the index)
        self._on_index_change = on_index_change
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.stores: list[TierStore] = []
        self.host = self.disk = None
        if cfg.host_bytes >= self.block_bytes:
            self.host = TierStore("host", HOST, HostMedium(cfg.host_bytes // self.block_bytes, self.block_bytes))
            self.stores.append(self.host)
        self.staging: HostMedium | None = None
        self._free_staging: list[int] = []
        self.num_adopted = 0
        if cfg.disk_bytes > 0:
            folder = cfg.disk_path
            if not folder:
                remove_stale_temp_folders()
                self._tmp = tempfile.TemporaryDirectory(prefix=f"{TEMP_PREFIX}{os.getpid()}-")
                folder = self._tmp.name
            layout = DiskLayout(root_hash, self.block_bytes, max(1, cfg.disk_bytes // self.block_bytes))
            medium = DiskMedium(Path(folder) / f"{name}.kvtier", layout)
            self.disk = TierStore("disk", DISK, medium)
            self.stores.append(self.disk)
            self.staging = HostMedium(cfg.staging_blocks, self.block_bytes)
            self._free_staging = list(range(cfg.staging_blocks))
            if medium.reused:
                self._adopt_disk(medium)
        self.counters = dict.fromkeys(
            ("demoted_host", "demoted_disk", "dropped", "lost_undemoted", "promoted_host", "promoted_disk",
             "served_host", "served_disk", "corrupt", "bytes_demoted", "bytes_promoted"), 0)
        # Bytes per second read back from each tier (start-up probe, then every promotion).
        self.read_rates = {store.tier: RateMeter(self._probe_read_rate(store), min_amount=self.block_bytes)
                           for store in self.stores}
        self._stop = threading.Event()
        self.num_looks = 0  # the demoter thread's looks at the next victims
        self._thread = threading.Thread(target=self._run, name=f"kvmesh-demoter-{name}", daemon=True)
        pool.on_uncache = self._tier0_uncached

    def start(self) -> TieredCache:
        self._thread.start()
        return self

    # ---- queries ---------------------------------------------------------------------------------
    def tier_of(self, block_hash: bytes) -> int | None:
        """The fastest tier of this node holding the block (0: the compute buffer), None if none."""
        if self.pool.cached_block(block_hash) is not None:
            return 0
        store = self._where.get(block_hash)
        return store.tier if store is not None else None

    def lower_run(self, block_hashes: Sequence[bytes], start: int = 0) -> list[int]:
        """Tiers of the consecutive blocks from ``start`` held below tier 0 (a promotable run)."""
        out = []
        with self._lock:
            for h in block_hashes[start:]:
                store = self._where.get(h)
                if store is None:
                    break
                out.append(store.tier)
        return out

    def take_index_changes(self, block_hashes: Sequence[bytes]) -> list[tuple[bytes, int | None]]:
        """(hash, best tier or None) for these blocks and every block whose tier changed since the last call."""
        with self._lock:
            changed, self._dirty = self._dirty, set()
        changed.update(block_hashes)
        return [(h, self.tier_of(h)) for h in changed]

    def stats(self) -> dict:
        return {**{f"tier_{k}": v for k, v in self.counters.items()},
                **{f"tier_{s.name}_blocks": len(s) for s in self.stores},
                **{f"tier_{s.name}_capacity": s.num_slots for s in self.stores}}

    def read_seconds(self, tiers: Sequence[int]) -> float:
        """What restoring blocks held in these tiers should take, by the measured read rates."""
        return sum(self.block_bytes / max(self.read_rates[t].per_s, 1.0) for t in tiers)

    def _probe_read_rate(self, store: TierStore) -> float:
        """Bytes per second of reading a few slots (whatever they hold) the way a promotion does."""
        scratch = torch.empty(self.block_bytes, dtype=torch.uint8)
        num = min(8, store.num_slots)
        started = time.perf_counter()
        for slot in range(num):
            store.medium.read(slot, scratch)
        return num * self.block_bytes / max(time.perf_counter() - started, 1e-6)

    # ---- promotion (any thread) -------------------------------------------------------------------------
    def restore(self, block_hashes: Sequence[bytes], block_ids: Sequence[int]) -> RestoreResult:
        """Copy lower-tier blocks into these tier-0 blocks (the caller owns them, uncached), in order,
        until one is missing or fails its checksum (that one is dropped). Caches nothing."""
        started = time.perf_counter()
        done = host = disk = corrupt = 0
        read_s = {t: 0.0 for t in self.read_rates}
        scratch = torch.empty(self.block_bytes, dtype=torch.uint8)
        for h, block in zip(block_hashes, block_ids):
            ok = False
            with self._lock:
                store = self._where.get(h)
                if store is None:
                    break
                entry = store.get(h)
                store.pin(entry)
                store.touch(h)
            try:
                read_started = time.perf_counter()
                ok = self._read(store, entry, scratch)
                read_s[store.tier] += time.perf_counter() - read_started
                if ok:
                    self._kv_bytes[block].copy_(scratch)
                    if self.checksums is not None and self.cfg.verify:  # checked just now: these bytes' crc32
                        self.checksums.remember([block], [entry.checksum])
            finally:
                with self._lock:
                    store.unpin(entry)
                    if not ok:
                        self._discard(h)
            if not ok:
                corrupt += 1
                break
            done += 1
            host += store.tier == HOST
            disk += store.tier == DISK
        with self._lock:
            self.counters["promoted_host"] += host
            self.counters["promoted_disk"] += disk
            self.counters["bytes_promoted"] += done * self.block_bytes
            for tier, num in ((HOST, host), (DISK, disk)):
                if num:
                    self.read_rates[tier].record(num * self.block_bytes, read_s[tier])
        return RestoreResult(done, host, disk, corrupt, time.perf_counter() - started)

    def promote(self, block_hashes: Sequence[bytes], parent_block_id: int = NO_BLOCK) -> Promotion:
        """Bring the lower-tier run at the start of ``block_hashes`` into tier 0 and cache it there.

        The block ids come back with one reference each, owned by the caller (``pool.free`` them);
        none when nothing is below tier 0 or tier 0 has no room. ``parent_block_id`` (referenced by
        the caller, so allocation cannot take it) holds the hash before ``block_hashes[0]``.
        """
        n = len(self.lower_run(block_hashes))
        nothing = Promotion([], RestoreResult(0, 0, 0, 0, 0.0))
        if n == 0:
            return nothing
        try:
            block_ids = self.pool.allocate(n)
        except OutOfBlocksError:
            return nothing
        result = self.restore(block_hashes[:n], block_ids)
        self.pool.free(block_ids[result.num_blocks:])
        kept = block_ids[:result.num_blocks]
        if kept:
            kept = self.pool.cache(kept, block_hashes[:len(kept)], parent_block_id)
        return Promotion(kept, result)

    def _read(self, store: TierStore, entry: TierEntry, out: torch.Tensor) -> bool:
        """Read a pinned entry's bytes into ``out`` (CPU); False on a checksum mismatch or a read error."""
        try:
            store.medium.read(entry.slot, out)
        except OSError as e:
            log.warning("%s: reading %s slot %d failed: %s", self.name, store.name, entry.slot, e)
            return False
        return self._intact(store, entry, out)

    def _intact(self, store: TierStore, entry: TierEntry, data: torch.Tensor) -> bool:
        """``data`` (an entry's bytes) matches the checksum taken at demotion (always true with verify off)."""
        if self.cfg.verify and block_checksum(data) != entry.checksum:
            log.warning("%s: %s block %s failed its checksum: dropped, it will be recomputed", self.name,
                        store.name, entry.block_hash.hex())
            return False
        return True

    # ---- serving pushes (holder threads) ------------------------------------------------------------------
    def send_blocks(self, block_hashes: Sequence[bytes], max_blocks: int) -> SendBlocks:
        """Make the leading lower-tier blocks of ``block_hashes`` addressable in registered memory:
        host blocks in place (pinned), disk blocks read into the staging buffer (while it has room)."""
        addrs: list[int] = []
        checksums: list[int] = []
        pinned: list[tuple[TierStore, TierEntry]] = []
        staged: list[int] = []

        def release() -> None:
            with self._lock:
                for store, entry in pinned:
                    store.unpin(entry)
                self._free_staging.extend(staged)

        for h in block_hashes[:max_blocks]:
            with self._lock:
                store = self._where.get(h)
                if store is None:
                    break
                entry = store.get(h)
                if store.tier == DISK and not self._free_staging:
                    break
                store.pin(entry)
                store.touch(h)
                pinned.append((store, entry))
                slot = self._free_staging.pop() if store.tier == DISK else -1
            if store.tier == DISK:
                staged.append(slot)
            ok = self._intact(store, entry, self.host.medium.view(entry.slot)) if store.tier == HOST else \
                self._read(store, entry, self.staging.view(slot))
            if not ok:
                with self._lock:
                    self._discard(h)
                break
            addrs.append(self.host.medium.address(entry.slot) if store.tier == HOST else self.staging.address(slot))
            checksums.append(entry.checksum)
        with self._lock:
            self.counters["served_host"] += sum(1 for s, _ in pinned if s.tier == HOST)
            self.counters["served_disk"] += len(staged)
        return SendBlocks(addrs, release, checksums if self.cfg.verify else None)

    def registered_tensors(self) -> list[torch.Tensor]:
        """Host memory the transfer engine must register so pushes can read it."""
        return [m.tensor for m in (self.host.medium if self.host else None, self.staging) if m is not None]

    # ---- demotion (the demoter thread) ---------------------------------------------------------------------
    def _run(self) -> None:
        """Look at the next victims whenever tier 0's free queue moved (the pool's ``queue_moved``), at most
        every ``look_gap_s`` (a burst of frees and allocations is one look); asleep while nothing moves."""
        serial_this_thread()  # its copies make no OpenMP team beside the engine thread's (kvmesh/openmp_pool.py)
        moved_event = self.pool.queue_moved
        while not self._stop.is_set():
            moved_event.clear()  # before the look: a move during it brings the next one
            self.num_looks += 1
            copied = self.demote_now()
            if self._dirty and self._on_index_change is not None:
                self._on_index_change()
            if not copied:
                moved_event.wait(self.cfg.idle_look_s)
            self._stop.wait(self.cfg.look_gap_s)

    def demote_now(self) -> int:
        """One round: copy the next tier-0 victims down; returns how many blocks were copied."""
        if not self.stores:
            return 0
        with self._demote_lock:
            first = self.stores[0]
            next_victims = self.pool.next_victims(self.cfg.demote_window)  # pool lock first, never inside ours
            with self._lock:
                candidates = [v for v in next_victims if v.block_hash not in self._where]
            copied = 0
            scratch = torch.empty(self.block_bytes, dtype=torch.uint8)
            for block, h, parent, epoch in candidates:
                if self._stop.is_set():
                    break
                slot = self._reserve(first)
                if slot is None:
                    break
                scratch.copy_(self._kv_bytes[block])
                checksum = self.checksums.of_epoch(block, epoch) if self.checksums is not None else None
                computed = checksum is None
                if computed:
                    checksum = block_checksum(scratch)
                try:
                    first.medium.write(slot, scratch, h, parent, checksum)
                except OSError as e:
                    log.warning("%s: demoting to %s failed: %s", self.name, first.name, e)
                    self._release(first, slot)
                    break
                with self._lock:  # (uncache reports come outside the pool's lock: no lock order to keep)
                    state = self.pool.block_state(block)
                    fresh = state.block_hash == h and state.epoch == epoch
                    if fresh and computed and self.checksums is not None:  # the bytes of that epoch: keep it
                        self.checksums.remember([block], [checksum], [epoch])
                    if fresh and h not in self._where and (parent is None or self._on_node(parent)):
                        self._commit(first, slot, h, parent, checksum)
                        self.counters[f"demoted_{first.name}"] += 1
                        self.counters["bytes_demoted"] += self.block_bytes
                        copied += 1
                    else:
                        first.release(slot)
            return copied

    def _reserve(self, store: TierStore) -> int | None:
        """A free slot of ``store``, moving or dropping its LRU victims to make one (the demoter only)."""
        while True:
            with self._lock:
                slot = store.reserve()
                if slot is not None:
                    return slot
                last_tier = store is self.stores[-1]
                victim = store.victim(lambda e: not self._children.get(e.block_hash))
                if victim is None:
                    return None
                if last_tier:
                    self._drop_if_held(victim.block_hash)
                    continue
                store.pin(victim)
            # Move the victim one tier down (its bytes are pinned, IO outside the lock).
            below = self.stores[self.stores.index(store) + 1]
            slot_below = self._reserve(below)
            moved = False
            if slot_below is not None:
                try:
                    below.medium.write(slot_below, store.medium.view(victim.slot), victim.block_hash, victim.parent,
                                       victim.checksum)
                    moved = True
                except OSError as e:
                    log.warning("%s: moving a block to %s failed: %s", self.name, below.name, e)
            with self._lock:
                store.unpin(victim)
                h = victim.block_hash
                if moved and not victim.doomed and self._where.get(h) is store:
                    self._forget(store, h)
                    self._commit(below, slot_below, h, victim.parent, victim.checksum)
                    self.counters[f"demoted_{below.name}"] += 1
                    self.counters["bytes_demoted"] += self.block_bytes
                else:
                    if slot_below is not None:
                        below.release(slot_below)
                    if self._where.get(h) is store:
                        self._drop_if_held(h)

    def _release(self, store: TierStore, slot: int) -> None:
        with self._lock:
            store.release(slot)

    # ---- bookkeeping (under self._lock) -----------------------------------------------------------------------
    def _on_node(self, block_hash: bytes) -> bool:
        return block_hash in self._where or self.pool.cached_block(block_hash) is not None

    def _commit(self, store: TierStore, slot: int, h: bytes, parent: bytes | None, checksum: int) -> None:
        store.commit(slot, h, parent, checksum)
        self._where[h] = store
        if parent is not None:
            self._children.setdefault(parent, set()).add(h)
        self._dirty.add(h)

    def _forget(self, store: TierStore, h: bytes) -> TierEntry:
        entry = store.remove(h)
        del self._where[h]
        if entry.parent is not None:
            siblings = self._children.get(entry.parent)
            if siblings is not None:
                siblings.discard(h)
                if not siblings:
                    del self._children[entry.parent]
        self._dirty.add(h)
        return entry

    def _discard(self, h: bytes) -> None:
        """A block failed its checksum or could not be read: counted, dropped, never used."""
        self.counters["corrupt"] += 1
        self._drop_if_held(h)

    def _drop_if_held(self, h: bytes) -> None:
        """Drop a block from the lower tiers; if it left the node, its lower-tier descendants go too."""
        store = self._where.get(h)
        if store is None:
            return
        self._forget(store, h)
        self.counters["dropped"] += 1
        if self.pool.cached_block(h) is None:
            self._drop_descendants(h)

    def _drop_descendants(self, h: bytes) -> None:
        stack = list(self._children.get(h, ()))
        while stack:
            child = stack.pop()
            store = self._where.get(child)
            if store is None:
                continue
            stack.extend(self._children.get(child, ()))
            self._forget(store, child)
            self.counters["dropped"] += 1

    def _tier0_uncached(self, h: bytes, parent: bytes | None) -> None:
        """BlockPool hook (after its lock is released): a block left tier 0."""
        with self._lock:
            store = self._where.get(h)
            if store is not None:
                store.touch(h)  # demoted: it is the most recently evicted block of its tier now
                self._dirty.add(h)
                return
            if self.pool.cached_block(h) is not None:
                return  # cached again (by another thread) before this report came: its chain stands
            if self.stores:
                self.counters["lost_undemoted"] += 1
            self._drop_descendants(h)

    def _adopt_disk(self, medium: DiskMedium) -> None:
        """A restarted node takes back the blocks its disk file holds: whole chains only, one copy each."""
        headers = {}
        for header in medium.scan():
            headers.setdefault(header.block_hash, header)
        by_parent: dict[bytes | None, list] = {}
        for header in headers.values():
            by_parent.setdefault(header.parent, []).append(header)
        stack = list(by_parent.get(None, ()))
        while stack:
            header = stack.pop()
            self.disk.adopt(header.slot)
            self._commit(self.disk, header.slot, header.block_hash, header.parent, header.checksum)
            stack.extend(by_parent.get(header.block_hash, ()))
        self.num_adopted = len(self._where)
        log.info("%s: re-adopted %d blocks from %s", self.name, self.num_adopted, medium.path)

    # ---- life ------------------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Every store consistent; every lower-tier block in one store; chains whole across tiers (a parent in a
        lower tier, in tier 0, or just uncached from tier 0 with the pool's report on its way here)."""
        with self._lock:  # a report on its way waits for this lock: the pool's picture below matches ours
            held: dict[bytes, TierStore] = {}
            for store in self.stores:
                store.check_integrity()
                for h in store.hashes():
                    assert h not in held, f"block {h.hex()} is in two lower tiers"
                    held[h] = store
            assert held == self._where, "the tier map drifted from the stores"
            parents = {h: store.get(h).parent for h, store in held.items()}
            in_tier0, reported = self.pool.cached_or_reported([p for p in parents.values() if p is not None])
            children: dict[bytes, set[bytes]] = {}
            for h, parent in parents.items():
                if parent is not None:
                    assert parent in held or parent in in_tier0 or parent in reported, \
                        f"{held[h].name} block {h.hex()} is an orphan (parent gone)"
                    children.setdefault(parent, set()).add(h)
            assert children == self._children, "the child map drifted"
            if self.staging is not None:
                assert len(set(self._free_staging)) == len(self._free_staging) <= self.staging.num_slots

    def close(self) -> None:
        self._stop.set()
        self.pool.queue_moved.set()  # the demoter may be waiting for the queue to move
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if self.pool.on_uncache == self._tier0_uncached:
            self.pool.on_uncache = None
        for store in self.stores:
            store.medium.close()
        if self._tmp is not None:
            self._tmp.cleanup()


TEMP_PREFIX = "kvmesh-disk-tier-"  # + the owner's pid + "-": folders of dead owners are removed at start-up


def remove_stale_temp_folders(root: str | None = None) -> list[str]:
    """Remove default disk-tier folders (KV of a crashed node) whose owning process is gone; returns them.

    Only folders this user owns, named ``kvmesh-disk-tier-<pid>-...``, whose pid no longer runs."""
    removed = []
    root = root or tempfile.gettempdir()
    for entry in os.scandir(root):
        if not entry.name.startswith(TEMP_PREFIX) or not entry.is_dir(follow_symlinks=False):
            continue
        pid_text = entry.name[len(TEMP_PREFIX):].split("-", 1)[0]
        if not pid_text.isdigit() or entry.stat(follow_symlinks=False).st_uid != os.geteuid():
            continue
        try:
            os.kill(int(pid_text), 0)
            continue  # its owner still runs
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # a process of someone else runs under that pid
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
        log.warning("removed %s: the KV of a node that did not clean up after itself", entry.path)
    return removed
