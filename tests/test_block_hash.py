"""The chained block hash of docs/design.md §4: exact definition, fast path, stability across processes."""
from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest

from kvmesh.kv.block_hash import HashNamespace, hash_block, hash_blocks, root_hash


def test_definition_by_hand():
    ns = b"fp|16|float32|0/1|"
    root = hashlib.blake2b(ns, digest_size=16, person=b"kvmesh-ns-v1").digest()
    assert root_hash(ns) == root
    tokens = [1, 2, 70000, 4]
    payload = root + b"".join(t.to_bytes(4, "little") for t in tokens)
    assert hash_block(root, tokens) == hashlib.blake2b(payload, digest_size=16, person=b"kvmesh-kv-v1").digest()
    assert hash_block(root, tokens, b"lora-7") != hash_block(root, tokens)


def test_fast_path_equals_pure_chain_and_extends():
    root = root_hash(b"x")
    tokens = list(range(1000, 1000 + 16 * 9 + 5))  # 9 full blocks and a partial one
    chain, prev = [], root
    for i in range(9):
        prev = hash_block(prev, tokens[i * 16 : (i + 1) * 16])
        chain.append(prev)
    assert hash_blocks(root, tokens, 16) == chain
    assert hash_blocks(chain[3], tokens, 16, start_block=4) == chain[4:]
    assert hash_blocks(root, tokens[:15], 16) == []
    extras = [None, b"img"] + [None] * 7
    with_extra = hash_blocks(root, tokens, 16, extras=extras)
    assert with_extra[0] == chain[0] and with_extra[1] != chain[1] and with_extra[2] != chain[2]


def test_namespace_separates_models_dtypes_and_tenants():
    base = HashNamespace.for_model("abc", 16, "float32")
    others = [HashNamespace.for_model("abd", 16, "float32"), HashNamespace.for_model("abc", 32, "float32"),
              HashNamespace.for_model("abc", 16, "bfloat16"), HashNamespace.for_model("abc", 16, "float32", "t2"),
              HashNamespace.for_model("abc", 16, "float32", tp_rank=1, tp_size=2)]
    roots = {ns.root() for ns in others}
    assert base.root() not in roots and len(roots) == len(others)
    assert base.encode() == b"abc|16|float32|0/1|"


def test_same_digest_in_a_fresh_process():
    code = ("from kvmesh.kv.block_hash import hash_blocks, root_hash;"
            "print(hash_blocks(root_hash(b'ns'), list(range(64)), 16)[-1].hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}).stdout.strip()
    assert out == hash_blocks(root_hash(b"ns"), list(range(64)), 16)[-1].hex()


def test_prefix_hasher_equals_hash_blocks_and_stays_bounded():
    """Repeated, extended, shortened and edited prompts from two roots: the memo's hashes are exactly the
    plain chain's, it reuses what repeats, and it never holds more token bytes than its bound."""
    import random

    from kvmesh.kv.prefix_hasher import PrefixHasher

    rng = random.Random(5)
    roots = [root_hash(b"a"), root_hash(b"b")]
    base = [rng.randrange(50_000) for _ in range(3_000)]
    hasher = PrefixHasher(16, max_bytes=40_000)
    for trial in range(300):
        prompt = base[: rng.randrange(0, 3_000)]
        if prompt and rng.random() < 0.5:  # one token changed somewhere: the chains part there
            prompt[rng.randrange(len(prompt))] = rng.randrange(50_000)
        if rng.random() < 0.3:
            prompt += [rng.randrange(50_000) for _ in range(rng.randrange(100))]
        root = roots[rng.random() < 0.2]
        got = hasher.hash(root, prompt)
        assert got == hash_blocks(root, prompt, 16), trial
        got.append(b"caller's list")  # the caller owns what it gets: the memo is not touched
        assert hasher.num_bytes <= 40_000
    assert hasher.num_blocks_reused > 0 and hasher.num_blocks_hashed > 0
    reused = hasher.num_blocks_reused
    assert hasher.hash(roots[0], base[:1_600]) == hasher.hash(roots[0], base[:1_600]) == \
        hash_blocks(roots[0], base[:1_600], 16)
    assert hasher.num_blocks_reused - reused >= 100  # the second time, all 100 blocks came from the memo


def test_native_chain_equals_hashlib_and_falls_back_to_it(monkeypatch):
    """The one-call C BLAKE2b chain (kernels/extensions/blake2b_chain.c) gives hashlib's digests for every message
    length around BLAKE2b's 128-byte block and from any start block; its token conversion equals array's;
    without the extension, hash_blocks takes hashlib."""
    import array
    import random

    from kvmesh.kernels.extensions import loader
    from kvmesh.kv import block_hash

    ext = loader.load("blake2b_chain")
    assert ext is not None  # this machine has a compiler and Python's headers (tests/test_layers.py builds too)
    rng = random.Random(7)
    for step in (4, 64, 96, 112, 113, 128, 200, 256):
        data = bytes(rng.randrange(256) for _ in range(step * 9 + step // 2))  # and a partial block, ignored
        parent = bytes(rng.randrange(256) for _ in range(16))
        want = block_hash._hash_block_bytes_hashlib(parent, data, step)
        assert len(want) == 9
        assert ext.chain(parent, data, step, b"kvmesh-kv-v1") == want, step
        assert block_hash.hash_block_bytes(want[2], data, step, start_block=3) == want[3:], step
        assert ext.chain(parent, data, step, b"kvmesh-kv-v1", 9) == []
    tokens = [rng.randrange(2**32) for _ in range(16 * 40)] + [0, 2**32 - 1]
    assert ext.tokens_bytes(tokens, 5, len(tokens)) == array.array("I", tokens[5:]).tobytes()
    assert ext.tokens_bytes(tuple(tokens), 0, 3) == array.array("I", tokens[:3]).tobytes()
    for bad in (-1, 2**32):
        with pytest.raises(OverflowError):
            block_hash.tokens_to_bytes([1, bad])
    with pytest.raises(IndexError):
        ext.tokens_bytes(tokens, 0, len(tokens) + 1)
    with pytest.raises(ValueError):
        ext.chain(b"short", b"x" * 64, 64, b"kvmesh-kv-v1")
    native = hash_blocks(root_hash(b"ns"), tokens, 16)
    monkeypatch.setattr(loader, "load", lambda name: None)
    assert hash_blocks(root_hash(b"ns"), tokens, 16) == native
    assert block_hash.tokens_to_bytes(tokens, 5) == array.array("I", tokens[5:]).tobytes()
