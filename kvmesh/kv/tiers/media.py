"""Where a lower KV tier keeps block bytes: host memory or one preallocated file on a local disk.

Both are arrays of fixed-size slots, one block's bytes per slot; ``TierStore`` decides
which slot holds which block. Host memory is one contiguous uint8 tensor, so the
transfer engine can register it and send straight from it. The disk file is laid out
for O_DIRECT (every offset and length a multiple of 4096) and describes itself, so a
restarted node can re-adopt what it holds::

    file    | file header (4096) | slot 0 | slot 1 | ... | slot n-1 |
    slot    | slot header (4096) | payload: block bytes, padded to 4096 |

    file header  magic, version, root hash (model + block size + dtype), block bytes, number of slots
    slot header  magic, block hash, parent hash (zeros: a chain's first block), crc32 of the payload

A slot header is written with its payload in one write; a torn write shows up as a
checksum mismatch when the block is read, and the block is dropped, never served.
"""
from __future__ import annotations

import logging
import mmap
import os
import stat
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Protocol

import torch

from kvmesh.errors import KvmeshError

log = logging.getLogger("kvmesh.tiers")

ALIGN = 4096
_FILE_MAGIC = b"KVMESH-TIER\0"
_FILE_VERSION = 1
_FILE_HEADER = struct.Struct("<12sI16sQQ")  # magic, version, root hash, block bytes, slots
_SLOT_MAGIC = b"KVBL"
_SLOT_HEADER = struct.Struct("<4s?16s16sI")  # magic, has parent, hash, parent hash, crc32
_NO_PARENT = b"\0" * 16


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Medium(Protocol):
    num_slots: int
    block_bytes: int

    def write(self, slot: int, data: torch.Tensor, block_hash: bytes, parent: bytes | None, checksum: int) -> None:
        """Store one block's bytes (a uint8 CPU tensor of ``block_bytes``) in ``slot``."""

    def read(self, slot: int, out: torch.Tensor) -> None:
        """Copy ``slot``'s payload into ``out`` (a uint8 tensor of ``block_bytes``, any device)."""

    def address(self, slot: int) -> int | None:
        """Where the slot's bytes are in registered memory (None: not addressable, read it first)."""

    def close(self) -> None: ...


class HostMedium:
    """Slots in one contiguous host tensor (page-locked when CUDA is there, for fast device copies)."""

    def __init__(self, num_slots: int, block_bytes: int):
        self.num_slots, self.block_bytes = num_slots, block_bytes
        self.tensor = torch.zeros((num_slots, block_bytes), dtype=torch.uint8,
                                  pin_memory=torch.cuda.is_available())
        self.base_addr = self.tensor.data_ptr()

    def write(self, slot: int, data: torch.Tensor, block_hash: bytes, parent: bytes | None, checksum: int) -> None:
        self.tensor[slot].copy_(data)

    def read(self, slot: int, out: torch.Tensor) -> None:
        out.copy_(self.tensor[slot], non_blocking=False)

    def view(self, slot: int) -> torch.Tensor:
        return self.tensor[slot]

    def address(self, slot: int) -> int:
        return self.base_addr + slot * self.block_bytes

    def close(self) -> None:
        pass


class SlotHeader(NamedTuple):
    slot: int
    block_hash: bytes
    parent: bytes | None
    checksum: int


@dataclass(frozen=True)
class DiskLayout:
    root_hash: bytes  # the hash namespace: a file written for another model, block size or dtype is not ours
    block_bytes: int
    num_slots: int

    @property
    def slot_bytes(self) -> int:
        return ALIGN + _round_up(self.block_bytes)

    @property
    def file_bytes(self) -> int:
        return ALIGN + self.num_slots * self.slot_bytes


