"""Pure-pyzmq transfer backend: the same one-sided "write into the peer's memory" contract.

The receiving side runs a ROUTER thread that copies each payload frame into its
registered memory, after checking the target range lies inside a registered
region; the writer sends one multipart message per batch and waits for the ack.
"""
from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Sequence

import msgpack
import torch
import zmq

from kvmesh.transfer.coalesce import Descriptor
from kvmesh.transfer.errors import TransferError, TransferTimeout


class ZmqTransferEngine:
    name = "zmq"
    transport = "zmq-tcp"
    transport_reason = "pure pyzmq backend over tcp"
    max_descriptor_bytes = 0

    def __init__(self, host: str = "127.0.0.1"):
        self._ctx = zmq.Context.instance()
        self._regions: list[tuple[int, int, torch.Tensor]] = []
        self._server = self._ctx.socket(zmq.ROUTER)
        self._server.linger = 0
        port = self._server.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"{host}:{port}"
        self._peers: dict[str, zmq.Socket] = {}
        self._send_lock = threading.Lock()
        self._seq = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvmesh-zmq-transfer", daemon=True)
        self._thread.start()

    def register(self, tensor: torch.Tensor) -> int:
        if not tensor.is_contiguous():
            raise ValueError("only contiguous tensors can be registered")
        addr = tensor.data_ptr()
        self._regions.append((addr, addr + tensor.numel() * tensor.element_size(), tensor))
        return addr

    def _inside(self, addr: int, length: int) -> bool:
        return any(lo <= addr and addr + length <= hi for lo, hi, _ in self._regions)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._server, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            identity, header, *payloads = self._server.recv_multipart(copy=False)
            seq, error = -1, b""
            try:
                seq, targets = msgpack.unpackb(header.bytes)
                if len(targets) != len(payloads):
                    raise ValueError("frame count does not match the header")
                for (addr, length), frame in zip(targets, payloads):
                    if len(frame.buffer) != length or not self._inside(addr, length):
                        raise ValueError(f"write of {length} bytes at {addr:#x} is outside registered memory")
                for (addr, length), frame in zip(targets, payloads):
                    _memory(addr, length)[:] = frame.buffer
            except Exception as e:  # a bad batch is refused whole; the server keeps serving
                error = str(e).encode()
            self._server.send_multipart([identity.bytes, msgpack.packb([seq, error])])

    def write(self, peer_endpoint: str, descriptors: Sequence[Descriptor], *, request_id: str = "",
              timeout_s: float = 30.0) -> None:
        if not descriptors:
            return
        with self._send_lock:
            sock = self._peers.get(peer_endpoint)
            if sock is None:
                sock = self._ctx.socket(zmq.DEALER)
                sock.linger = 0
                sock.connect(f"tcp://{peer_endpoint}")
                self._peers[peer_endpoint] = sock
            seq = next(self._seq)
            header = msgpack.packb([seq, [[d.dst_addr, d.length] for d in descriptors]])
            frames = [header] + [_memory(d.src_addr, d.length) for d in descriptors]
            sock.send_multipart(frames, copy=False)
            deadline = timeout_s * 1000
            while True:
                if not sock.poll(deadline):
                    sock.close()
                    del self._peers[peer_endpoint]
                    raise TransferTimeout(f"no ack for a {len(descriptors)}-descriptor write within {timeout_s} s",
                                          request_id=request_id, peer=peer_endpoint)
                ack_seq, error = msgpack.unpackb(sock.recv())
                if ack_seq == seq:
                    break  # older acks belong to writes that timed out
            if error:
                raise TransferError(f"peer refused the write: {error.decode()}", request_id=request_id,
                                    peer=peer_endpoint)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        for sock in self._peers.values():
            sock.close()
        self._server.close()


def _memory(addr: int, length: int) -> memoryview:
    """A byte view of registered memory at ``addr`` (no copy)."""
    return memoryview((ctypes.c_ubyte * length).from_address(addr)).cast("B")
