"""BlockIndex: the native open-addressing table and the dict fallback against a plain dict, op by op."""
from __future__ import annotations

import random
from array import array

import pytest

from kvmesh.kernels.cpu import library
from kvmesh.kv.block_index import ADDED, DictBlockIndex, NativeBlockIndex, make_block_index
from kvmesh.kv.block_pool import NO_BLOCK

KINDS = ["native", "dict"]


def make(kind: str, num_blocks: int):
    ids, parents = list(range(num_blocks)), array("i", [NO_BLOCK]) * num_blocks
    if kind == "native":
        lib = library.load_holding_gil()
        assert lib is not None, "this machine has a C compiler: the native library must build"
        return NativeBlockIndex(ids, parents, lib), parents
    return DictBlockIndex(parents), parents


def colliding_digests(rng: random.Random, n: int, home: int, mask: int) -> list[bytes]:
    """Digests that all start probing at slot ``home`` (their first 8 bytes masked), to pile up a cluster."""
    out = []
    for _ in range(n):
        low = (rng.getrandbits(64) & ~mask) | home
        out.append(low.to_bytes(8, "little") + rng.randbytes(8))
    return out


def check_against(index, want: dict[bytes, int]) -> None:
    assert len(index) == len(want)
    assert dict(index.items()) == want
    for h, b in want.items():
        assert index.get(h) == b


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", range(3))
def test_random_runs_and_removals_match_a_dict(kind, seed):
    """Runs added all-or-none, removals anywhere (clusters that wrap around the table's end, so the
    backward shift must move entries across it), lookups of present and absent hashes."""
    rng = random.Random(seed)
    num_blocks = 64
    index, _ = make(kind, num_blocks)
    mask = 2 * num_blocks - 1  # the native table's size for 64 blocks: 128 slots
    want: dict[bytes, int] = {}
    free_ids = list(range(num_blocks))
    for step in range(600):
        if free_ids and rng.random() < 0.55:
            n = rng.randrange(1, min(8, len(free_ids)) + 1)
            ids = sorted(rng.sample(free_ids, n)) if rng.random() < 0.5 else rng.sample(free_ids, n)
            if rng.random() < 0.5:  # a cluster around the table's end
                hashes = colliding_digests(rng, n, rng.choice([mask, mask - 1, 0]), mask)
            else:
                hashes = [rng.randbytes(16) for _ in range(n)]
            clash = rng.random() < 0.2 and want
            if clash:  # one hash already held: nothing may change
                hashes[rng.randrange(n)] = rng.choice(list(want))
            consecutive = ids == list(range(ids[0], ids[0] + n))
            result = index.add_run(hashes, ids, consecutive)
            if clash:
                assert result == next(i for i, h in enumerate(hashes) if h in want)
            else:
                assert result == ADDED
                want.update(zip(hashes, ids))
                free_ids = [b for b in free_ids if b not in ids]
        elif want:
            h = rng.choice(list(want))
            index.remove(h)
            free_ids.append(want.pop(h))
        assert index.get(rng.randbytes(16)) is None
        if step % 25 == 0:
            check_against(index, want)
    check_against(index, want)


@pytest.mark.parametrize("kind", KINDS)
def test_a_hash_twice_in_one_run_adds_nothing(kind):
    index, _ = make(kind, 16)
    index.add_run([b"a" * 16], [0], True)
    hashes = [b"b" * 16, b"c" * 16, b"b" * 16]
    assert index.add_run(hashes, [1, 2, 3], True) == 2
    check_against(index, {b"a" * 16: 0})
    with pytest.raises(KeyError):
        index.remove(b"b" * 16)


@pytest.mark.parametrize("kind", KINDS)
def test_chain_walks_the_parent_links(kind):
    index, parents = make(kind, 16)
    for child, parent in ((3, NO_BLOCK), (4, 3), (5, 4), (9, 5), (2, 9)):
        parents[child] = parent
    assert index.chain(5, 3) == [3, 4, 5]  # consecutive ids: one slice
    assert index.chain(2, 5) == [3, 4, 5, 9, 2]
    assert index.chain(2, 2) == [9, 2]
    with pytest.raises(ValueError, match="shorter"):
        index.chain(2, 6)


def test_make_block_index_picks_and_falls_back(monkeypatch):
    monkeypatch.delenv("KVMESH_BLOCK_INDEX", raising=False)
    ids, parents = list(range(4)), array("i", [NO_BLOCK]) * 4
    assert isinstance(make_block_index(ids, parents), NativeBlockIndex)
    monkeypatch.setenv("KVMESH_BLOCK_INDEX", "dict")
    assert isinstance(make_block_index(ids, parents), DictBlockIndex)
    monkeypatch.setenv("KVMESH_BLOCK_INDEX", "radix")
    with pytest.raises(ValueError, match="expected auto, native or dict"):
        make_block_index(ids, parents)
    monkeypatch.setattr(library, "load_holding_gil", lambda: None)  # no compiler, or the build failed
    monkeypatch.setenv("KVMESH_BLOCK_INDEX", "auto")
    assert isinstance(make_block_index(ids, parents), DictBlockIndex)
    monkeypatch.setenv("KVMESH_BLOCK_INDEX", "native")
    with pytest.raises(RuntimeError, match="not loaded"):
        make_block_index(ids, parents)
