"""RouterEndpoint: an authenticated ZMQ ROUTER that any thread can answer through.

ZMQ sockets are not thread-safe, so replies from worker threads go through an
in-process PUSH socket per thread to the one thread that owns the ROUTER. Every
incoming frame must carry the cluster MAC (``kvmesh.auth``): a frame that does
not (or a stale or replayed one) is refused with the ``REFUSED`` marker and counted
(``num_refused``), and never reaches ``on_message``. Replies are sealed the same
way, by the serving thread. With a cluster token the socket is a CurveZMQ server: a peer without the
token never completes a handshake (counted in ``num_refused`` as well).

Construction binds the socket; ``start`` starts the serving thread.
"""
from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable

import zmq

from kvmesh.auth import REFUSED, AuthError, ClusterAuth
from kvmesh.netaddr import zmq_bind_host

log = logging.getLogger("kvmesh.auth")


class RouterEndpoint:
    def __init__(self, host: str, on_message: Callable[[bytes, bytes], None], name: str,
                 auth: ClusterAuth | None = None, port: int = 0, advertise: str | None = None):
        """Binds ``host`` (``0.0.0.0``: every interface); ``endpoint`` names ``advertise`` (default: ``host``)."""
        self._ctx = zmq.Context.instance()
        self._auth = auth or ClusterAuth()
        self._name = name
        self._router = self._auth.curve_server(self._ctx.socket(zmq.ROUTER))
        self._router.linger = 0
        self._handshakes = self._auth.handshake_monitor(self._router)
        if port:
            self._router.bind(f"tcp://{zmq_bind_host(host)}:{port}")
        else:
            port = self._router.bind_to_random_port(f"tcp://{zmq_bind_host(host)}")
        self.endpoint = f"{advertise or host}:{port}"
        self._outbox_addr = f"inproc://kvmesh-{name}-{uuid.uuid4().hex}"
        self._outbox = self._ctx.socket(zmq.PULL)
        self._outbox.bind(self._outbox_addr)
        self._local = threading.local()
        self._on_message = on_message
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"kvmesh-{name}", daemon=True)
        self.num_refused = 0

    def start(self) -> RouterEndpoint:
        self._thread.start()
        return self

    def send(self, identity: bytes, payload: bytes) -> None:
        """Send ``payload`` to the peer ``identity``; callable from any thread. The endpoint's own thread seals it
        (the caller, often an engine thread, only hands it over)."""
        sock = getattr(self._local, "push", None)
        if sock is None:
            sock = self._local.push = self._ctx.socket(zmq.PUSH)
            sock.linger = 1000
            sock.connect(self._outbox_addr)
        sock.send_multipart([identity, payload], copy=False)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._outbox, zmq.POLLIN)
        if self._handshakes is not None:
            poller.register(self._handshakes.socket, zmq.POLLIN)
        while not self._stop.is_set():
            events = dict(poller.poll(100))
            if self._handshakes is not None and self._handshakes.socket in events:
                self._count_refused(self._handshakes.drain(), "failed handshake(s)")
            if self._outbox in events:
                self._forward_replies(0)
            if self._router in events:
                frames = self._router.recv_multipart()
                if len(frames) != 2:
                    continue
                try:
                    payload = self._auth.open(frames[1])
                except AuthError as e:
                    self._count_refused(1, f"unauthenticated frame(s), last: {e}")
                    self._router.send_multipart([frames[0], REFUSED])
                    continue
                try:
                    self._on_message(frames[0], payload)
                except Exception:  # a handler bug must not stop the endpoint
                    log.exception("%s: handler failed", self._name)

    def _forward_replies(self, wait_ms: int) -> None:
        """Seal and send what ``send`` handed over, until none arrives within ``wait_ms`` (the owning thread)."""
        while self._outbox.poll(wait_ms):
            identity, payload = self._outbox.recv_multipart()
            self._router.send_multipart([identity, self._auth.seal(payload)])

    def _count_refused(self, n: int, what: str) -> None:
        for _ in range(n):
            self.num_refused += 1
            if self.num_refused & (self.num_refused - 1) == 0:  # log the 1st, 2nd, 4th, 8th, ...
                log.warning("%s: refused %d %s", self._name, self.num_refused, what)

    def close(self) -> None:
        """Stop serving; replies already handed to ``send`` are still delivered (up to 1 s). Idempotent."""
        if self._router.closed:
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        self._forward_replies(50)
        if self._handshakes is not None:
            self._handshakes.close()
        self._router.close(linger=1000)
        self._outbox.close()
