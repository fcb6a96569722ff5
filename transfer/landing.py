"""LandingZone: where one-sided network writes land, so that a late byte can never reach a KV block.

A Mooncake (or RDMA) write cannot be refused by its receiver, and a writer's "I stopped"
does not prove its bytes stopped: what is already in its socket buffers, in its transfer
lanes, on the link or in our receive path is still written into our memory afterwards,
by our own engine (docs/design.md §6). So such writes never target KV blocks. They target
slots of this zone, a separate registered host buffer, and reach the KV buffer only by a
copy that this node makes itself, checked against the writer's crc32 of each block:

    peer ──one-sided write──> slot s ──copy──> KV block b ──crc32(b) == writer's?──> usable
                              (late writes       (never written by
                               land here only)    anyone but us)

    host KV buffer    copy s -> b and crc32 of b in one pass (piece by piece, still in cache)
    device KV buffer  copy s -> b (to the device), then crc32 of b on the device (one kernel
                      launch for the whole landing: ``kernels/triton/block_crc32.py``)

Either way the check reads b itself, what the request will read: bytes written into s after
the copy cannot reach it.

A late write can therefore only damage a slot; a damaged slot fails its check, and the
block is recomputed, never served. Slots of a given-up transfer are held apart
(``GrantTable`` quarantines them) until the writer's final answer, its departure or an
age cap, so that late bytes rarely meet a new transfer's slot; correctness does not
depend on that hold, only the rate of checksum failures does.

Thread-safe: requester threads allocate, land and free concurrently.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import torch

from kvmesh.transfer.coalesce import coalesce

DEFAULT_MAX_BYTES = 1 << 30  # an automatic zone is at most this large ...
DEFAULT_FRACTION = 4  # ... and at most a quarter of the KV buffer's blocks (at least MIN_SLOTS)
MIN_SLOTS = 64


PIPELINE_CHUNK_BYTES = 8 * 2**20  # a pipelined receive asks for chunks of about this size ...
PIPELINE_MIN_CPUS = 8  # ... where the landing has cores of its own: RDMA, or TCP on a machine with this many


def default_chunk_bytes(transport: str, num_cpus: int) -> int:
    """How large the chunks of a push into landing slots should be (0: one write of everything available).

    Chunks let the copy and check of chunk k run while chunk k+1 is on the wire. That pays only where the wire
    leaves the landing a core: RDMA (the NIC moves the bytes), or TCP on a machine with cores to spare. On a
    small machine TCP's receive threads and the landing take turns on the same cores, and chunks only add
    round trips."""
    return PIPELINE_CHUNK_BYTES if transport == "rdma" or num_cpus >= PIPELINE_MIN_CPUS else 0


def default_num_slots(num_blocks: int, block_bytes: int) -> int:
    """An automatic zone size: a quarter of the blocks within DEFAULT_MAX_BYTES, at least MIN_SLOTS (never more
    than the KV buffer holds)."""
    by_bytes = max(1, DEFAULT_MAX_BYTES // max(1, block_bytes))
    return max(1, min(num_blocks, max(MIN_SLOTS, min(num_blocks // DEFAULT_FRACTION, by_bytes))))


class LandingZone:
    def __init__(self, kv_buffer: torch.Tensor, num_slots: int,
                 check_blocks: Callable[[list[int]], list[int]],
                 on_landed: Callable[[list[int], list[int]], None] | None = None,
                 copy_and_check: Callable[[list[tuple[int, int]]], list[int]] | None = None):
        """``kv_buffer``: the node's KV buffer, block-major; ``check_blocks(block_ids)``: crc32 of those KV blocks
        where the buffer lives (``TransferAgent``: a GPU kernel, or host threads); ``on_landed(block_ids,
        checksums)``: told the blocks that landed and the checksums they passed (kept as theirs:
        ``BlockChecksums``); ``copy_and_check(pairs)``: for a host KV buffer, copies each (slot, block) and returns
        each block's crc32 in one pass (default: the copies, then ``check_blocks``)."""
        if num_slots < 1:
            raise ValueError("a landing zone needs at least one slot")
        self.kv_buffer = kv_buffer
        self.num_slots = num_slots
        # Zeroed: its pages are touched now, not by the engine's receiver in the middle of a transfer.
        self.tensor = torch.zeros((num_slots, *kv_buffer.shape[1:]), dtype=kv_buffer.dtype, device="cpu",
                                  pin_memory=kv_buffer.is_cuda)
        self.block_bytes = kv_buffer[0].numel() * kv_buffer.element_size()
        self.base_addr = self.tensor.data_ptr()
        self._check_blocks = check_blocks
        self._on_landed = on_landed
        self._copy_and_check = copy_and_check
        self._lock = threading.Lock()
        self._free: deque[int] = deque(range(num_slots))  # oldest-freed first: a slot just let go waits longest
        self._held: set[int] = set()  # by conversations
        self._fenced: set[int] = set()  # by the grant table (a given-up transfer may still write them)
        self.num_landed = 0
        self.num_failed_checks = 0
        self.land_s = 0.0  # time spent copying and checking (the fence's part of a receive)
        self.bytes_checked = 0

    # ---- slots ------------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, num: int) -> list[int]:
        """Up to ``num`` free slots (fewer, or none, when the zone is busy), held by the caller until ``free``."""
        with self._lock:
            slots = [self._free.popleft() for _ in range(min(num, len(self._free)))]
            self._held.update(slots)
            return slots

    def free(self, slots: Sequence[int]) -> None:
        """The caller is done with these slots (landed, or its transfer ended before they were written)."""
        with self._lock:
            for s in slots:
                if s in self._held:
                    self._held.remove(s)
                    self._free.append(s)

    def fence(self, slots: Sequence[int]) -> None:
        """A given-up transfer may still write these: the grant table holds them from their owner on."""
        with self._lock:
            for s in slots:
                self._held.discard(s)
                self._fenced.add(s)

    def unfence(self, slots: Sequence[int]) -> None:
        """The fenced transfer is over (or old enough): the slots may be written again."""
        with self._lock:
            for s in slots:
                if s in self._fenced:
                    self._fenced.remove(s)
                    self._free.append(s)

    def slot_addrs(self, slots: Sequence[int]) -> list[int]:
        return [self.base_addr + s * self.block_bytes for s in slots]

    # ---- landing -----------------------------------------------------------------------------------------
    def land(self, slots: Sequence[int], block_ids: Sequence[int], checksums: Sequence[int]) -> int:
        """Copy slot i into KV block i while it checks out; returns how many leading blocks landed.

        A block that fails its check is not usable (yet): its bytes may still be arriving, or a late write of
        another transfer damaged its slot. The caller may try again later or recompute it.
        """
        if not slots:
            return 0
        started = time.perf_counter()
        if self.kv_buffer.device.type == "cpu" and self._copy_and_check is not None:
            good = leading_equal(self._copy_and_check(list(zip(slots, block_ids))), checksums)
        else:  # run by run from the (pinned) slots to the device: DMA, the CPU touches no byte
            for run in coalesce(slots, block_ids):
                self.kv_buffer[run.dst_start:run.dst_start + run.num_blocks].copy_(
                    self.tensor[run.src_start:run.src_start + run.num_blocks], non_blocking=True)
            good = leading_equal(self._check_blocks(list(block_ids)), checksums)  # after the copies (same stream)
        if good and self._on_landed is not None:
            self._on_landed(list(block_ids[:good]), list(checksums[:good]))
        with self._lock:
            self.num_landed += good
            self.num_failed_checks += good < len(slots)
            self.land_s += time.perf_counter() - started
            self.bytes_checked += len(slots) * self.block_bytes
        return good

    def check_integrity(self) -> None:
        with self._lock:
            free = set(self._free)
            assert len(free) == len(self._free), "a landing slot is free twice"
            assert not (free & self._held) and not (free & self._fenced) and not (self._held & self._fenced), \
                "a landing slot is in two states"
            assert len(free) + len(self._held) + len(self._fenced) == self.num_slots, "a landing slot was lost"

    def describe(self) -> dict:
        with self._lock:
            return {"slots": self.num_slots, "free": len(self._free), "fenced": len(self._fenced),
                    "landed": self.num_landed, "failed_checks": self.num_failed_checks,
                    "land_s": round(self.land_s, 6), "bytes_checked": self.bytes_checked}


def leading_equal(found: Sequence[int], expected: Sequence[int]) -> int:
    """How many leading checksums match the expected ones."""
    good = 0
    for got, want in zip(found, expected):
        if got != want:
            break
        good += 1
    return good
