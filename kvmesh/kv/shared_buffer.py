"""A node's KV buffer in shared memory: a memfd that other processes of this host can open and map.

    owner                                           another process of the same user, same host
    KV buffer = mmap(memfd "kvmesh-kv-<tag>")       opens /proc/<pid>/fd/<fd>  (checks tag, size)
    SharedRegion "<host>/<pid>/<fd>/<tag>/<bytes>"

Who opens it: same-host peers writing KV into it (``transfer/shared_memory.py``), and a node's own
tensor-parallel ranks, which map it whole and each use its own heads (``kvmesh/parallel``). The memfd has
no name in any file system: it disappears with the last process that maps or opens it, so a killed
process leaves nothing behind. ``host`` identifies a kernel *and* its network and pid namespaces.
"""
from __future__ import annotations

import hashlib
import mmap
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_NAME_PREFIX = "kvmesh-kv-"


def host_identity() -> str:
    """This kernel boot, network namespace and pid namespace (equal strings: /proc/<pid> of a peer is its)."""
    parts = []
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
        for ns in ("net", "pid"):
            parts.append(str(os.stat(f"/proc/self/ns/{ns}").st_ino))
    except OSError:
        return ""  # no procfs: no same-host path
    return hashlib.blake2b("/".join(parts).encode(), digest_size=8).hexdigest()


@dataclass(frozen=True)
class SharedRegion:
    """Where a node's KV buffer can be opened by a writer on the same host (published in its record)."""

    host: str
    pid: int
    fd: int
    tag: str
    num_bytes: int

    def encode(self) -> str:
        return f"{self.host}/{self.pid}/{self.fd}/{self.tag}/{self.num_bytes}"

    @classmethod
    def decode(cls, text: str) -> SharedRegion | None:
        """None for "" (no region) or anything malformed (a peer's record is not trusted to be well formed)."""
        try:
            host, pid, fd, tag, num_bytes = text.split("/")
            region = cls(host, int(pid), int(fd), tag, int(num_bytes))
        except (AttributeError, ValueError):
            return None
        if not (host and tag.isalnum() and region.pid > 0 and region.fd >= 0 and region.num_bytes > 0):
            return None
        return region


def region_path(region: SharedRegion) -> str:
    return f"/proc/{region.pid}/fd/{region.fd}"


def names_region(name: str, region: SharedRegion) -> bool:
    """Whether the link target of ``region_path(region)`` is that region's memfd (else the pid or fd is reused)."""
    return name.startswith(f"/memfd:{_NAME_PREFIX}{region.tag}")


def open_region(region: SharedRegion) -> int:
    """An fd (read-write) of ``region``'s memfd, checked to be that region (name and size); raises OSError or
    ValueError. The caller closes it."""
    path = region_path(region)
    name = os.readlink(path)
    if not names_region(name, region):
        raise ValueError(f"{path} is {name!r}, not the region {region.tag}")
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    if os.fstat(fd).st_size != region.num_bytes:
        os.close(fd)
        raise ValueError(f"{path} is not {region.num_bytes} bytes")
    return fd


class SharedKVAllocator:
    """Allocates a node's KV buffer in a memfd (zeroed, like ``KVLayout.allocate``); ``region`` describes it.

    One allocation per allocator; the mapping lives as long as the tensor (and the fd as long as
    the allocator: ``close`` after the buffer is no longer written).
    """

    def __init__(self):
        self.region: SharedRegion | None = None
        self._fd = -1

    def allocate(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        if self.region is not None:
            raise RuntimeError("a SharedKVAllocator allocates one buffer")
        num_bytes = dtype.itemsize
        for n in shape:
            num_bytes *= n
        tag = secrets.token_hex(8)
        self._fd = os.memfd_create(_NAME_PREFIX + tag, os.MFD_CLOEXEC)
        os.ftruncate(self._fd, num_bytes)  # a new memfd reads as zeros
        mapping = mmap.mmap(self._fd, num_bytes)
        tensor = torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(*shape)
        tensor.zero_()  # touch every page now, as torch.zeros would, not during the first steps
        self.region = SharedRegion(host_identity(), os.getpid(), self._fd, tag, num_bytes)
        return tensor

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