class DiskMedium:
    """Slots in one preallocated file, read and written with O_DIRECT where the file system allows it."""

    def __init__(self, path: str | Path, layout: DiskLayout):
        self.path = Path(path)
        self.layout = layout
        self.num_slots, self.block_bytes = layout.num_slots, layout.block_bytes
        self.path.parent.mkdir(parents=True, exist_ok=True)
        reusable = self._header_matches()
        self._fd = self._open(os.O_RDWR | os.O_NOFOLLOW if reusable else
                              os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, fresh=not reusable)
        if reusable:
            _check_private_file(self._fd, self.path)
        self.direct = self._direct
        if not reusable:
            os.ftruncate(self._fd, 0)
            os.ftruncate(self._fd, layout.file_bytes)
            self._pwrite(self._file_header(), 0)
        self.reused = reusable
        self._buffers = threading.local()  # one aligned buffer per thread and size, reused

    def _open(self, flags: int, fresh: bool = False) -> int:
        """Open the tier file; a fresh one is created anew (a file or link in its place is removed first: it
        is not ours to trust)."""
        if fresh and (self.path.exists() or self.path.is_symlink()):
            self.path.unlink()
        self._direct = False
        if hasattr(os, "O_DIRECT"):
            try:
                fd = os.open(self.path, flags | os.O_DIRECT, 0o600)
                self._direct = True
                return fd
            except OSError:  # tmpfs and some others refuse O_DIRECT: buffered IO then
                if fresh and os.path.lexists(self.path):
                    self.path.unlink()  # the refused open may have created it
        return os.open(self.path, flags, 0o600)

    def _file_header(self) -> bytes:
        head = _FILE_HEADER.pack(_FILE_MAGIC, _FILE_VERSION, self.layout.root_hash, self.layout.block_bytes,
                                 self.layout.num_slots)
        return head.ljust(ALIGN, b"\0")

    def _header_matches(self) -> bool:
        """An existing file written for this exact layout (then its slots can be re-adopted); never a link."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return False
        try:
            head = os.pread(fd, _FILE_HEADER.size, 0)
            if os.fstat(fd).st_size != self.layout.file_bytes:
                return False
        finally:
            os.close(fd)
        if len(head) < _FILE_HEADER.size:
            return False
        magic, version, root, block_bytes, num_slots = _FILE_HEADER.unpack(head)
        if (magic, version, root, block_bytes, num_slots) == (_FILE_MAGIC, _FILE_VERSION, self.layout.root_hash,
                                                              self.layout.block_bytes, self.layout.num_slots):
            return True
        log.warning("%s was written for another model or layout: starting it afresh", self.path)
        return False

    def _buffer(self, size: int) -> mmap.mmap:
        """A page-aligned buffer (as O_DIRECT wants) of ``size`` bytes, this thread's own."""
        cache = self._buffers.__dict__
        buf = cache.get(size)
        if buf is None:
            buf = cache[size] = mmap.mmap(-1, size)
        return buf

    def _pwrite(self, data: bytes | memoryview, offset: int) -> None:
        buf = mmap.mmap(-1, len(data))
        buf[:] = data
        written = os.pwrite(self._fd, buf, offset)
        if written != len(data):
            raise OSError(f"{self.path}: short write at {offset} ({written} of {len(data)} bytes)")

    def _offset(self, slot: int) -> int:
        return ALIGN + slot * self.layout.slot_bytes

    def write(self, slot: int, data: torch.Tensor, block_hash: bytes, parent: bytes | None, checksum: int) -> None:
        buf = self._buffer(self.layout.slot_bytes)
        buf[:ALIGN] = bytes(ALIGN)
        buf[:_SLOT_HEADER.size] = _SLOT_HEADER.pack(_SLOT_MAGIC, parent is not None, block_hash,
                                                    parent or _NO_PARENT, checksum)
        torch.frombuffer(buf, dtype=torch.uint8, count=self.block_bytes, offset=ALIGN).copy_(data)
        written = os.pwrite(self._fd, buf, self._offset(slot))
        if written != len(buf):
            raise OSError(f"{self.path}: short write of slot {slot}")

    def read(self, slot: int, out: torch.Tensor) -> None:
        size = _round_up(self.block_bytes)
        buf = self._buffer(size)
        got = os.preadv(self._fd, [buf], self._offset(slot) + ALIGN)
        if got < self.block_bytes:
            raise OSError(f"{self.path}: short read of slot {slot} ({got} bytes)")
        out.copy_(torch.frombuffer(buf, dtype=torch.uint8, count=self.block_bytes))

    def address(self, slot: int) -> None:
        return None

    def scan(self) -> list[SlotHeader]:
        """Every slot that holds a block (its header), for re-adoption after a restart."""
        found, buf = [], mmap.mmap(-1, ALIGN)
        for slot in range(self.num_slots):
            if os.preadv(self._fd, [buf], self._offset(slot)) < _SLOT_HEADER.size:
                continue
            magic, has_parent, block_hash, parent, checksum = _SLOT_HEADER.unpack(buf[:_SLOT_HEADER.size])
            if magic == _SLOT_MAGIC:
                found.append(SlotHeader(slot, block_hash, parent if has_parent else None, checksum))
        return found

    def corrupt(self, slot: int, offset: int = 0) -> None:
        """Flip one payload byte of ``slot`` (tests of the checksum path)."""
        buf = mmap.mmap(-1, ALIGN)
        os.preadv(self._fd, [buf], self._offset(slot) + ALIGN)
        buf[offset] ^= 0xFF
        os.pwrite(self._fd, buf, self._offset(slot) + ALIGN)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class UnsafeTierFile(KvmeshError, PermissionError):
    """A tier file to adopt that is not a private regular file of ours."""


def _check_private_file(fd: int, path: Path) -> None:
    """Adopt only a regular file owned by us, readable by nobody else, with one name."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077 or st.st_nlink != 1:
        os.close(fd)
        raise UnsafeTierFile(f"{path} is not a private regular file of this user (mode {st.st_mode & 0o777:o}, "
                             f"owner {st.st_uid}, {st.st_nlink} links): not adopting it")
