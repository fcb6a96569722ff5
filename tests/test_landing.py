"""Landing slots and grant fences: a late write damages a slot at most, never a KV block in use."""
from __future__ import annotations

import ctypes
import time
import zlib

import pytest
import torch

from kvmesh.kv.block_pool import BlockPool
from kvmesh.transfer import grants as grants_module
from kvmesh.transfer.grants import Fence, GrantTable
from kvmesh.transfer.landing import MIN_SLOTS, LandingZone, default_num_slots

SHAPE = (2, 2, 16, 2, 16)


def crc(addrs: list[int], block_bytes: int) -> list[int]:
    return [zlib.crc32((ctypes.c_ubyte * block_bytes).from_address(a)) for a in addrs]


def block_crcs(kv: torch.Tensor, block_ids: list[int]) -> list[int]:
    """The reference: zlib's crc32 of each KV block's bytes."""
    return [zlib.crc32(kv[b].view(torch.uint8).numpy().tobytes()) for b in block_ids]


def make(num_blocks: int = 16, num_slots: int = 6, checker: str = "zlib",
         ) -> tuple[torch.Tensor, LandingZone, BlockPool, GrantTable]:
    """``checker``: zlib, or "triton": the checksum kernel a GPU node checks its landed blocks with."""
    kv = torch.zeros((num_blocks, *SHAPE))
    block_bytes = kv[0].numel() * kv.element_size()
    if checker == "triton":
        from kvmesh.kernels.triton.block_crc32 import crc32_blocks
        zone = LandingZone(kv, num_slots, lambda ids: crc32_blocks(kv, ids))
    else:
        zone = LandingZone(kv, num_slots, lambda ids: block_crcs(kv, ids))
    pool = BlockPool(num_blocks)
    table = GrantTable(pool, kv.data_ptr(), block_bytes, writes_refusable=False, landing=zone)
    return kv, zone, pool, table


def check(zone: LandingZone, pool: BlockPool, table: GrantTable) -> None:
    zone.check_integrity()
    pool.check_integrity()
    table.check_integrity()


def write_slots(zone: LandingZone, slots: list[int], seed: int) -> tuple[torch.Tensor, list[int]]:
    """What a writer does: bytes into the slots, and the crc32 of what it sent."""
    data = torch.randn((len(slots), *SHAPE), generator=torch.Generator().manual_seed(seed))
    zone.tensor[slots] = data
    return data, crc(zone.slot_addrs(slots), zone.block_bytes)


def test_slots_are_allocated_while_free_and_come_back():
    _, zone, pool, table = make(num_slots=6)
    first = zone.allocate(4)
    second = zone.allocate(4)  # only 2 left: a short zone shortens the fetch, it never fails it
    assert len(first) == 4 and len(second) == 2 and not set(first) & set(second)
    assert zone.allocate(1) == []
    zone.free(first)
    assert zone.num_free == 4
    zone.free(first)  # freeing twice changes nothing
    assert zone.num_free == 4
    zone.free(second)
    check(zone, pool, table)


@pytest.mark.parametrize("checker", ["zlib", "triton"])
def test_landed_blocks_are_copied_and_checked_in_the_kv_buffer(checker):
    """Copied, then the KV block itself checked: by zlib, or by the GPU's checksum kernel (Triton's interpreter
    here), as a node with its KV buffer on a GPU lands."""
    kv, zone, pool, table = make(checker=checker)
    blocks = pool.allocate(5)
    slots = zone.allocate(5)
    data, sums = write_slots(zone, slots, seed=1)
    zone.tensor[slots[3]].view(-1)[5] += 1.0  # damaged between the writer and us
    assert zone.land(slots, blocks, sums) == 3
    for i in range(3):
        assert torch.equal(kv[blocks[i]], data[i])
    zone.tensor[slots[3]] = data[3]  # the slot's right bytes arrive late: the next try lands them
    assert zone.land(slots[3:], blocks[3:], sums[3:]) == 2
    assert torch.equal(kv[blocks[4]], data[4])
    zone.tensor[slots].fill_(7.0)  # a late write after the copy reaches the slot only
    for i in range(5):
        assert torch.equal(kv[blocks[i]], data[i])
    assert zone.describe()["landed"] == 5 and zone.describe()["failed_checks"] == 1
    zone.free(slots)
    pool.free(blocks)
    check(zone, pool, table)


def test_a_revoked_landing_grant_fences_its_slots_until_the_writer_stops():
    _, zone, pool, table = make(num_slots=6)
    blocks = pool.allocate(4)
    slots = zone.allocate(4)
    grant = table.issue("r/0", "holder", slots, ttl_s=5.0, fence=Fence.LANDING)
    table.confirm(grant.grant_id, [True, True, False, False])
    held = table.revoke(grant.grant_id)
    assert sorted(held) == sorted(slots)  # every slot, confirmed or not: its bytes may still be arriving
    pool.free(blocks)  # the pool's blocks were never written by the peer: reusable at once
    assert pool.num_free_blocks == pool.num_blocks and table.num_quarantined_blocks == 0
    assert table.num_fenced_slots == 4 and zone.num_free == 2
    check(zone, pool, table)
    assert sorted(zone.allocate(6)) == sorted(set(range(6)) - set(slots))  # fenced slots are not handed out
    table.acknowledge(grant.grant_id)  # the writer's final answer
    assert table.num_fenced_slots == 0 and zone.num_free == 4
    with pytest.raises(PermissionError):  # the zmq guard never lets a write into a landing grant
        table.guard_write(table.issue("r/1", "holder", [0], 5.0, fence=Fence.LANDING).grant_id,
                          [(table.base_addr, table.block_bytes)], lambda: None)


