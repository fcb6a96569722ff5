"""Coalescing block ids into runs: one transfer descriptor per run of consecutive blocks.

    src  5 6 7 | 12 13        dst  2 3 4 | 8 9      ->  runs (5->2, 3 blocks), (12->8, 2 blocks)

With the block-major buffer a run of blocks is one contiguous byte range in every
layer at once, so a run is one descriptor whatever the depth of the model.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class BlockRun(NamedTuple):
    src_start: int
    dst_start: int
    num_blocks: int


class Descriptor(NamedTuple):
    src_addr: int
    dst_addr: int
    length: int


def coalesce(src_block_ids: Sequence[int], dst_block_ids: Sequence[int]) -> list[BlockRun]:
    """Runs where both source and destination ids advance by one together."""
    if len(src_block_ids) != len(dst_block_ids):
        raise ValueError("source and destination block lists differ in length")
    runs: list[BlockRun] = []
    for src, dst in zip(src_block_ids, dst_block_ids):
        if runs:
            last = runs[-1]
            if src == last.src_start + last.num_blocks and dst == last.dst_start + last.num_blocks:
                runs[-1] = BlockRun(last.src_start, last.dst_start, last.num_blocks + 1)
                continue
        runs.append(BlockRun(src, dst, 1))
    return runs


def to_descriptors(runs: Sequence[BlockRun], src_base: int, dst_base: int, block_bytes: int,
                   max_bytes: int = 0) -> list[Descriptor]:
    """Byte ranges of the runs; with ``max_bytes`` a long run is cut into pieces of at most that size.

    (Mooncake's TCP transport moves one descriptor over one stream: a few pieces in
    flight beat one huge descriptor there; RDMA wants one descriptor per run.)
    """
    return _pieces([(src_base + r.src_start * block_bytes, dst_base + r.dst_start * block_bytes,
                      r.num_blocks * block_bytes) for r in runs], max_bytes)


def _pieces(ranges: Sequence[Sequence[int]], max_bytes: int) -> list[Descriptor]:
    """(src, dst, length) ranges as descriptors of at most ``max_bytes`` each (0: whole)."""
    out: list[Descriptor] = []
    for src, dst, length in ranges:
        step = max_bytes if 0 < max_bytes < length else length
        for offset in range(0, length, step):
            out.append(Descriptor(src + offset, dst + offset, min(step, length - offset)))
    return out


def address_descriptors(src_addrs: Sequence[int], dst_addrs: Sequence[int], block_bytes: int,
                        max_bytes: int = 0) -> list[Descriptor]:
    """Descriptors for blocks given by address (any registered memory), merging neighbours on both sides."""
    if len(src_addrs) != len(dst_addrs):
        raise ValueError("source and destination address lists differ in length")
    runs: list[list[int]] = []  # [src, dst, length]
    for src, dst in zip(src_addrs, dst_addrs):
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            runs[-1][2] += block_bytes
        else:
            runs.append([src, dst, block_bytes])
    return _pieces(runs, max_bytes)
