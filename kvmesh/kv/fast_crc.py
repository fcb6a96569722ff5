"""crc32 of KV blocks at memory speed: zlib's CRC-32, computed by ``crc32.c`` beside this file.

The library folds 64 bytes at a time with carry-less multiplication where the CPU has PCLMULQDQ (a table
elsewhere), and copies a block while checksumming each piece of it still in cache (the landing fence's step).
Its values equal ``zlib.crc32``'s, so a node without a C compiler (zlib, slower) agrees with one that has it.
Compiled on first use into ``$KVMESH_CACHE_DIR/native/`` (the file name carries a hash of the source and the
compiler); every call releases the GIL, so threads checksum in parallel. Addresses are host memory the caller
keeps alive for the call. Blocks of a buffer on a GPU are checksummed there (``crc32_blocks``: a Triton kernel,
``kernels/triton/block_crc32.py``, with the same values), never copied to the host one by one.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import zlib
from collections.abc import Sequence
from pathlib import Path

import torch

from kvmesh.cpu_info import cpu_flags
from kvmesh.native_build import c_compiler, cache_dir, compile_library

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("crc32.c")
FLAGS = ("-O3", "-fPIC", "-shared")


@functools.cache
def _library() -> ctypes.CDLL | None:
    compiler = c_compiler()
    if compiler is None:
        log.info("fast crc32 off: no C compiler (set CC); zlib checksums KV blocks")
        return None
    key = hashlib.blake2b(SOURCE.read_bytes() + " ".join(FLAGS).encode() + compiler.encode(), digest_size=8)
    path = cache_dir() / f"kvmesh_crc32_{key.hexdigest()}.so"
    if not path.exists():
        reason = compile_library(compiler, FLAGS, [str(SOURCE)], path)
        if reason is not None:
            log.warning("fast crc32 off (%s); zlib checksums KV blocks", reason)
            return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        log.warning("fast crc32 off: %s; zlib checksums KV blocks", e)
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.kvm_crc32.restype = ctypes.c_uint32
    lib.kvm_crc32.argtypes = [ctypes.c_uint32, p, i64]
    lib.kvm_crc32_blocks.argtypes = [p, i64, i64, p]
    lib.kvm_copy_crc32_blocks.argtypes = [p, p, i64, i64, p]
    flags = set(cpu_flags())
    lib.kvm_crc32_init(int("pclmulqdq" in flags and "sse4_1" in flags))
    return lib


def available() -> bool:
    """Whether the compiled library is in use (else zlib)."""
    return _library() is not None


def crc32_at(addrs: Sequence[int], nbytes: int) -> list[int]:
    """crc32 of the ``nbytes`` at each host address."""
    lib = _library()
    if lib is None:
        return [zlib.crc32((ctypes.c_ubyte * nbytes).from_address(a)) for a in addrs]
    src = (ctypes.c_int64 * len(addrs))(*addrs)
    out = (ctypes.c_uint32 * len(addrs))()
    lib.kvm_crc32_blocks(src, len(addrs), nbytes, out)
    return list(out)


def copy_crc32_at(dst_addrs: Sequence[int], src_addrs: Sequence[int], nbytes: int) -> list[int]:
    """Copy ``nbytes`` from each source address to its destination; the crc32 of each copy."""
    lib = _library()
    if lib is None:
        out = []
        for d, s in zip(dst_addrs, src_addrs):
            ctypes.memmove(d, s, nbytes)
            out.append(zlib.crc32((ctypes.c_ubyte * nbytes).from_address(d)))
        return out
    dst = (ctypes.c_int64 * len(dst_addrs))(*dst_addrs)
    src = (ctypes.c_int64 * len(src_addrs))(*src_addrs)
    out = (ctypes.c_uint32 * len(src_addrs))()
    lib.kvm_copy_crc32_blocks(dst, src, len(src_addrs), nbytes, out)
    return list(out)


def crc32_of(buffer) -> int:
    """crc32 of a contiguous buffer (a numpy array, bytes): what ``zlib.crc32`` returns."""
    lib = _library()
    view = memoryview(buffer).cast("B")
    if lib is None or view.readonly or not view.nbytes:
        return zlib.crc32(view)
    return lib.kvm_crc32(0, ctypes.addressof(ctypes.c_ubyte.from_buffer(view)), view.nbytes)


def crc32_blocks(buffer: torch.Tensor, block_ids: Sequence[int]) -> list[int]:
    """crc32 of the bytes of ``buffer[b]`` (contiguous, block-major, any dtype) for each block id, where the buffer
    lives: on a GPU one kernel launch (one gathered copy to the host where Triton is missing or blocks are not whole
    32-bit words), on the CPU here."""
    nbytes = buffer[0].numel() * buffer.element_size()
    if buffer.device.type == "cpu":
        return crc32_at([buffer.data_ptr() + b * nbytes for b in block_ids], nbytes)
    from kvmesh.kernels.ops import triton_available

    if triton_available() and nbytes % 4 == 0:
        from kvmesh.kernels.triton.block_crc32 import crc32_blocks as on_device

        return on_device(buffer, block_ids)
    index = torch.tensor(list(block_ids), dtype=torch.int64, device=buffer.device)
    return crc32_blocks(buffer.index_select(0, index).cpu().contiguous(), range(len(block_ids)))

