"""The transfer engine interface and its registry.

A node registers its KV buffer once; a holder then writes byte ranges of its own
registered memory into a peer's registered memory (``write``). Backends:
``mooncake`` (Mooncake TE, rdma or tcp) and ``zmq`` (pure pyzmq, for machines where
Mooncake cannot load).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from kvmesh.transfer.coalesce import Descriptor


class TransferEngine(Protocol):
    name: str
    transport: str  # what really moves the bytes: "rdma", "tcp", "zmq-tcp"
    transport_reason: str  # why (e.g. "no RDMA device found: using tcp")
    endpoint: str  # where peers' writes land (give it to them)
    max_descriptor_bytes: int  # cut longer runs into pieces of this size (0: never)

    def register(self, tensor: torch.Tensor) -> int:
        """Register a tensor's memory for incoming and outgoing writes; returns its base address."""

    def write(self, peer_endpoint: str, descriptors: Sequence[Descriptor], *, request_id: str = "",
              grant_id: str = "", timeout_s: float = 30.0) -> None:
        """Copy each descriptor's local range to the peer's range in one batch, under the peer's grant.

        Raises TransferError; TransferTimeout past ``timeout_s`` (its ``pending`` is set when the
        batch may still be running natively).
        """

    def close(self) -> None: ...


def mooncake_available() -> bool:
    try:
        import mooncake.engine  # noqa: F401
    except Exception:  # ImportError, or OSError when libibverbs / libcuda is missing
        return False
    return True


def create_transfer_engine(backend: str = "auto", *, host: str = "127.0.0.1", transport: str = "auto",
                           metadata_server: str = "P2PHANDSHAKE", auth=None,
                           advertise: str | None = None) -> TransferEngine:
    """``backend``: mooncake, zmq, or auto (Mooncake when it loads, else zmq); binds ``host``, publishes ``advertise``."""
    if backend == "auto":
        backend = "mooncake" if mooncake_available() else "zmq"
    if backend == "mooncake":
        from kvmesh.transfer.mooncake_engine import MooncakeTransferEngine

        return MooncakeTransferEngine(host=host, transport=transport, metadata_server=metadata_server,
                                      advertise=advertise)
    if backend == "zmq":
        from kvmesh.transfer.zmq_engine import ZmqTransferEngine

        return ZmqTransferEngine(host=host, auth=auth, advertise=advertise)
    raise ValueError(f"unknown transfer backend {backend!r} (choose from auto, mooncake, zmq)")
