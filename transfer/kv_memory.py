"""What the transfer engine reads and writes of a node's KV buffer: the buffer itself, or a host mirror.

    direct        the KV buffer itself is registered: host memory, or device memory that the NIC
                  reads and writes in place (GPUDirect RDMA: an rdma transport and the
                  nvidia_peermem kernel module)
    host-staging  a host mirror of the buffer (same shape; page-locked on CUDA) is registered instead

        device KV buffer   [ b0 | b1 | b2 | ... ]        block b at the same offset in both, so
                              |  stage_out ^ stage_in    grants, addresses and descriptors are
        host mirror        [ b0 | b1 | b2 | ... ]  <-->  those of the mirror, unchanged
                                                 network

A holder copies the blocks it is about to send device -> mirror (``stage_out``, per write);
a requester copies the blocks a writer reports written mirror -> device as each report
arrives (``stage_in``), so those copies overlap the writes still in flight. A block is never
a push source and a receive target at once (sources are cached and pinned, targets freshly
allocated), so the two directions never share a mirror block. The choice and its reason are
made once at start-up (``choose_kv_memory``), logged and published in the node record.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from kvmesh.transfer.coalesce import coalesce

MODES = ("auto", "direct", "host-staging")
PEERMEM_MODULES = (Path("/sys/module/nvidia_peermem"), Path("/sys/module/nv_peer_mem"))


class MemoryChoice(NamedTuple):
    mode: str  # "direct" | "host-staging"
    reason: str


def gpudirect_available(modules: Sequence[Path] = PEERMEM_MODULES) -> bool:
    """Whether the kernel can let an RDMA NIC reach GPU memory (a peer-memory module is loaded)."""
    return any(p.exists() for p in modules)


def choose_mode(requested: str, kv_device: torch.device, engine_name: str, transport: str,
                gpudirect: bool) -> MemoryChoice:
    """Resolve ``--kv-transfer-memory`` for this buffer and engine, saying why (no side effects)."""
    if requested not in MODES:
        raise ValueError(f"--kv-transfer-memory {requested!r}: expected {', '.join(MODES)}")
    if kv_device.type == "cpu":
        if requested == "host-staging":
            return MemoryChoice("host-staging", "host-staging requested (the KV buffer is host memory already)")
        return MemoryChoice("direct", "the KV buffer is host memory")
    if engine_name != "mooncake":
        why = f"the {engine_name} engine copies through host memory only"
    elif transport != "rdma":
        why = f"Mooncake's {transport} transport is not GPUDirect"
    elif not gpudirect:
        why = "no nvidia_peermem module: the RDMA NIC cannot reach GPU memory"
    else:
        why = ""
    if requested == "direct":
        if why:
            raise ValueError(f"--kv-transfer-memory direct with KV on {kv_device}: {why}")
        return MemoryChoice("direct", "direct requested: GPUDirect RDMA")
    if requested == "auto" and not why:
        return MemoryChoice("direct", "GPUDirect RDMA: the NIC reads and writes GPU memory in place")
    return MemoryChoice("host-staging", why or "host-staging requested")


class KVMemory:
    """The tensor a node registers with its transfer engine, and the copies that keep it in step."""

    def __init__(self, kv_buffer: torch.Tensor, choice: MemoryChoice):
        self.kv_buffer = kv_buffer
        self.mode, self.reason = choice
        self.num_blocks_staged_out = 0
        self.num_blocks_staged_in = 0
        self._lock = threading.Lock()  # counters only
        self._stream = None
        if self.mode == "direct":
            self.registered = kv_buffer
            return
        pin = kv_buffer.is_cuda
        self.registered = torch.empty(kv_buffer.shape, dtype=kv_buffer.dtype, device="cpu", pin_memory=pin)
        if kv_buffer.is_cuda:
            self._stream = torch.cuda.Stream(kv_buffer.device)

    @property
    def staged(self) -> bool:
        return self.registered is not self.kv_buffer

    @property
    def host_visible(self) -> bool:
        """Whether the registered memory can be read from the CPU (checksums of sent and received blocks)."""
        return self.registered.device.type == "cpu"

    def stage_out(self, block_ids: Sequence[int]) -> None:
        """Copy these blocks device -> mirror before a write reads them (holders; no-op when direct)."""
        if self.staged and block_ids:
            self._copy(self.registered, self.kv_buffer, block_ids)
            with self._lock:
                self.num_blocks_staged_out += len(block_ids)

    def stage_in(self, block_ids: Sequence[int]) -> None:
        """Copy these blocks mirror -> device once a writer reported them written (requesters)."""
        if self.staged and block_ids:
            self._copy(self.kv_buffer, self.registered, block_ids)
            with self._lock:
                self.num_blocks_staged_in += len(block_ids)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, block_ids: Sequence[int]) -> None:
        spans = [(r.src_start, r.src_start + r.num_blocks) for r in coalesce(block_ids, block_ids)]
        if self._stream is None:
            for start, end in spans:
                dst[start:end].copy_(src[start:end])
            return
        # After every step queued so far (a holder's blocks were just computed), off the compute stream.
        self._stream.wait_stream(torch.cuda.default_stream(self.kv_buffer.device))
        with torch.cuda.stream(self._stream):
            for start, end in spans:
                dst[start:end].copy_(src[start:end], non_blocking=True)
        self._stream.synchronize()  # done before the write starts / before the engine reads the blocks

    def describe(self) -> dict:
        return {"mode": self.mode, "reason": self.reason, "blocks_staged_out": self.num_blocks_staged_out,
                "blocks_staged_in": self.num_blocks_staged_in}


def choose_kv_memory(kv_buffer: torch.Tensor, engine, requested: str = "auto") -> KVMemory:
    """The KV memory of a node whose buffer is ``kv_buffer`` and whose transfer engine is ``engine``."""
    return KVMemory(kv_buffer, choose_mode(requested, kv_buffer.device, engine.name, engine.transport,
                                           gpudirect_available()))
