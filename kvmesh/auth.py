"""Cluster authentication: every frame between kvmesh processes is sealed under the cluster secret.

    frame on the wire = mac (16 bytes) || nonce (12 bytes) || sent_ms (8 bytes, big endian) || payload
    mac = blake2b(nonce || sent_ms || payload, key=blake2b(token, person="kvmesh-auth-v2"), digest_size=16)

Node request endpoints, side channels and the ZMQ transfer engine's headers are
sealed with ``ClusterAuth.seal`` and opened with ``ClusterAuth.open``. A frame is
refused (``AuthError``, counted by the receiver) when its MAC does not verify, when
it was sealed more than ``MAX_AGE_S`` ago (or that far in the future), or when its
nonce was already seen (``ReplayGuard``): a sniffed frame cannot be replayed.
Receivers answer a refused frame with the unsealed ``REFUSED`` marker so that a
client holding the wrong token gets a clear error instead of a timeout.

With a token, every ZMQ socket between kvmesh processes also runs CurveZMQ
(``curve_server`` / ``curve_client``): frames are encrypted and authenticated per
connection, with a key pair derived from the token. A process without the token
cannot complete the handshake with any kvmesh socket; servers count such
handshakes (``HandshakeMonitor``).

The token comes from ``--cluster-token`` or the ``KVMESH_CLUSTER_TOKEN``
environment variable; ``kvmesh serve`` / ``launch`` / ``local-cluster`` generate
one and hand it to the processes they start through the environment (never argv,
which every local user can read). An empty token still seals frames, but with a
key anyone can derive and no encryption: allowed on loopback only
(``require_secret``), or where ``--insecure`` says so.
"""
from __future__ import annotations

import hashlib
import hmac
import itertools
import os
import secrets
import struct
import threading
import time

import zmq
from zmq.utils import z85

from kvmesh.errors import KvmeshError

TOKEN_ENV = "KVMESH_CLUSTER_TOKEN"
MAC_BYTES = 16
NONCE_BYTES = 12
HEADER_BYTES = MAC_BYTES + NONCE_BYTES + 8
MAX_AGE_S = 60.0  # frames older (or further ahead) than this are refused; nonces are kept this long
REPLAY_WINDOW = 1 << 16  # per sender: how far behind its newest frame one may arrive (reordering), bits kept
REFUSED = b"KVMESH-AUTH-REFUSED"  # unsealed answer to a frame that failed authentication


class AuthError(KvmeshError, PermissionError):
    """A frame without a valid MAC for this cluster's token, a stale frame, or a replayed one."""


class InsecureClusterError(KvmeshError, PermissionError):
    """A process bound beyond loopback without a cluster secret (and without ``--insecure``)."""


def generate_token() -> str:
    """A fresh random cluster token (256 bits, hex)."""
    return secrets.token_hex(32)


def token_from_env(explicit: str | None = None) -> str:
    """``explicit`` when given, else ``$KVMESH_CLUSTER_TOKEN``, else "" (unauthenticated)."""
    return explicit if explicit is not None else os.environ.get(TOKEN_ENV, "")


def derive_key(token: str, purpose: str, size: int = 32) -> bytes:
    """A key for one ``purpose`` (frames, records, etcd password, curve), independent of the others."""
    return hashlib.blake2b(token.encode(), digest_size=size, person=purpose.encode()[:16].ljust(16, b"\0")).digest()


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def require_secret(what: str, hosts: list[str], token: str, insecure: bool = False) -> None:
    """Refuse to run ``what`` bound to a non-loopback address without a cluster secret.

    Raises InsecureClusterError naming the address, unless ``insecure`` (``--insecure``) says so."""
    exposed = [h for h in hosts if h and not is_loopback(h)]
    if exposed and not token and not insecure:
        raise InsecureClusterError(
            f"{what} would listen on {exposed[0]} without a cluster secret: anyone who can reach it could "
            f"send it requests or KV. Set ${TOKEN_ENV} (or --cluster-token-file), or bind to 127.0.0.1, or "
            f"pass --insecure to run open on a network you trust")


