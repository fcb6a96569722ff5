"""ApiKeys: the bearer tokens the front ends accept, compared in constant time, each naming a client.

Keys come from ``--api-key-file`` (one key per line: one per tenant), else
``$KVMESH_API_KEY``, else the hidden ``--api-key`` flag (visible in argv: warned).
With keys, every route but ``/health`` and ``/ready`` (HTTP) and health and reflection
(gRPC) requires ``Authorization: Bearer <key>``. ``client_of`` names the caller for
the router's per-client concurrency limit: a short digest of its key, else its address.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import sys

from kvmesh.errors import KvmeshError

API_KEY_ENV = "KVMESH_API_KEY"


class ApiKeys:
    def __init__(self, keys: list[str] | tuple[str, ...] = ()):
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys if k]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def match(self, authorization: str | None) -> str | None:
        """The client id of a valid ``Bearer <key>`` header, else None; time independent of which key or how
        much of it matched."""
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():  # auth schemes are case-insensitive (RFC 9110)
            return None
        offered = hashlib.sha256(key.strip().encode()).digest()
        found = None
        for digest in self._digests:  # every key is compared, whichever matches
            if hmac.compare_digest(offered, digest):
                found = digest
        return None if found is None else "key-" + found.hex()[:12]


def api_keys_from_args(args) -> ApiKeys:
    """``--api-key-file`` (one key per line), else ``$KVMESH_API_KEY``, else ``--api-key`` (warned)."""
    path = getattr(args, "api_key_file", None)
    if path:
        try:
            with open(path) as f:
                keys = [line.strip() for line in f if line.strip() and not line.startswith("#")]
        except OSError as e:
            raise KvmeshError(f"cannot read --api-key-file {path}: {e.strerror}") from None
        if not keys:
            raise KvmeshError(f"--api-key-file {path} holds no key")
        return ApiKeys(keys)
    if os.environ.get(API_KEY_ENV):
        return ApiKeys([os.environ[API_KEY_ENV]])
    if getattr(args, "api_key", None):
        print(f"kvmesh: --api-key is visible to every local user in the process list; prefer --api-key-file or "
              f"${API_KEY_ENV}", file=sys.stderr)
        return ApiKeys([args.api_key])
    return ApiKeys()
