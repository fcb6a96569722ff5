"""Cluster authentication: every frame between kvmesh processes carries a MAC keyed by the cluster token.

    frame on the wire = mac (16 bytes) || payload
    mac = blake2b(payload, key=blake2b(token, person="kvmesh-auth-v1"), digest_size=16)

Node request endpoints, side channels and the ZMQ transfer engine's headers are
sealed with ``ClusterAuth.seal`` and opened with ``ClusterAuth.open``; a frame
whose MAC does not verify is refused (``AuthError``) and counted by the receiver,
which answers with the unsealed ``REFUSED`` marker so that a client holding the
wrong token gets a clear error instead of a timeout.

The token comes from ``--cluster-token`` or the ``KVMESH_CLUSTER_TOKEN``
environment variable; ``kvmesh serve`` / ``launch`` / ``local-cluster`` generate
one and hand it to the processes they start through the environment (never argv,
which every local user can read). An empty token still seals frames, but with a
key anyone can derive: nodes started that way log that they are unauthenticated.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets

from kvmesh.errors import KvmeshError

TOKEN_ENV = "KVMESH_CLUSTER_TOKEN"
MAC_BYTES = 16
REFUSED = b"KVMESH-AUTH-REFUSED"  # unsealed answer to a frame that failed authentication


class AuthError(KvmeshError, PermissionError):
    """A frame without a valid MAC for this cluster's token."""


def generate_token() -> str:
    """A fresh random cluster token (256 bits, hex)."""
    return secrets.token_hex(32)


def token_from_env(explicit: str | None = None) -> str:
    """``explicit`` when given, else ``$KVMESH_CLUSTER_TOKEN``, else "" (unauthenticated)."""
    return explicit if explicit is not None else os.environ.get(TOKEN_ENV, "")


class ClusterAuth:
    """Seals and opens frames with the cluster key; safe to share between threads."""

    def __init__(self, token: str = ""):
        self.enabled = bool(token)
        self._key = hashlib.blake2b(token.encode(), digest_size=32, person=b"kvmesh-auth-v1").digest()
        self.num_refused = 0  # frames that failed ``open`` (counted by whoever calls it)

    def mac(self, payload: bytes | memoryview) -> bytes:
        return hashlib.blake2b(payload, key=self._key, digest_size=MAC_BYTES).digest()

    def seal(self, payload: bytes) -> bytes:
        return self.mac(payload) + payload

    def open(self, frame: bytes) -> bytes:
        """The payload of a sealed frame; raises AuthError (and counts it) if the MAC is wrong."""
        if len(frame) < MAC_BYTES or not hmac.compare_digest(frame[:MAC_BYTES], self.mac(frame[MAC_BYTES:])):
            self.num_refused += 1
            raise AuthError("frame refused: missing or wrong cluster token")
        return frame[MAC_BYTES:]

    def open_reply(self, frame: bytes, peer: str) -> bytes:
        """Client side: a reply's payload; a REFUSED marker becomes an AuthError naming the peer."""
        if frame == REFUSED:
            raise AuthError(f"{peer} refused our request: the cluster token differs (--cluster-token / "
                            f"${TOKEN_ENV})")
        try:
            return self.open(frame)
        except AuthError:
            raise AuthError(f"a reply from {peer} failed authentication (cluster token mismatch)") from None
