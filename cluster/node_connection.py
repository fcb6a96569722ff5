"""NodeConnection: many concurrent request streams to one node over one ZMQ DEALER.

A receiver thread owns the socket; ``submit`` hands a request to it (a queue, and a
byte down a pipe that wakes the thread at once) and returns a queue that receives
that request's TokenEvents. If the node stops answering
(no message for ``liveness_s`` and no reply to a ping), every open stream gets a
``NodeLost`` instead, so no caller waits forever and the router can migrate. An
endpoint that cannot be connected to, or a node that refuses our handshake (another
cluster token), fails every stream at once, and every later one, the same way.
"""
from __future__ import annotations

import os
import queue
import threading
import time
import uuid

import zmq

from kvmesh.auth import REFUSED, AuthError, ClusterAuth, HandshakeMonitor
from kvmesh.errors import KvmeshError
from kvmesh.node import messages as nm
from kvmesh.wire import MessageError, decode, encode


IDLE_POLL_MS = 20  # the socket thread's longest wait: the tick of the liveness checks, not of sending


class NodeLost(KvmeshError, ConnectionError):
    """The node stopped answering; its streams will never finish."""


class NodeConnection:
    def __init__(self, node_id: str, endpoint: str, liveness_s: float = 5.0, auth: ClusterAuth | None = None):
        """``auth`` seals every request with the cluster token (nodes refuse frames without it)."""
        self.node_id = node_id
        self._auth = auth or ClusterAuth()
        self.endpoint = endpoint
        self.liveness_s = liveness_s
        self._ctx = zmq.Context.instance()
        self._outgoing: queue.Queue[bytes] = queue.Queue()
        self._wake_r, self._wake_w = os.pipe()  # written after each put: the socket thread stops waiting
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._streams: dict[str, queue.Queue] = {}
        self._stats_waiters: list[queue.Queue] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.alive = True
        self._thread = threading.Thread(target=self._run, name=f"kvmesh-conn-{node_id}", daemon=True)
        self._thread.start()

    @property
    def num_open(self) -> int:
        return len(self._streams)

    def submit(self, request: nm.GenerateRequest, events: queue.Queue | None = None) -> queue.Queue:
        """Send ``request``; its TokenEvents (or a NodeLost) arrive on ``events`` (a new queue by default).

        Several requests may share one queue: events then arrive in the order the node sent them.
        """
        events = queue.Queue() if events is None else events
        with self._lock:
            if not self.alive:
                events.put(NodeLost(f"decode node {self.node_id} is unreachable"))
                return events
            self._streams[request.request_id] = events
        self._send(encode(request))
        return events

    def abort(self, request_id: str) -> None:
        """Tell the node to drop a request (its caller went away)."""
        with self._lock:
            self._streams.pop(request_id, None)
        self._send(encode(nm.AbortRequest(request_id)))

    def stats(self, check: bool = False, timeout_s: float = 5.0,
              kv_probe: list[int] | None = None) -> nm.StatsReply | None:
        """The node's counters (with ``check``, after its integrity checks; with ``kv_probe``, that prompt's KV
        fingerprint); None if it does not answer."""
        waiter: queue.Queue = queue.Queue()
        with self._lock:
            self._stats_waiters.append(waiter)
        self._send(encode(nm.StatsRequest(check, list(kv_probe or []))))
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                reply = waiter.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return None
            if not kv_probe or "kv_probe" in reply.stats or reply.error:
                return reply
            with self._lock:  # the answer to a plainer stats request (a liveness ping): ours comes later
                self._stats_waiters.append(waiter)

    def set_role(self, role: str, drain_timeout_s: float = 30.0, timeout_s: float = 10.0) -> nm.RoleReply | None:
        """Ask the node to take ``role`` (``nm.SetRole``); its answer, or None if it does not answer (a decode node
        becoming a prefill node answers at once, ``draining``, and drains after)."""
        request = nm.SetRole(f"role-{uuid.uuid4().hex[:12]}", role, drain_timeout_s)
        answers = self.submit(request)
        try:
            answer = answers.get(timeout=timeout_s)
        except queue.Empty:
            with self._lock:
                self._streams.pop(request.request_id, None)
            return None
        return answer if isinstance(answer, nm.RoleReply) else None

    def _send(self, payload: bytes) -> None:
        """Queue ``payload`` for the socket thread and wake it (any thread)."""
        self._outgoing.put(payload)
        self._wake()

    def _wake(self) -> None:
        with self._lock:
            if self._wake_w < 0:  # closed
                return
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:  # the pipe is full: the thread has wake-ups pending anyway
                pass

    def _run(self) -> None:
        sock = self._auth.curve_client(self._ctx.socket(zmq.DEALER))
        sock.linger = 0
        try:
            sock.connect(f"tcp://{self.endpoint}")
        except zmq.ZMQError as e:
            sock.close()
            self._give_up(NodeLost(f"cannot connect to node {self.node_id} at {self.endpoint!r}: {e}"))
            return
        handshakes = self._auth.handshake_monitor(sock)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        if handshakes is not None:
            poller.register(handshakes.socket, zmq.POLLIN)
        try:
            self._serve(sock, poller, handshakes)
        finally:
            if handshakes is not None:
                handshakes.close()
            sock.close()

    def _give_up(self, error: NodeLost) -> None:
        """This connection will never work: fail what is open and everything submitted later."""
        with self._lock:
            self.alive = False
        self._fail_all(error)

    def _serve(self, sock: zmq.Socket, poller: zmq.Poller, handshakes: HandshakeMonitor | None) -> None:
        last_heard, pinged = time.monotonic(), False
        while not self._stop.is_set():
            while not self._outgoing.empty():
                sock.send(self._auth.seal(self._outgoing.get_nowait()))
            events = dict(poller.poll(IDLE_POLL_MS))
            if self._wake_r in events:
                self._drain_wakeups()
            if handshakes is not None and handshakes.socket in events and handshakes.drain() \
                    and not handshakes.num_succeeded:
                self._fail_all(NodeLost(f"node {self.node_id} refused our handshake: the cluster token differs"))
            if sock in events:
                last_heard, pinged, self.alive = time.monotonic(), False, True
                frame = sock.recv()
                if frame == REFUSED:
                    self._fail_all(NodeLost(f"node {self.node_id} refused our requests: the cluster token differs"))
                    continue
                try:
                    msg = decode(self._auth.open(frame), (nm.TokenEvent, nm.TokenBatch, nm.StatsReply, nm.RoleReply))
                    for one in msg.unpack() if isinstance(msg, nm.TokenBatch) else (msg,):
                        self._dispatch(one)
                except (MessageError, AuthError):
                    continue
            elif self._streams and time.monotonic() - last_heard > self.liveness_s:
                if pinged:
                    self.alive = False
                    self._fail_all(NodeLost(f"decode node {self.node_id} stopped answering"))
                    last_heard, pinged = time.monotonic(), False
                else:
                    sock.send(self._auth.seal(encode(nm.StatsRequest())))
                    last_heard, pinged = time.monotonic(), True

    def _drain_wakeups(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _dispatch(self, msg) -> None:
        if isinstance(msg, nm.StatsReply):
            with self._lock:
                waiters, self._stats_waiters = self._stats_waiters, []
            for w in waiters:
                w.put(msg)
            return
        with self._lock:
            events = self._streams.get(msg.request_id)
            if msg.finished:
                self._streams.pop(msg.request_id, None)
        if events is not None:
            events.put(msg)

    def _fail_all(self, error: NodeLost) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
        for events in streams.values():
            events.put(error)

    def close(self) -> None:
        self._stop.set()
        self._wake()
        self._thread.join(timeout=2)
        self._fail_all(NodeLost("router shutting down"))
        if not self._thread.is_alive():
            with self._lock:
                if self._wake_w >= 0:
                    os.close(self._wake_r)
                    os.close(self._wake_w)
                    self._wake_r = self._wake_w = -1
