"""The chained block hash of docs/design.md §4: exact definition, fast path, stability across processes."""
from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest

from kvmesh.cpu_info import cpu_flags
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


def test_namespace_separates_models_dtypes_and_tenants_never_tp_sizes():
    base = HashNamespace.for_model("abc", 16, "float32")
    others = [HashNamespace.for_model("abd", 16, "float32"), HashNamespace.for_model("abc", 32, "float32"),
              HashNamespace.for_model("abc", 16, "bfloat16"), HashNamespace.for_model("abc", 16, "float32", "t2")]
    roots = {ns.root() for ns in others}
    assert base.root() not in roots and len(roots) == len(others)
    assert base.encode() == b"abc|16|float32|"  # nothing of the tensor-parallel layout: one pool for every TP size


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
    length around BLAKE2b's 128-byte block and from any start block, through the AVX-512 chain (16-token blocks,
    where the build has it) and the portable compression alike; its token conversion equals array's; without the
    extension, hash_blocks takes hashlib."""
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
        assert ext.chain(parent, data, step, b"kvmesh-kv-v1", 0, True) == want, step
        assert ext.chain(want[1], data, step, b"kvmesh-kv-v1", 2, True) == want[2:], step
        assert block_hash.hash_block_bytes(want[2], data, step, start_block=3) == want[3:], step
        assert ext.chain(parent, data, step, b"kvmesh-kv-v1", 9) == []
    if "avx512f" in cpu_flags() and "avx512vl" in cpu_flags():
        assert ext.VECTOR == 1  # built with -march=native: the 16-token chain above ran in AVX-512
    long = bytes(rng.randrange(256) for _ in range(64 * 300))  # a long chain: each digest feeds the next
    want, prev = [], b"\x01" * 16
    for offset in range(0, len(long), 64):
        prev = hashlib.blake2b(prev + long[offset : offset + 64], digest_size=16, person=b"p").digest()
        want.append(prev)
    assert ext.chain(b"\x01" * 16, long, 64, b"p") == ext.chain(b"\x01" * 16, long, 64, b"p", 0, True) == want
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


def test_chain_tokens_reads_and_hashes_in_one_pass_as_the_two_steps_do():
    """chain_tokens (the conversion read while the chain compresses, for 16-token blocks) gives the token bytes
    and hashlib's chain for any block size, start block and length; a bad token anywhere raises, naming it."""
    import random

    from kvmesh.kernels.extensions import loader
    from kvmesh.kv import block_hash

    ext = loader.load("blake2b_chain")
    rng = random.Random(11)
    parent = root_hash(b"ns")
    tokens = [rng.randrange(2**32) for _ in range(16 * 70 + 5)]
    for block_size in (1, 8, 15, 16, 32):
        for start_block in (0, 1, 3):
            for length in (0, block_size - 1, block_size, 16 * 70 + 5):
                prompt = tokens[:length]
                num_full = length // block_size
                want_data = block_hash.tokens_to_bytes(prompt, 0, num_full * block_size)
                want = block_hash._hash_block_bytes_hashlib(parent, want_data, 4 * block_size)
                data, hashes = ext.chain_tokens(want[start_block - 1] if 0 < start_block <= len(want) else parent,
                                                tuple(prompt) if length % 2 else prompt, block_size,
                                                b"kvmesh-kv-v1", start_block)
                if start_block > num_full:
                    assert (data, hashes) == (b"", []), (block_size, start_block, length)
                    continue
                assert data == want_data[4 * block_size * start_block:], (block_size, start_block, length)
                assert hashes == want[start_block:], (block_size, start_block, length)
    assert block_hash.hash_tokens(parent, tokens, 16) == ext.chain_tokens(parent, tokens, 16, b"kvmesh-kv-v1")
    for bad_at in (0, 15, 16, 17, 16 * 33 + 4, 16 * 70 - 1):
        for bad in (-1, 2**32, "7", None):
            prompt = list(tokens)
            prompt[bad_at] = bad
            with pytest.raises((OverflowError, TypeError)) as err:
                ext.chain_tokens(parent, prompt, 16, b"kvmesh-kv-v1")
            if isinstance(bad, int):
                assert f"token {bad_at} " in str(err.value)
    with pytest.raises(ValueError):
        ext.chain_tokens(parent, tokens, 0, b"kvmesh-kv-v1")
    with pytest.raises(ValueError):
        ext.chain_tokens(b"short", tokens, 16, b"kvmesh-kv-v1")
    with pytest.raises(TypeError):
        ext.chain_tokens(parent, 12, 16, b"kvmesh-kv-v1")
