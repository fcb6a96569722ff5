"""KV block checksums on the GPU: the Triton kernel against zlib, and what it costs (printed for docs/gpu.md)."""
from __future__ import annotations

import time
import zlib

import pytest
import torch

from kvmesh.kernels.triton.block_crc32 import crc32_blocks
from kvmesh.kv import fast_crc


@pytest.mark.parametrize("shape,dtype", [((64, 2, 2, 16, 2, 16), torch.bfloat16),  # a tiny preset's blocks
                                         ((8, 32, 2, 16, 8, 128), torch.bfloat16),  # an 8B model's (2 MiB)
                                         ((16, 1000), torch.float32), ((4, 3), torch.float16)])
def test_the_kernel_computes_zlibs_crc32_of_device_blocks(shape, dtype):
    kv = torch.randn(shape, device="cuda").to(dtype)
    ids = [shape[0] - 1, 0, shape[0] // 2, 1]
    want = [zlib.crc32(kv[b].cpu().view(torch.uint8).numpy().tobytes()) for b in ids]
    if kv[0].numel() * kv.element_size() % 4:  # not whole 32-bit words: the kernel refuses, the dispatch copies
        with pytest.raises(ValueError, match="32-bit words"):
            crc32_blocks(kv, ids)
    else:
        assert crc32_blocks(kv, ids) == want
    assert fast_crc.crc32_blocks(kv, ids) == want  # the dispatch takes the kernel on a GPU where it can


def test_checksum_rate_on_the_device():
    """Not a timed assertion: the rate, printed, for docs/gpu.md."""
    kv = torch.randn((128, 32, 2, 16, 8, 128), device="cuda").to(torch.bfloat16)  # 256 MiB of 8B-model blocks
    ids = list(range(kv.shape[0]))
    crc32_blocks(kv, ids)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        crc32_blocks(kv, ids)
        times.append(time.perf_counter() - start)
    nbytes = kv.numel() * kv.element_size()
    print(f"\ncrc32 on the device: {nbytes / min(times) / 2**30:.1f} GiB/s over {len(ids)} blocks of "
          f"{nbytes // len(ids) >> 20} MiB ({min(times) * 1e3:.2f} ms)")
