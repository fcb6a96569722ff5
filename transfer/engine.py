"""The transfer engine interface and its registry.

A node registers its KV buffer once; a holder then writes byte ranges of its own
registered memory into a peer's registered memory (``write``). Backends:
``mooncake`` (Mooncake TE, rdma or tcp) and ``zmq`` (pure pyzmq, for machines where
Mooncake cannot load).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from kvmesh.auth import is_loopback
from kvmesh.netaddr import is_wildcard
from kvmesh.transfer.coalesce import Descriptor

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvmesh.transfer")


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
    """``backend``: mooncake, zmq, or auto; binds ``host``, publishes ``advertise``.

    auto: Mooncake when it loads, except on a node bound to loopback: Mooncake's handshake and data ports
    listen on every interface whatever ``host`` says (its data port takes raw reads and writes from anyone
    who reaches it), which would open a loopback-only node to the network; zmq (encrypted) there."""
    reason = ""
    if backend == "auto":
        if is_loopback(host):
            backend, reason = "zmq", ("auto: zmq, not Mooncake, on a loopback-bound node (Mooncake's ports would "
                                      "listen on every interface)")
        else:
            backend = "mooncake" if mooncake_available() else "zmq"
    if backend == "mooncake":
        from kvmesh.transfer.mooncake_engine import MooncakeTransferEngine

        if not is_wildcard(host):
            log.warning("Mooncake's handshake and data ports listen on every interface, not only on %s: its data "
                        "port takes reads and writes at raw addresses from anyone who reaches it. Keep these "
                        "ports on a private network (docs/security.md) or use --transfer-backend zmq", host)
        return MooncakeTransferEngine(host=host, transport=transport, metadata_server=metadata_server,
                                      advertise=advertise)
    if backend == "zmq":
        from kvmesh.transfer.zmq_engine import ZmqTransferEngine

        engine = ZmqTransferEngine(host=host, auth=auth, advertise=advertise)
        if reason:
            engine.transport_reason = reason
        return engine
    raise ValueError(f"unknown transfer backend {backend!r} (choose from auto, mooncake, zmq)")
