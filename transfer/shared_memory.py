"""Same-host KV writes through shared memory: a peer on this host writes into our KV buffer with one copy.

Over Mooncake's TCP transport a push between two processes of one host crosses the loopback
socket stack (~1.3 GiB/s here); through shared memory it is one kernel copy (~7 GiB/s).

    owner (requester)                               writer (holder), same host
    KV buffer = mmap(memfd "kvmesh-kv-<tag>")       opens /proc/<pid>/fd/<fd>  (checks tag, size, owner)
    record: shared_memory = "<host>/<pid>/<fd>/<tag>"     pwrite(src bytes, offset = dst_addr - base_addr)

What is exposed is the KV buffer alone (a memfd holds nothing else), to processes of the same
user (opening another process's fd needs the rights to read its memory). The memfd has no
name in any file system: it disappears with the last process that maps or opens it, so a
killed node leaves nothing behind. Writes are one-sided, like Mooncake's: which blocks a
writer may touch is fenced by grants and quarantine exactly as for RDMA (``transfer/grants.py``);
every write is bounds-checked against the published buffer here and by the kernel (the
file's size). ``host`` identifies a kernel *and* its network and pid namespaces, so hosts
simulated with network namespaces never take this path.
"""
from __future__ import annotations

import ctypes
import logging
import os
import select
import threading
import time
from collections.abc import Callable, Sequence

from kvmesh.kv.shared_buffer import SharedRegion, host_identity, names_region, open_region, region_path
from kvmesh.transfer.coalesce import Descriptor
from kvmesh.transfer.errors import TransferError
from kvmesh.transfer.peers import PeerRecord

log = logging.getLogger("kvmesh.transfer")


def same_host_region(peer: PeerRecord | None, host: str) -> SharedRegion | None:
    """The region ``peer`` published, if it lives on ``host`` (this one: ``host_identity()``); else None."""
    region = SharedRegion.decode(peer.shared_memory) if peer is not None else None
    return region if region is not None and host and region.host == host else None


