"""KeyMap (metadata/key_map.py), the global index mirror's compact map, against a dict: random puts, deletes and
reads through the bulk and the scalar paths, across rebuilds, with keys 0 and 1. (Holder sets and lookups over
KeyMaps: tests/test_holdings.py.)"""
from __future__ import annotations

import random

import numpy as np
import pytest

from kvmesh.metadata.key_map import KeyMap


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