class ReplayGuard:
    """Refuses frames outside the time window and frames whose nonce was seen, in memory bounded per sender.

    A nonce is a sender's random prefix (one per process) and its counter. Per prefix the guard keeps the
    highest counter seen and a bitmap of the ``window`` counters below it (frames of one sender may arrive
    a little out of order: several threads seal, several sockets carry): a counter seen before, or older
    than the window, is refused. Senders silent for ``max_age_s`` are forgotten: their frames are stale by
    then anyway.
    """

    def __init__(self, max_age_s: float = MAX_AGE_S, window: int = REPLAY_WINDOW):
        self.max_age_s = max_age_s
        self.window = window
        self._senders: dict[bytes, list] = {}  # prefix -> [highest counter, bitmap (bit d: counter highest-d), last seen]
        self._lock = threading.Lock()
        self._next_prune = 0.0

    def check(self, nonce: bytes, sent_s: float, now: float) -> str:
        """"" when fresh (and now remembered), else why the frame is refused."""
        if abs(now - sent_s) > self.max_age_s:
            return f"frame sent {now - sent_s:+.0f} s ago, outside the {self.max_age_s:.0f} s window"
        prefix, counter = nonce[:-4], int.from_bytes(nonce[-4:], "big")
        with self._lock:
            state = self._senders.get(prefix)
            if state is None:
                state = self._senders[prefix] = [counter, 1, now]
            elif counter > state[0]:
                shift = counter - state[0]
                state[0], state[1] = counter, ((state[1] << shift) | 1) & ((1 << self.window) - 1) \
                    if shift < self.window else 1
            else:
                behind = state[0] - counter
                if behind >= self.window:
                    return f"frame too far behind its sender's newest ({behind} frames): refused as a replay"
                if state[1] >> behind & 1:
                    return "frame replayed (its nonce was already seen)"
                state[1] |= 1 << behind
            state[2] = now
            if now >= self._next_prune:
                self._next_prune = now + self.max_age_s / 4
                horizon = now - self.max_age_s
                self._senders = {p: st for p, st in self._senders.items() if st[2] >= horizon}
        return ""


class ClusterAuth:
    """Seals and opens frames with the cluster key; secures ZMQ sockets; safe to share between threads."""

    def __init__(self, token: str = ""):
        self.enabled = bool(token)
        self._key = derive_key(token, "kvmesh-auth-v2")
        self.record_key = derive_key(token, "kvmesh-record-v1")
        self._nonce_prefix = secrets.token_bytes(NONCE_BYTES - 4)
        self._counter = itertools.count()
        self._guard = ReplayGuard()
        if self.enabled and not zmq.has("curve"):
            raise AuthError("this pyzmq's libzmq was built without CURVE (libsodium): kvmesh cannot encrypt its "
                            "channels; install a pyzmq wheel (they bundle it)")
        secret = z85.encode(derive_key(token, "kvmesh-curve-v1"))
        self._curve = (zmq.curve_public(secret), secret) if self.enabled else None
        self.num_refused = 0  # frames that failed ``open``

    def mac(self, payload: bytes | memoryview) -> bytes:
        return hashlib.blake2b(payload, key=self._key, digest_size=MAC_BYTES).digest()

    def seal(self, payload: bytes) -> bytes:
        epoch, counter = divmod(next(self._counter), 1 << 32)
        prefix = self._nonce_prefix if not epoch else \
            hashlib.blake2b(self._nonce_prefix + epoch.to_bytes(8, "big"), digest_size=NONCE_BYTES - 4).digest()
        nonce = prefix + counter.to_bytes(4, "big")  # a fresh sender prefix past 2^32 frames: never a repeat
        body = nonce + struct.pack(">Q", int(time.time() * 1000)) + payload
        return self.mac(body) + body

    def open(self, frame: bytes) -> bytes:
        """The payload of a sealed frame; raises AuthError (and counts it) if the MAC is wrong, the frame
        is stale or it was seen before."""
        body = frame[MAC_BYTES:]
        if len(frame) < HEADER_BYTES or not hmac.compare_digest(frame[:MAC_BYTES], self.mac(body)):
            self.num_refused += 1
            raise AuthError("frame refused: missing or wrong cluster token")
        sent_s = struct.unpack_from(">Q", body, NONCE_BYTES)[0] / 1000
        why = self._guard.check(bytes(body[:NONCE_BYTES]), sent_s, time.time())
        if why:
            self.num_refused += 1
            raise AuthError(f"frame refused: {why}")
        return body[NONCE_BYTES + 8:]

    def open_reply(self, frame: bytes, peer: str) -> bytes:
        """Client side: a reply's payload; a REFUSED marker becomes an AuthError naming the peer."""
        if frame == REFUSED:
            raise AuthError(f"{peer} refused our request: the cluster token differs (--cluster-token / "
                            f"${TOKEN_ENV}), or our frame was stale or replayed")
        try:
            return self.open(frame)
        except AuthError as e:
            raise AuthError(f"a reply from {peer} failed authentication: {e}") from None

    def curve_server(self, sock: zmq.Socket) -> zmq.Socket:
        """Make ``sock`` (before bind) a CurveZMQ server under the cluster key; no-op without a token."""
        if self._curve is not None:
            sock.curve_server = True
            sock.curve_publickey, sock.curve_secretkey = self._curve
        return sock

    def handshake_monitor(self, sock: zmq.Socket) -> HandshakeMonitor | None:
        """A counter of ``sock``'s failed CurveZMQ handshakes (None without a token: there are none)."""
        return HandshakeMonitor(sock) if self._curve is not None else None

    def curve_client(self, sock: zmq.Socket) -> zmq.Socket:
        """Make ``sock`` (before connect) a CurveZMQ client of servers under the cluster key."""
        if self._curve is not None:
            sock.curve_serverkey = self._curve[0]
            sock.curve_publickey, sock.curve_secretkey = self._curve
        return sock


