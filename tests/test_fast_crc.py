"""The KV blocks' crc32 (``kvmesh/kv/fast_crc.py``): zlib's values whatever the path (folded with PCLMULQDQ, the
table, zlib itself where nothing compiles), at every length and alignment; the landing step copies every byte."""
from __future__ import annotations

import ctypes
import os
import zlib

import numpy as np
import pytest
import torch

from kvmesh.cpu_info import cpu_flags
from kvmesh.kv import fast_crc

LENGTHS = [*range(0, 130), 255, 256, 4095, 65536, 262144 + 13]


@pytest.fixture(params=["folded", "table", "zlib"])
def path(request, monkeypatch):
    lib = fast_crc._library()
    if request.param == "zlib":
        monkeypatch.setattr(fast_crc, "_library", lambda: None)
    else:
        assert lib is not None, "a C compiler is installed here: the library must build"
        if request.param == "folded" and not {"pclmulqdq", "sse4_1"} <= set(cpu_flags()):
            pytest.skip("this CPU has no PCLMULQDQ")  # the table path below still runs
        lib.kvm_crc32_init(int(request.param == "folded"))
    yield request.param
    if lib is not None:
        lib.kvm_crc32_init(int({"pclmulqdq", "sse4_1"} <= set(cpu_flags())))


def test_every_path_computes_zlibs_crc32(path):
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, max(LENGTHS) + 16, dtype=np.uint8)
    for offset in (0, 5):
        for n in LENGTHS:
            piece = data[offset:offset + n]
            assert fast_crc.crc32_of(piece) == zlib.crc32(piece.tobytes()), (path, offset, n)
            assert fast_crc.crc32_at([piece.ctypes.data], n) == [zlib.crc32(piece.tobytes())], (path, offset, n)


def test_copying_blocks_checksums_what_was_copied(path):
    src = torch.randint(0, 256, (5, 70001), dtype=torch.uint8)  # not a multiple of the copy's pieces
    dst = torch.zeros_like(src)
    order = [3, 0, 4]
    got = fast_crc.copy_crc32_at([dst[i].data_ptr() for i in range(3)], [src[i].data_ptr() for i in order],
                                 src.shape[1])
    assert torch.equal(dst[:3], src[order]) and torch.equal(dst[3:], torch.zeros_like(dst[3:]))
    assert got == [zlib.crc32(src[i].numpy().tobytes()) for i in order]


def test_read_only_buffers_take_zlib():
    data = os.urandom(1000)
    assert fast_crc.crc32_of(data) == zlib.crc32(data)
    buf = (ctypes.c_ubyte * 100).from_buffer_copy(data[:100])
    assert fast_crc.crc32_of(buf) == zlib.crc32(data[:100])


@pytest.mark.parametrize("shape,dtype", [((6, 2, 2, 16, 2, 16), torch.float32),  # 256 lanes of 8 words
                                         ((5, 2, 2, 16, 2, 8), torch.bfloat16),
                                         ((4, 24), torch.float32),  # 96 bytes: 8 lanes of 3 words
                                         ((3, 3), torch.float32)])  # 3 words: one lane
def test_the_gpu_checksum_kernel_computes_zlibs_crc32(shape, dtype):
    """The Triton kernel GPU nodes checksum their blocks with, in Triton's interpreter: zlib's values for any
    block size, dtype and order of block ids (so a GPU holder's checksums check out on CPU receivers)."""
    from kvmesh.kernels.triton.block_crc32 import crc32_blocks, lanes_for

    kv = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape))).to(dtype)
    block_bytes = kv[0].numel() * kv.element_size()
    assert (block_bytes // 4) % lanes_for(block_bytes) == 0
    ids = [shape[0] - 1, 0, 1, shape[0] - 1]
    want = [zlib.crc32(kv[b].view(torch.uint8).numpy().tobytes()) for b in ids]
    assert crc32_blocks(kv, ids) == want
    assert fast_crc.crc32_blocks(kv, ids) == want  # a CPU buffer: the library, same values


def test_blocks_that_are_not_whole_words_are_refused():
    from kvmesh.kernels.triton.block_crc32 import lanes_for

    with pytest.raises(ValueError, match="32-bit words"):
        lanes_for(6)
