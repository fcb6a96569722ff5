"""RouterEndpoint: a ZMQ ROUTER that any thread can answer through.

ZMQ sockets are not thread-safe, so replies from worker threads go through an
in-process PUSH socket per thread to the one thread that owns the ROUTER.
"""
from __future__ import annotations

import threading
import uuid
from collections.abc import Callable

import zmq


class RouterEndpoint:
    def __init__(self, host: str, on_message: Callable[[bytes, bytes], None], name: str):
        self._ctx = zmq.Context.instance()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.linger = 0
        self.endpoint = f"{host}:{self._router.bind_to_random_port(f'tcp://{host}')}"
        self._outbox_addr = f"inproc://kvmesh-{name}-{uuid.uuid4().hex}"
        self._outbox = self._ctx.socket(zmq.PULL)
        self._outbox.bind(self._outbox_addr)
        self._local = threading.local()
        self._on_message = on_message
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"kvmesh-{name}", daemon=True)
        self._thread.start()

    def send(self, identity: bytes, payload: bytes) -> None:
        """Send ``payload`` to the peer ``identity``; callable from any thread."""
        sock = getattr(self._local, "push", None)
        if sock is None:
            sock = self._local.push = self._ctx.socket(zmq.PUSH)
            sock.linger = 1000
            sock.connect(self._outbox_addr)
        sock.send_multipart([identity, payload])

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._outbox, zmq.POLLIN)
        while not self._stop.is_set():
            events = dict(poller.poll(100))
            if self._outbox in events:
                while self._outbox.poll(0):
                    self._router.send_multipart(self._outbox.recv_multipart())
            if self._router in events:
                frames = self._router.recv_multipart()
                if len(frames) == 2:
                    self._on_message(frames[0], frames[1])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._router.close()
        self._outbox.close()
