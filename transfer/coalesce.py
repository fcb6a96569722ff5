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
    out: list[Descriptor] = []
    for r in runs:
        src, dst, length = src_base + r.src_start * block_bytes, dst_base + r.dst_start * block_bytes, \
            r.num_blocks * block_bytes
        step = max_bytes if 0 < max_bytes < length else length
        for offset in range(0, length, step):
            out.append(Descriptor(src + offset, dst + offset, min(step, length - offset)))
    return out
