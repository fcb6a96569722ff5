"""Landing slots in front of a KV buffer on the GPU: copied to the device, then checked there by the checksum kernel."""
from __future__ import annotations

import ctypes
import zlib

import torch

from kvmesh.kv import fast_crc
from kvmesh.transfer.landing import LandingZone

SHAPE = (2, 2, 16, 2, 16)  # layers, K/V, block size, KV heads, head dim


def crc(addrs: list[int], block_bytes: int) -> list[int]:
    return [zlib.crc32((ctypes.c_ubyte * block_bytes).from_address(a)) for a in addrs]


def make_zone(num_blocks: int = 32, num_slots: int = 8) -> tuple[torch.Tensor, LandingZone]:
    """A zone in front of a GPU KV buffer, checked by the GPU's kernel as a node's is."""
    kv = torch.zeros((num_blocks, *SHAPE), dtype=torch.bfloat16, device="cuda")
    return kv, LandingZone(kv, num_slots, lambda ids: fast_crc.crc32_blocks(kv, ids))


def test_landed_blocks_reach_the_device_and_a_damaged_slot_never_does():
    kv, zone = make_zone()
    assert zone.tensor.is_pinned() and zone.tensor.device.type == "cpu"
    slots = zone.allocate(6)
    src = torch.randn((6, *SHAPE)).to(torch.bfloat16)
    zone.tensor[slots] = src
    sums = crc(zone.slot_addrs(slots), zone.block_bytes)
    zone.tensor[slots[4]].view(-1)[7] += 1.0  # a late write of another transfer: slot 4 no longer checks out
    blocks = [30, 2, 17, 5, 9, 11]
    assert zone.land(slots, blocks, sums) == 4
    for i in range(4):
        assert torch.equal(kv[blocks[i]].cpu(), src[i])
    # (blocks 4 and 5 hold whatever was copied: not landed, never read)
    zone.tensor[slots[4]] = src[4]  # the slot's right bytes (a write still arriving) land on a later try
    assert zone.land(slots[4:], blocks[4:], sums[4:]) == 2
    assert torch.equal(kv[blocks[5]].cpu(), src[5])
    zone.free(slots)
    zone.check_integrity()
    assert zone.num_free == zone.num_slots
