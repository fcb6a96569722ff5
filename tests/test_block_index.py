"""BlockIndex: the native table and records, and the dict fallback, against a plain model, op by op."""
from __future__ import annotations

import random

import pytest

from kvmesh.kernels.extensions import loader
from kvmesh.kv.block_index import ADDED, NO_BLOCK, NOT_HELD, DictBlockIndex, NativeBlockIndex, Removed, make_block_index

KINDS = ["native", "dict"]


def make(kind: str, num_blocks: int):
    if kind == "native":
        ext = loader.load("block_index")
        assert ext is not None, "this machine has a C compiler and Python's headers: the extension must build"
        return NativeBlockIndex(num_blocks, ext)
    return DictBlockIndex(num_blocks)


class Model:
    """What the index must hold: hash -> block, each block's parent, child counts."""

    def __init__(self, num_blocks: int):
        self.blocks: dict[bytes, int] = {}
        self.parents = [NO_BLOCK] * num_blocks
        self.children = [0] * num_blocks

    def hash_of(self, block: int) -> bytes | None:
        return next((h for h, b in self.blocks.items() if b == block), None)

    def check(self, index, num_blocks: int) -> None:
        index.check_integrity()
        assert len(index) == len(self.blocks)
        assert dict(index.items()) == self.blocks
        for h, b in self.blocks.items():
            assert index.get(h) == b and index.hash_of(b) == h
        for b in range(num_blocks):
            held = self.hash_of(b) is not None
            assert (index.slot_of_block[b] >= 0) == held
            assert index.parents[b] == (self.parents[b] if held else NO_BLOCK)
            assert index.num_children[b] == self.children[b]