class SharedMemoryWriter:
    """The writer's end: opens same-host peers' regions once and writes descriptors into them.

    Thread-safe (holder workers write concurrently; ``pwrite`` releases the GIL). A region that
    cannot be opened or does not check out is remembered as unusable for that peer incarnation and
    the caller keeps using its transfer engine.
    """

    def __init__(self, node_id: str):
        self.node_id = node_id
        self.host = host_identity()
        self.num_writes = 0
        self.bytes_written = 0
        self._lock = threading.Lock()
        self._open: dict[str, tuple[str, int]] = {}  # node id -> (region text, fd; -1: unusable)

    def can_write(self, peer: PeerRecord) -> bool:
        """Whether ``peer`` published a region on this host that we could open (side-effect: opens it once)."""
        return self._usable_fd(peer) >= 0

    def write(self, peer: PeerRecord, descriptors: Sequence[Descriptor], *, request_id: str = "",
              deadline: float | None = None) -> None:
        """Copy each descriptor's local range into the peer's buffer; raises TransferError (nothing half-told).

        ``deadline`` (``time.monotonic()``): no copy starts after it (a writer stopped between its own checks
        and here must not write into a grant its requester has given up on)."""
        fd = self._usable_fd(peer)
        if fd < 0:
            raise TransferError("no shared memory with this peer", request_id=request_id, peer=peer.node_id)
        buffer_bytes = peer.num_blocks * peer.block_bytes
        for d in descriptors:
            offset = d.dst_addr - peer.base_addr
            if d.length <= 0 or offset < 0 or offset + d.length > buffer_bytes:
                raise TransferError(f"write of {d.length} bytes at offset {offset} is outside the peer's "
                                    f"{buffer_bytes}-byte buffer", request_id=request_id, peer=peer.node_id)
        written = 0
        try:
            for d in descriptors:
                if deadline is not None and time.monotonic() > deadline:
                    raise TransferError("the push's deadline passed before its write", request_id=request_id,
                                        peer=peer.node_id)
                src = memoryview((ctypes.c_char * d.length).from_address(d.src_addr)).cast("B")
                done = 0
                while done < d.length:  # pwrite may write less than asked
                    done += os.pwrite(fd, src[done:], d.dst_addr - peer.base_addr + done)
                written += d.length
        except OSError as e:
            raise TransferError(f"shared-memory write failed: {e}", request_id=request_id,
                                peer=peer.node_id) from None
        with self._lock:
            self.num_writes += 1
            self.bytes_written += written

    def _usable_fd(self, peer: PeerRecord) -> int:
        """Our fd of the peer's region (opened and checked once per region), -1 when there is none to use."""
        region = same_host_region(peer, self.host)
        if region is None:
            return -1
        text = region.encode()
        with self._lock:
            known = self._open.get(peer.node_id)
            if known is not None and known[0] == text:
                return known[1]
            if known is not None and known[1] >= 0:
                os.close(known[1])
            fd = self._open_region(peer, region)
            self._open[peer.node_id] = (text, fd)
            return fd

    def _open_region(self, peer: PeerRecord, region: SharedRegion) -> int:
        try:
            fd = open_region(region)  # that region's memfd (its name and size), or an error saying why not
        except OSError as e:
            log.info("%s: no shared memory with %s (%s): using the transfer engine", self.node_id, peer.node_id, e)
            return -1
        except ValueError as e:
            log.warning("%s: shared memory of %s refused: %s", self.node_id, peer.node_id, e)
            return -1
        problem = ""
        if region.num_bytes != peer.num_blocks * peer.block_bytes:
            problem = f"size {region.num_bytes} does not match the record ({peer.num_blocks} x {peer.block_bytes} bytes)"
        elif (uid := os.fstat(fd).st_uid) != os.getuid():
            problem = f"owned by uid {uid}, not ours"
        if problem:
            os.close(fd)
            log.warning("%s: shared memory of %s refused: %s", self.node_id, peer.node_id, problem)
            return -1
        return fd

    def forget(self, node_id: str) -> None:
        """Close what we opened of a peer that left (its memory is freed once no one holds it)."""
        with self._lock:
            known = self._open.pop(node_id, None)
        if known is not None and known[1] >= 0:
            os.close(known[1])

    def close(self) -> None:
        with self._lock:
            opened, self._open = self._open, {}
        for _, fd in opened.values():
            if fd >= 0:
                os.close(fd)


class PeerProcesses:
    """Whether same-host peers' processes still exist (the requester's side, for quarantines).

    A peer on this host that published a region is watched through a pidfd, which refers to
    that one process whatever pids are reused later; the pid is taken to be the peer's only
    if its memfd is still the one the record names. A writer that was only stopped loses its
    lease, yet finishes the write it had begun once resumed: its quarantines must outlive the
    lease (``transfer/grants.py``). Peers elsewhere, or without a region: no answer (None).
    """

    def __init__(self):
        self.host = host_identity()
        self._lock = threading.Lock()
        self._pidfds: dict[str, int] = {}  # region text -> pidfd

    def liveness(self, peer: PeerRecord) -> Callable[[], bool] | None:
        region = same_host_region(peer, self.host)
        if region is None or not hasattr(os, "pidfd_open"):
            return None
        key = region.encode()
        with self._lock:
            pidfd = self._pidfds.get(key)
            if pidfd is None:
                try:
                    pidfd = os.pidfd_open(region.pid)
                    name = os.readlink(region_path(region))
                except OSError:  # exited already: its lease is the whole story
                    if pidfd is not None:
                        os.close(pidfd)
                    return None
                if not names_region(name, region):
                    os.close(pidfd)
                    return None
                self._pidfds[key] = pidfd
        return lambda: _running(pidfd)

    def close(self) -> None:
        with self._lock:
            pidfds, self._pidfds = self._pidfds, {}
        for pidfd in pidfds.values():
            os.close(pidfd)


def _running(pidfd: int) -> bool:
    """A pidfd turns readable when its process exits."""
    readable, _, _ = select.select([pidfd], [], [], 0)
    return not readable
