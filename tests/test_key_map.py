"""KeyMap (metadata/key_map.py), the global index mirror's compact map, against a dict: random puts, deletes and
reads through the bulk and the scalar paths, across rebuilds, with keys 0 and 1 and repeats."""
from __future__ import annotations

import random

import numpy as np
import pytest

from kvmesh.metadata import holdings as hd
from kvmesh.metadata.key_map import KeyMap
from tests.metadata_node import chain
from tests.test_holdings import search  # noqa: F401 (the fixture: native and Python lookups)


def stored(key: int) -> int:
    return key + 2 if key < 2 else key  # 0 and 1 are EMPTY and TOMB: they share slots with 2 and 3


@pytest.mark.parametrize("seed", range(4))
def test_key_map_agrees_with_a_dict(seed):
    rng = random.Random(seed)
    pool = [0, 1, 2, 3, 2**64 - 1] + [rng.getrandbits(64) for _ in range(3000)]
    m, model = KeyMap(seed=seed), {}  # model: stored key -> value
    for step in range(200):
        by_stored = {stored(k): k for k in (rng.choice(pool) for _ in range(rng.randrange(1, 400)))}
        batch = list(by_stored.values())  # distinct once stored, as put_many asks
        if rng.random() < 0.6:
            values = [rng.randrange(1000) for _ in batch]
            assert m.put_many(batch, values).tolist() == [stored(k) not in model for k in batch]
            model.update(zip(map(stored, batch), values))
        else:
            assert m.delete_many(batch).tolist() == [stored(k) in model for k in batch]
            for k in batch:
                model.pop(stored(k), None)
        probe = rng.sample(pool, 50)
        want = [model.get(stored(k), -7) for k in probe]
        assert m.get_many(probe, -7).tolist() == want
        assert [m.get(k, -7) for k in probe] == want
        assert len(m) == len(model)
        m.check_integrity()
    keys, values = m.items()
    assert dict(zip(keys.tolist(), values.tolist())) == model


def test_key_map_grows_and_shrinks_keeping_every_key():
    m = KeyMap()
    keys = np.arange(10, 50_010, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15 % 2**63)
    m.put_many(keys, np.arange(len(keys)))
    assert m.nbytes >= 2 * 16 * len(keys) / 0.7 / 2
    m.delete_many(keys[: len(keys) - 100])
    assert m.nbytes < 16 * 1024, "the map did not shrink after most keys left"
    assert m.get_many(keys[-100:]).tolist() == list(range(len(keys) - 100, len(keys)))
    m.check_integrity()


def test_holder_sets_are_renumbered_as_nodes_come_and_go(monkeypatch, search):
    """Many nodes holding and dropping blocks intern many holder sets; the unused ones are dropped and lookups
    still agree with a model."""
    monkeypatch.setattr(hd, "_MIN_MAX_SETS", 8)  # renumber often
    table = hd.HoldingsTable()
    chains = [chain(f"sets-{i}", 12) for i in range(5)]
    rng = random.Random(3)
    model: dict[str, dict[int, int]] = {}
    for step in range(200):
        node, i, length = f"n{rng.randrange(12)}", rng.randrange(5), rng.randrange(13)
        had = model.setdefault(node, {}).get(i, 0)
        changes = [(hd.block_key(h), 1) for h in chains[i][had:length]] + \
                  [(hd.block_key(h), hd.GONE) for h in chains[i][length:had]]
        state = table.state(node)
        table.change(node, state.apply_log(step + 1, [k for k, _ in changes], bytes(c for _, c in changes)))
        model[node][i] = length
        if rng.random() < 0.1:
            table.remove(node)
            model.pop(node)
        table.check_integrity()
        for j in range(5):
            assert table.lookup(chains[j]) == {n: held[j] for n, held in model.items() if held.get(j)}
        assert len(table._sets) <= 4 * 4 * 12 + 12 * 2, "unused holder sets are not dropped"