def colliding_digests(rng: random.Random, n: int, home: int, mask: int) -> list[bytes]:
    """Digests that all start probing at slot ``home`` (their first 8 bytes masked), to pile up a cluster."""
    return [((rng.getrandbits(64) & ~mask) | home).to_bytes(8, "little") + rng.randbytes(8) for _ in range(n)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", range(3))
def test_random_runs_and_removals_match_a_model(kind, seed):
    """Chained runs recorded all-or-none (consecutive and scattered ids; hashes clustered around the table's
    end, so the backward shift moves entries across it), refusals that change nothing (a hash held, a block
    holding one), leaves removed, lookups of present and absent hashes, held counts and chain walks."""
    rng = random.Random(seed)
    num_blocks = 64
    index, model = make(kind, num_blocks), Model(num_blocks)
    mask = 2 * num_blocks - 1  # the native table for 64 blocks has 128 slots
    for step in range(500):
        free_ids = [b for b in range(num_blocks) if model.hash_of(b) is None]
        if free_ids and rng.random() < 0.55:
            n = rng.randrange(1, min(8, len(free_ids)) + 1)
            ids = rng.sample(free_ids, n)
            if rng.random() < 0.5:
                ids.sort()
            if rng.random() < 0.5:
                hashes = colliding_digests(rng, n, rng.choice([mask, mask - 1, 0]), mask)
            else:
                hashes = [rng.randbytes(16) for _ in range(n)]
            parent = rng.choice([NO_BLOCK, *model.blocks.values()])
            clash = rng.random()
            if clash < 0.1 and model.blocks:  # a hash already held
                hashes[rng.randrange(n)] = rng.choice(list(model.blocks))
            elif clash < 0.2 and model.blocks:  # a block already holding a hash
                ids[rng.randrange(n)] = rng.choice(list(model.blocks.values()))
            consecutive = ids == list(range(ids[0], ids[0] + n))
            result = index.add_run(hashes, ids, consecutive, parent)
            held_block = next((i for i, b in enumerate(ids) if model.hash_of(b) is not None), None)
            held_hash = next((i for i, h in enumerate(hashes) if h in model.blocks), None)
            if held_block is not None:
                assert result == -2 - held_block
            elif held_hash is not None:
                assert result == held_hash
            else:
                assert result == ADDED
                for h, b in zip(hashes, ids):
                    model.blocks[h] = b
                    model.parents[b] = parent
                    if parent != NO_BLOCK:
                        model.children[parent] += 1
                    parent = b
        elif model.blocks:
            leaves = [b for b in model.blocks.values() if model.children[b] == 0]
            b = rng.choice(leaves)
            h, parent = model.hash_of(b), model.parents[b]
            if rng.random() < 0.5:
                assert index.remove_block(b) == Removed(h, parent)
                del model.blocks[h]
                if parent != NO_BLOCK:
                    model.children[parent] -= 1
            else:  # in one call: the leaf, a block holding nothing, and the parent once it is a leaf too
                victims = [b] + [x for x in range(num_blocks) if model.hash_of(x) is None][:1]
                if parent != NO_BLOCK and model.children[parent] == 1:
                    victims.append(parent)
                want = [(model.hash_of(v), model.parents[v]) for v in victims]
                want_parent_hashes = [model.hash_of(p) if h and p != NO_BLOCK else None for h, p in want]
                removed = index.remove_blocks(victims)
                assert removed.num_removed == sum(h is not None for h, _ in want)
                for i, (h, p) in enumerate(want):
                    assert removed.parents[i] == (NOT_HELD if h is None else p)
                    if h is not None:
                        assert removed.hashes[16 * i : 16 * i + 16] == h
                    if want_parent_hashes[i] is not None:
                        assert removed.parent_hashes[16 * i : 16 * i + 16] == want_parent_hashes[i]
                for h, p in want:
                    if h is not None:
                        del model.blocks[h]
                        if p != NO_BLOCK:
                            model.children[p] -= 1
        assert index.get(rng.randbytes(16)) is None
        if model.blocks:  # a chain from some block up to its root, and the blocks still holding it
            chain = [rng.choice(list(model.blocks.values()))]
            while model.parents[chain[0]] != NO_BLOCK:
                chain.insert(0, model.parents[chain[0]])
            assert index.chain(chain[-1], len(chain)) == chain
            hashes = [model.hash_of(b) for b in chain]
            cut = rng.randrange(len(chain) + 1)
            assert index.count_held(chain, hashes[:cut] + [rng.randbytes(16)] * (len(chain) - cut)) == cut
        if step % 20 == 0:
            model.check(index, num_blocks)
    model.check(index, num_blocks)


@pytest.mark.parametrize("kind", KINDS)
def test_a_hash_or_a_block_twice_in_one_run_changes_nothing(kind):
    index = make(kind, 16)
    assert index.add_run([b"a" * 16], [0], True, NO_BLOCK) == ADDED
    assert index.add_run([b"b" * 16, b"c" * 16, b"b" * 16], [1, 2, 3], True, 0) == 2
    assert index.add_run([b"d" * 16, b"e" * 16, b"f" * 16], [4, 5, 4], False, 0) == -2 - 2
    model = Model(16)
    model.blocks[b"a" * 16] = 0
    model.check(index, 16)
    assert index.remove_block(7) is None


@pytest.mark.parametrize("kind", KINDS)
def test_ids_outside_the_pool_are_refused_and_change_nothing(kind):
    index = make(kind, 8)
    for ids, consecutive, parent in (([3, 8], False, NO_BLOCK), ([7, 8], True, NO_BLOCK), ([2], True, 8)):
        with pytest.raises(IndexError):
            index.add_run([b"a" * 16, b"b" * 16][: len(ids)], ids, consecutive, parent)
    for call in (index.hash_of, index.remove_block, lambda b: index.remove_blocks([b])):
        with pytest.raises(IndexError):
            call(8)
    Model(8).check(index, 8)


@pytest.mark.parametrize("kind", KINDS)
def test_chain_walks_the_parent_links(kind):
    index = make(kind, 16)
    assert index.add_run([bytes([i]) * 16 for i in range(3)], [3, 4, 5], True, NO_BLOCK) == ADDED
    assert index.add_run([bytes([i]) * 16 for i in range(3, 5)], [9, 2], False, 5) == ADDED
    assert index.chain(5, 3) == [3, 4, 5]  # consecutive ids: one slice
    assert index.chain(2, 5) == [3, 4, 5, 9, 2]
    assert index.chain(2, 2) == [9, 2]
    with pytest.raises(ValueError, match="shorter"):
        index.chain(2, 6)


def test_make_block_index_picks_and_falls_back(monkeypatch):
    monkeypatch.delenv("KVMESH_BLOCK_INDEX", raising=False)
    assert isinstance(make_block_index(4), NativeBlockIndex)
    monkeypatch.setenv("KVMESH_BLOCK_INDEX", "dict")
    assert isinstance(make_block_index(4), DictBlockIndex)
    monkeypatch.setenv("KVMESH_BLOCK_INDEX", "radix")
    with pytest.raises(ValueError, match="expected auto, native or dict"):
        make_block_index(4)
    monkeypatch.setattr(loader, "load", lambda name: None)  # no compiler, or the build failed
    monkeypatch.setenv("KVMESH_BLOCK_INDEX", "auto")
    assert isinstance(make_block_index(4), DictBlockIndex)
    monkeypatch.setenv("KVMESH_BLOCK_INDEX", "native")
    with pytest.raises(RuntimeError, match="did not build"):
        make_block_index(4)


def test_the_extension_refuses_malformed_arguments_and_changes_nothing():
    """What the C reads from Python objects is checked there: a hash that is no 16-byte bytes object, ids that
    are no ints; a lookup of anything but 16 bytes finds nothing; a chain's ids are the pool's own objects."""
    index = make("native", 8)
    for hashes, ids in (([b"a" * 16, b"b" * 15], [1, 2]), ([b"a" * 16, "b" * 16], [1, 2]),
                        ([b"a" * 16, b"b" * 16], [1, "2"])):
        with pytest.raises((ValueError, TypeError)):
            index.add_run(hashes, ids, False, NO_BLOCK)
        Model(8).check(index, 8)
    with pytest.raises(TypeError):
        index.remove_blocks([1, None])
    assert index.get(b"short") is None and index.get("a" * 16) is None
    assert index.add_run([b"a" * 16, b"b" * 16], [6, 3], False, NO_BLOCK) == ADDED
    assert index.count_held([6, 3], [b"a" * 16, b"x"]) == 1
    assert all(a is b for a, b in zip(index.chain(3, 2), (index.block_ids[6], index.block_ids[3])))
