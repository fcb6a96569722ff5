"""Chained block hash, v1 (docs/design.md §4): every node and the router must agree on it.

    root  = blake2b(namespace,                 digest_size=16, person=b"kvmesh-ns-v1")
    h[i]  = blake2b(h[i-1] || tokens[i*B:(i+1)*B] as little-endian uint32 [|| extra[i]],
                    digest_size=16, person=b"kvmesh-kv-v1")

Only full blocks are hashed. The digest depends on nothing but its inputs: no
Python ``hash()``, no pickling, no seed, so it is the same in every process and
on every machine.
"""
from __future__ import annotations

import array
import hashlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.kernels.extensions import loader as extensions

BlockHash = bytes  # 16 bytes

_NS_PERSON = b"kvmesh-ns-v1"
_KV_PERSON = b"kvmesh-kv-v1"
_BLOCK_HASHER = hashlib.blake2b(digest_size=16, person=_KV_PERSON)


@dataclass(frozen=True)
class HashNamespace:
    """What must match for two nodes to share KV: model, block size, KV dtype, tenant. Never the tensor-parallel
    size: a block is the same KV whichever ranks hold its heads, so nodes of every TP size share one pool."""

    model_fingerprint: str
    block_size: int
    kv_dtype: str
    cache_salt: str = ""

    def encode(self) -> bytes:
        return f"{self.model_fingerprint}|{self.block_size}|{self.kv_dtype}|{self.cache_salt}".encode()

    def root(self) -> BlockHash:
        return root_hash(self.encode())

    @classmethod
    def for_model(cls, fingerprint: str, block_size: int, kv_dtype: str, cache_salt: str = "") -> HashNamespace:
        """``kv_dtype``: the KV buffer's dtype name ("bfloat16", "float32")."""
        return cls(fingerprint, block_size, kv_dtype, cache_salt)


def root_hash(namespace: bytes) -> BlockHash:
    return hashlib.blake2b(namespace, digest_size=16, person=_NS_PERSON).digest()


def salted_root(root: BlockHash, cache_salt: str | None) -> BlockHash:
    """The chain root of requests carrying ``cache_salt`` (``root`` itself without one): their blocks share
    hashes, hits and ``cached_tokens`` only with requests of the same salt."""
    if not cache_salt:
        return root
    return hashlib.blake2b(root + cache_salt.encode(), digest_size=16, person=b"kvmesh-salt-v1").digest()


def tokens_to_bytes(token_ids: Sequence[int], start: int = 0, stop: int | None = None) -> bytes:
    """Little-endian uint32 bytes of ``token_ids[start:stop]``, converted once in bulk (in C, reading a
    list in place, where the native hash loads; OverflowError for a token outside [0, 2**32))."""
    stop = len(token_ids) if stop is None else stop
    native = extensions.load("blake2b_chain")
    if native is not None:
        return native.tokens_bytes(token_ids, start, stop)
    arr = array.array("I", token_ids[start:stop])
    if arr.itemsize != 4:  # pragma: no cover - "I" is 4 bytes on every platform we run on
        arr = array.array("L", token_ids[start:stop])
    if sys.byteorder != "little":  # pragma: no cover
        arr.byteswap()
    return arr.tobytes()


def hash_block(parent: BlockHash, block_token_ids: Sequence[int], extra: bytes | None = None) -> BlockHash:
    """The pure, one-block form of the chain (the reference the fast path is tested against)."""
    h = hashlib.blake2b(digest_size=16, person=_KV_PERSON)
    h.update(parent)
    h.update(b"".join(int(t).to_bytes(4, "little") for t in block_token_ids))
    if extra:
        h.update(extra)
    return h.digest()


def hash_blocks(parent: BlockHash, token_ids: Sequence[int], block_size: int, start_block: int = 0,
                extras: Sequence[bytes | None] | None = None) -> list[BlockHash]:
    """Fast path: the hashes of every full block of ``token_ids`` from block ``start_block`` on.

    ``parent`` is the hash of block ``start_block - 1`` (the namespace root for 0), so a
    sequence that grows can extend its chain without rehashing. ``extras[i]`` (optional)
    is appended to block ``start_block + i``.
    """
    if extras is None:
        return hash_tokens(parent, token_ids, block_size, start_block)[1]
    num_full = len(token_ids) // block_size
    if num_full <= start_block:
        return []
    data = tokens_to_bytes(token_ids, start_block * block_size, num_full * block_size)
    step = 4 * block_size
    out: list[BlockHash] = []
    prev = parent
    for extra, offset in zip(extras, range(0, len(data), step)):
        h = _BLOCK_HASHER.copy()
        h.update(prev)
        h.update(data[offset : offset + step])
        if extra:
            h.update(extra)
        prev = h.digest()
        out.append(prev)
    return out


def hash_tokens(parent: BlockHash, token_ids: Sequence[int], block_size: int, start_block: int = 0
                ) -> tuple[bytes, list[BlockHash]]:
    """``tokens_to_bytes`` of every full block from block ``start_block`` on, and their chain from ``parent``.

    In one native pass where the extension loads: a list or tuple is read in place and, for 16-token blocks
    built with AVX-512, each block's tokens are read while the previous block is compressed (holding the
    GIL for the whole chain: the pass reads the list); else the conversion, then ``hash_block_bytes``.
    """
    native = extensions.load("blake2b_chain")
    if native is not None:
        return native.chain_tokens(parent, token_ids, block_size, _KV_PERSON, start_block)
    num_full = len(token_ids) // block_size
    if num_full <= start_block:
        return b"", []
    data = tokens_to_bytes(token_ids, start_block * block_size, num_full * block_size)
    return data, _hash_block_bytes_hashlib(parent, data, 4 * block_size)


def hash_block_bytes(parent: BlockHash, data: bytes, step: int, start_block: int = 0) -> list[BlockHash]:
    """The chain over whole blocks of token bytes (``step`` bytes each) from block ``start_block`` of ``data``.

    In one native call where the extension loads (``kernels/extensions/blake2b_chain.c``, checked against
    hashlib in the tests; nodes and routers alike), else through hashlib: the same digests either way.
    """
    native = extensions.load("blake2b_chain")
    if native is not None:
        return native.chain(parent, data, step, _KV_PERSON, start_block)
    return _hash_block_bytes_hashlib(parent, data, step, start_block)


def _hash_block_bytes_hashlib(parent: BlockHash, data: bytes, step: int, start_block: int = 0) -> list[BlockHash]:
    out: list[BlockHash] = []
    append, copy = out.append, _BLOCK_HASHER.copy
    prev = parent
    for offset in range(start_block * step, len(data) - step + 1, step):
        h = copy()
        h.update(prev)
        h.update(data[offset : offset + step])
        prev = h.digest()
        append(prev)
    return out
