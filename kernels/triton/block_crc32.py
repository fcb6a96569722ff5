"""crc32 of KV blocks where they live (a GPU's memory): many blocks per launch, zlib's CRC-32 values.

The values equal ``zlib.crc32`` of each block's bytes (and ``kvmesh/kv/fast_crc.py``'s), so a GPU holder's
checksums are checked by CPU receivers and the other way round. One program per block; its bytes are cut into
``LANES`` equal segments, each lane runs the CRC register over its segment (four table lookups per 32-bit word,
registers starting at 0), and the lanes' registers are combined by the linearity of the CRC over GF(2):

    crc32(block) = ~( XOR_l  shift(reg_l, bytes after segment l)  ^  shift(0xFFFFFFFF, block bytes) )

where ``shift(r, n)`` runs register ``r`` over ``n`` zero bytes: a 32x32 bit matrix, computed here once per block
size (by squaring, as zlib's ``crc32_combine`` does) and handed to the kernel as one column table per lane. No
block is copied to the host; the answers come back in one copy of 4 bytes per block.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

POLY = 0xEDB88320  # zlib's CRC-32, reflected
MAX_LANES = 256


@triton.jit
def _crc32_blocks_kernel(words_ptr, block_ids_ptr, tables_ptr, shifts_ptr, out_ptr, block_words, seg_words,
                         LANES: tl.constexpr):
    pid = tl.program_id(0)
    block = tl.load(block_ids_ptr + pid).to(tl.int64)
    lanes = tl.arange(0, LANES)
    start = words_ptr + block * block_words + lanes.to(tl.int64) * seg_words
    reg = tl.zeros([LANES], dtype=tl.uint32)
    for j in range(0, seg_words):
        reg = reg ^ tl.load(start + j).to(tl.uint32, bitcast=True)
        reg = (tl.load(tables_ptr + 768 + (reg & 0xFF)).to(tl.uint32, bitcast=True)
               ^ tl.load(tables_ptr + 512 + ((reg >> 8) & 0xFF)).to(tl.uint32, bitcast=True)
               ^ tl.load(tables_ptr + 256 + ((reg >> 16) & 0xFF)).to(tl.uint32, bitcast=True)
               ^ tl.load(tables_ptr + (reg >> 24)).to(tl.uint32, bitcast=True))
    combined = tl.zeros([LANES], dtype=tl.uint32)
    for bit in tl.static_range(32):
        column = tl.load(shifts_ptr + lanes * 32 + bit).to(tl.uint32, bitcast=True)
        combined = combined ^ tl.where(((reg >> bit) & 1) != 0, column, tl.zeros_like(column))
    init_term = tl.load(shifts_ptr + LANES * 32).to(tl.uint32, bitcast=True)  # the initial register, shifted
    total = tl.xor_sum(combined, 0) ^ init_term
    tl.store(out_ptr + pid, (~total).to(tl.int32, bitcast=True))


@functools.cache
def _byte_tables() -> tuple[int, ...]:
    """Slicing-by-4 tables, flat: T0 (one byte), then T1..T3 (the byte followed by 1..3 zero bytes)."""
    t0 = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ POLY if c & 1 else c >> 1
        t0.append(c)
    tables = [t0]
    for _ in range(3):
        prev = tables[-1]
        tables.append([(v >> 8) ^ t0[v & 0xFF] for v in prev])
    return tuple(v for t in tables for v in t)


def _apply(matrix: Sequence[int], vector: int) -> int:
    """A 32x32 GF(2) matrix (its 32 columns) times a 32-bit vector."""
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _times(a: Sequence[int], b: Sequence[int]) -> list[int]:
    return [_apply(a, column) for column in b]


def _zero_bytes(nbytes: int) -> list[int]:
    """The matrix that runs the register over ``nbytes`` zero bytes."""
    one = [_byte_tables()[(1 << i) & 0xFF] ^ ((1 << i) >> 8) for i in range(32)]
    result = [1 << i for i in range(32)]
    power = one
    while nbytes:
        if nbytes & 1:
            result = _times(power, result)
        power = _times(power, power)
        nbytes >>= 1
    return result


def lanes_for(block_bytes: int) -> int:
    """The most lanes (a power of two, at most MAX_LANES) that cut a block into whole 32-bit words."""
    if block_bytes % 4:
        raise ValueError(f"a block of {block_bytes} bytes is not whole 32-bit words")
    words, lanes = block_bytes // 4, 1
    while lanes * 2 <= MAX_LANES and words % (lanes * 2) == 0:
        lanes *= 2
    return lanes


@functools.cache
def _constants(block_bytes: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(byte tables, per-lane shift columns then the initial register's term, lanes) for blocks of this size."""
    lanes = lanes_for(block_bytes)
    segment = _zero_bytes(block_bytes // lanes)
    shifts = [[1 << i for i in range(32)]]  # the last lane: nothing after it
    for _ in range(lanes - 1):
        shifts.append(_times(segment, shifts[-1]))
    shifts.reverse()  # lane l: shifted over the lanes - 1 - l segments after it
    init_term = _apply(_zero_bytes(block_bytes), 0xFFFFFFFF)

    def as_int32(values) -> torch.Tensor:
        return torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in values], dtype=torch.int32,
                            device=device)
    return as_int32(_byte_tables()), as_int32([c for lane in shifts for c in lane] + [init_term]), lanes


def crc32_blocks(buffer: torch.Tensor, block_ids: Sequence[int]) -> list[int]:
    """zlib's crc32 of the bytes of ``buffer[b]`` (a contiguous, block-major tensor, any dtype) for each block id:
    one launch, one copy of the results to the host."""
    if not block_ids:
        return []
    if not buffer.is_contiguous():
        raise ValueError("crc32_blocks needs a contiguous block-major buffer")
    block_bytes = buffer[0].numel() * buffer.element_size()
    tables, shifts, lanes = _constants(block_bytes, buffer.device)
    words = buffer.view(torch.uint8).reshape(buffer.shape[0], block_bytes).view(torch.int32)
    ids = torch.tensor(list(block_ids), dtype=torch.int64).to(buffer.device, non_blocking=True)
    out = torch.empty(len(block_ids), dtype=torch.int32, device=buffer.device)
    block_words = block_bytes // 4
    _crc32_blocks_kernel[(len(block_ids),)](words, ids, tables, shifts, out, block_words, block_words // lanes,
                                            LANES=lanes)
    return [v & 0xFFFFFFFF for v in out.cpu().tolist()]