_FAILED_HANDSHAKE = (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH |
                     zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


class HandshakeMonitor:
    """Counts failed CurveZMQ handshakes on one socket (peers without the cluster key).

    Poll ``socket`` with the owner's poller and call ``drain`` when it is readable (the owning thread)."""

    def __init__(self, sock: zmq.Socket):
        self._monitored = sock
        self.socket = sock.get_monitor_socket(_FAILED_HANDSHAKE | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.num_failed = 0
        self.num_succeeded = 0

    def drain(self) -> int:
        """Read pending events; returns how many failed handshakes they held."""
        failed = 0
        while self.socket.poll(0):
            frames = self.socket.recv_multipart()
            event = struct.unpack_from("=H", frames[0])[0]
            if event & _FAILED_HANDSHAKE:
                failed += 1
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.num_succeeded += 1
        self.num_failed += failed
        return failed

    def close(self) -> None:
        """Stop monitoring (before the monitored socket closes) and close the monitor; idempotent."""
        if not self._monitored.closed:
            self._monitored.disable_monitor()
        if not self.socket.closed:
            self.socket.close(linger=0)


def add_secret_arguments(p, generated: bool = False) -> None:
    """``--cluster-token-file`` and ``--insecure`` (the secret itself comes from the environment or a file)."""
    p.add_argument("--cluster-token-file", default=None,
                   help=f"file holding the cluster secret that authenticates and encrypts every frame and etcd "
                        f"value (default: ${TOKEN_ENV}" + (", else a new random one" if generated else "") + ")")
    p.add_argument("--insecure", action="store_true",
                   help="allow binding beyond loopback without a cluster secret (anyone who can reach the "
                        "ports can then submit work, read prompts and write KV)")


def secret_from_args(args) -> str:
    """The cluster secret named by ``--cluster-token-file`` (stripped), else ``$KVMESH_CLUSTER_TOKEN``, else ""."""
    path = getattr(args, "cluster_token_file", None)
    if path:
        try:
            with open(path) as f:
                token = f.read().strip()
        except OSError as e:
            raise InsecureClusterError(f"cannot read --cluster-token-file {path}: {e.strerror}") from None
        if not token:
            raise InsecureClusterError(f"--cluster-token-file {path} is empty")
        return token
    return token_from_env()
