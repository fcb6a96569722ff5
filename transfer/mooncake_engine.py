"""Mooncake transfer engine backend (rdma where a device exists, tcp otherwise).

Mooncake writes are one-sided: the receiver cannot refuse them, so kvmesh fences
them with grants and quarantine (``transfer/grants.py``). ``write`` honours its
timeout: the native batch runs on a helper thread; past the timeout a
TransferTimeout carries the still-running batch (``pending``) so that the writer
can tell the receiver it has stopped only once the batch really has.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from kvmesh.netaddr import is_wildcard
from kvmesh.transfer.coalesce import Descriptor
from kvmesh.transfer.errors import TransferError, TransferTimeout, check_status
from kvmesh.transfer.rdma_devices import choose_transport


class MooncakeTransferEngine:
    name = "mooncake"

    def __init__(self, host: str = "127.0.0.1", transport: str = "auto", metadata_server: str = "P2PHANDSHAKE",
                 advertise: str | None = None):
        """``host``: where to bind; ``advertise``: the address peers write to (default ``host``)."""
        choice = choose_transport(transport)
        advertise = advertise or host
        # Mooncake's TCP transport binds to this address (an inherited value must not override --host);
        # it still listens on the wildcard address for its handshake. Its glog INFO lines are noise.
        if is_wildcard(host):
            os.environ.pop("MC_TCP_BIND_ADDRESS", None)
        else:
            os.environ["MC_TCP_BIND_ADDRESS"] = host
        os.environ.setdefault("GLOG_minloglevel", "1")
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", "30")  # the native layer's own bound on one batch
        try:
            from mooncake.engine import TransferEngine as _Engine
        except Exception as e:
            raise TransferError(f"Mooncake cannot be loaded here ({e}); use the zmq backend") from None
        self._engine = _Engine()
        device = ",".join(choice.devices) if choice.protocol == "rdma" else ""
        check_status(self._engine.initialize(advertise, metadata_server, choice.protocol, device),
                     what=f"Mooncake initialize ({choice.protocol} on {advertise})")
        self.transport = choice.protocol
        self.transport_reason = choice.reason
        self.endpoint = f"{advertise}:{self._engine.get_rpc_port()}"
        # Over TCP one descriptor is one stream: 1 MiB pieces keep several in flight (~2x on 64 MiB here).
        self.max_descriptor_bytes = 2**20 if self.transport == "tcp" else 0
        self._registered: list[torch.Tensor] = []
        self._batches = ThreadPoolExecutor(8, thread_name_prefix="kvmesh-mooncake")

    def register(self, tensor: torch.Tensor) -> int:
        if not tensor.is_contiguous():
            raise ValueError("only contiguous tensors can be registered")
        addr, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        check_status(self._engine.register_memory(addr, size), what="Mooncake register_memory")
        self._registered.append(tensor)  # keep the memory alive while registered
        return addr

    def write(self, peer_endpoint: str, descriptors: Sequence[Descriptor], *, request_id: str = "",
              grant_id: str = "", timeout_s: float = 30.0) -> None:
        if not descriptors:
            return
        batch = self._batches.submit(
            self._engine.batch_transfer_sync_write, peer_endpoint, [d.src_addr for d in descriptors],
            [d.dst_addr for d in descriptors], [d.length for d in descriptors])
        try:
            status = batch.result(timeout=timeout_s)
        except FutureTimeout:
            error = TransferTimeout(f"Mooncake write of {len(descriptors)} descriptors still running after "
                                    f"{timeout_s} s", request_id=request_id, peer=peer_endpoint)
            error.pending = batch
            raise error from None
        check_status(status, what=f"Mooncake batch_transfer_sync_write of {len(descriptors)} descriptors",
                     request_id=request_id, peer=peer_endpoint)

    def close(self) -> None:
        self._batches.shutdown(wait=True)
        for tensor in self._registered:
            self._engine.unregister_memory(tensor.data_ptr())
        self._registered.clear()