def test_fenced_slots_come_back_after_the_age_cap_or_the_writer_leaving(monkeypatch):
    _, zone, pool, table = make(num_slots=6)
    a, b = zone.allocate(2), zone.allocate(2)
    ga = table.issue("a/0", "holder-a", a, 5.0, fence=Fence.LANDING)
    gb = table.issue("b/0", "holder-b", b, 5.0, fence=Fence.LANDING)
    table.revoke(ga.grant_id), table.revoke(gb.grant_id)
    assert table.sweep() == [] and table.num_fenced_slots == 4
    assert table.writer_gone("holder-b") == 2 and table.num_fenced_slots == 2
    monkeypatch.setattr(grants_module, "LANDING_FENCE_S", 0.0)
    assert table.sweep() == [ga.grant_id] and table.num_fenced_slots == 0
    assert zone.num_free == 6
    check(zone, pool, table)


def test_process_and_refusable_fences_keep_their_rules():
    kv, zone, pool, table = make()
    blocks = pool.allocate(4)
    grant = table.issue("p/0", "same-host", blocks, 5.0, fence=Fence.PROCESS)
    table.confirm(grant.grant_id, [True, False, False, False])
    tainted = table.revoke(grant.grant_id)
    assert tainted == blocks[1:] and table.num_quarantined_blocks == 3
    pool.free(blocks)
    assert all(pool.block_state(b).ref_count == 1 for b in tainted)  # the table's own reference
    table.acknowledge(grant.grant_id)
    assert pool.num_free_blocks == pool.num_blocks
    refusing = GrantTable(pool, kv.data_ptr(), zone.block_bytes, writes_refusable=True)
    blocks = pool.allocate(2)
    assert refusing.issue("z/0", "remote", blocks, 5.0).fence is Fence.REFUSABLE
    assert refusing.revoke(refusing.issue("z/1", "remote", blocks, 5.0).grant_id) == []
    with pytest.raises(ValueError):
        refusing.issue("z/2", "remote", blocks, 5.0, fence=Fence.LANDING)  # no landing zone there
    pool.free(blocks)
    check(zone, pool, table)


def test_default_zone_size():
    assert default_num_slots(100_000, 2**20) == 1024  # 1 GiB of 1 MiB blocks
    assert default_num_slots(1000, 8192) == 250  # a quarter of the blocks
    assert default_num_slots(100, 8192) == MIN_SLOTS
    assert default_num_slots(10, 8192) == 10  # never more than the buffer


def test_a_refusable_grant_admits_writes_only_inside_its_blocks_and_only_until_it_expires():
    """The zmq backend's guard: a write lands only in whole blocks of an open grant before its deadline."""
    kv, zone, pool, _ = make()
    table = GrantTable(pool, kv.data_ptr(), zone.block_bytes, writes_refusable=True)
    bb, base = zone.block_bytes, kv.data_ptr()
    blocks = pool.allocate(6)
    granted = blocks[2:4]
    written: list[tuple[int, int]] = []
    grant = table.issue("g/0", "remote", granted, ttl_s=60.0)
    for b in granted:  # inside: written
        table.guard_write(grant.grant_id, [(base + b * bb, bb)], lambda b=b: written.append((b, 1)))
    assert written == [(granted[0], 1), (granted[1], 1)]
    outside = next(b for b in blocks if b not in granted)
    for ranges in ([(base + outside * bb, bb)],  # another block of ours
                   [(base + granted[0] * bb, bb), (base + outside * bb, bb)],  # one range in, one out
                   [(base + granted[0] * bb + 8, bb)],  # not block-aligned
                   [(base + granted[0] * bb, bb + 4)],  # runs past its block
                   [(base - bb, bb)]):  # below the buffer
        with pytest.raises(PermissionError, match="outside grant"):
            table.guard_write(grant.grant_id, ranges, lambda: written.append(("bad", 0)))
    assert ("bad", 0) not in written and table.num_refused_writes == 5
    brief = table.issue("g/1", "remote", granted, ttl_s=0.01)
    while time.monotonic() <= brief.expires_at:  # the deadline passes
        time.sleep(0.005)
    with pytest.raises(PermissionError, match="no open grant"):
        table.guard_write(brief.grant_id, [(base + granted[0] * bb, bb)], lambda: written.append(("late", 0)))
    assert ("late", 0) not in written
    table.close(grant.grant_id), table.close(brief.grant_id)
    pool.free(blocks)
    check(zone, pool, table)


def test_sweep_keeps_a_live_writers_quarantine_and_releases_it_once_the_writer_exits():
    kv, zone, pool, table = make()
    blocks = pool.allocate(3)
    alive = [True]
    grant = table.issue("s/0", "same-host", blocks, 5.0, writer_alive=lambda: alive[0], fence=Fence.PROCESS)
    held = table.revoke(grant.grant_id)
    pool.free(blocks)
    assert held == blocks and table.sweep() == [] and table.num_quarantined_blocks == 3
    assert table.writer_gone("same-host") == 0  # its lease ended, but its process still writes
    assert table.num_quarantined_blocks == 3 and all(pool.block_state(b).ref_count == 1 for b in held)
    alive[0] = False
    assert table.sweep() == [grant.grant_id] and table.num_quarantined_blocks == 0
    assert pool.num_free_blocks == pool.num_blocks
    check(zone, pool, table)
