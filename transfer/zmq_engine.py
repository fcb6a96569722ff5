"""Pure-pyzmq transfer backend: the same "write into the peer's memory" contract, but refusable.

The receiving side runs a ROUTER thread that copies each payload frame into its
registered memory; the writer sends one multipart message per batch (a header
sealed with the cluster MAC naming the grant and the target ranges, then the
payload frames) and waits for the ack. With a cluster token both ends run
CurveZMQ, so the payload frames are encrypted and authenticated too. Before copying, the receiver checks the
header's MAC, that every range lies inside registered memory, and, when a write
guard is set (nodes set their GrantTable's), that the ranges lie in the blocks
of an open grant: a write after a revoke is refused, never copied.
"""
from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Callable, Sequence

import msgpack
import torch
import zmq

from kvmesh.auth import AuthError, ClusterAuth
from kvmesh.netaddr import zmq_bind_host
from kvmesh.transfer.coalesce import Descriptor
from kvmesh.transfer.errors import TransferError, TransferTimeout


class ZmqTransferEngine:
    name = "zmq"
    transport = "zmq-tcp"
    transport_reason = "pure pyzmq backend over tcp"
    max_descriptor_bytes = 0

    def __init__(self, host: str = "127.0.0.1", auth: ClusterAuth | None = None, advertise: str | None = None):
        self._ctx = zmq.Context.instance()
        self._auth = auth or ClusterAuth()
        self._guard: Callable[[str, list[tuple[int, int]], Callable[[], None]], None] | None = None
        self.num_refused = 0  # batches refused for any reason
        self.num_unauthenticated = 0  # of which: no valid cluster MAC
        self._regions: list[tuple[int, int, torch.Tensor]] = []
        self._server = self._auth.curve_server(self._ctx.socket(zmq.ROUTER))
        self._server.linger = 0
        self._handshakes = self._auth.handshake_monitor(self._server)
        port = self._server.bind_to_random_port(f"tcp://{zmq_bind_host(host)}")
        self.endpoint = f"{advertise or host}:{port}"
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

    def set_write_guard(self, guard: Callable[[str, list[tuple[int, int]], Callable[[], None]], None]) -> None:
        """``guard(grant_id, ranges, do_write)`` runs ``do_write`` or raises to refuse the batch."""
        self._guard = guard

    def _inside(self, addr: int, length: int) -> bool:
        return any(lo <= addr and addr + length <= hi for lo, hi, _ in self._regions)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._server, zmq.POLLIN)
        if self._handshakes is not None:
            poller.register(self._handshakes.socket, zmq.POLLIN)
        while not self._stop.is_set():
            events = dict(poller.poll(100))
            if self._handshakes is not None and self._handshakes.socket in events:
                failed = self._handshakes.drain()  # writers without the cluster key: never a byte copied
                self.num_refused += failed
                self.num_unauthenticated += failed
            if self._server not in events:
                continue
            identity, header, *payloads = self._server.recv_multipart(copy=False)
            seq, error = -1, b""
            try:
                seq, grant_id, targets = msgpack.unpackb(self._auth.open(header.bytes))
                if len(targets) != len(payloads):
                    raise ValueError("frame count does not match the header")
                for (addr, length), frame in zip(targets, payloads):
                    if len(frame.buffer) != length or not self._inside(addr, length):
                        raise ValueError(f"write of {length} bytes at {addr:#x} is outside registered memory")

                def copy() -> None:
                    for (addr, length), frame in zip(targets, payloads):
                        _memory(addr, length)[:] = frame.buffer

                if self._guard is not None:
                    self._guard(grant_id, [(a, n) for a, n in targets], copy)
                else:
                    copy()
            except Exception as e:  # a bad or unauthorised batch is refused whole; the server keeps serving
                self.num_refused += 1
                error = (str(e) or type(e).__name__).encode()
                if isinstance(e, AuthError):
                    seq = -1
                    self.num_unauthenticated += 1
            self._server.send_multipart([identity.bytes, msgpack.packb([seq, error])])

    def write(self, peer_endpoint: str, descriptors: Sequence[Descriptor], *, request_id: str = "",
              grant_id: str = "", timeout_s: float = 30.0) -> None:
        if not descriptors:
            return
        with self._send_lock:
            sock = self._peers.get(peer_endpoint)
            if sock is None:
                sock = self._auth.curve_client(self._ctx.socket(zmq.DEALER))
                sock.linger = 0
                sock.connect(f"tcp://{peer_endpoint}")
                self._peers[peer_endpoint] = sock
            seq = next(self._seq)
            header = self._auth.seal(msgpack.packb([seq, grant_id, [[d.dst_addr, d.length] for d in descriptors]]))
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
                if ack_seq in (seq, -1):
                    break  # older acks belong to writes that timed out; -1: our header was refused
            if error:
                raise TransferError(f"peer refused the write: {error.decode()}", request_id=request_id,
                                    peer=peer_endpoint)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        for sock in self._peers.values():
            sock.close()
        if self._handshakes is not None:
            self._handshakes.close()
        self._server.close()


def _memory(addr: int, length: int) -> memoryview:
    """A byte view of registered memory at ``addr`` (no copy)."""
    return memoryview((ctypes.c_ubyte * length).from_address(addr)).cast("B")
