"""kvmesh/gc_pauses.py: start-up objects frozen, collections counted per generation while installed."""
from __future__ import annotations

import gc

from kvmesh.gc_pauses import GCPauses, freeze_start_up, num_frozen


def test_collections_are_counted_per_generation_while_installed():
    pauses = GCPauses().install()
    try:
        gc.collect(2)
        gc.collect(0)
        assert pauses.num_collections[2] >= 1 and pauses.num_collections[0] >= 1
        assert pauses.total_ms[2] >= pauses.max_ms[2] >= 0.0
    finally:
        pauses.uninstall()
    seen = list(pauses.num_collections)
    gc.collect(2)
    assert pauses.num_collections == seen  # uninstalled: nothing counted
    stats = pauses.stats()
    assert stats["gc_collections"] == seen and len(stats["gc_max_pause_ms"]) == 3


def test_freezing_moves_what_is_alive_out_of_the_collectors_walks():
    kept = [[i] for i in range(1000)]  # tracked objects alive now
    try:
        frozen = freeze_start_up()
        # Other threads (earlier tests' daemons) may free frozen objects meanwhile: the count only falls.
        assert frozen >= 1000 and 0 <= frozen - gc.get_freeze_count() < 1000
        assert not any(obj is kept for obj in gc.get_objects(2))  # frozen objects are in no generation
    finally:
        gc.unfreeze()


def test_stats_never_walk_the_frozen_objects(monkeypatch):
    """A node answers stats every second for the role balancer, on a thread that holds the GIL meanwhile: the
    frozen count comes from the freeze, never from ``gc.get_freeze_count`` (a walk of every frozen object)."""
    kept = [[i] for i in range(1000)]
    try:
        frozen = freeze_start_up()
        assert num_frozen() == frozen >= 1000

        def walk():
            raise AssertionError("gc.get_freeze_count walked the frozen objects")

        monkeypatch.setattr(gc, "get_freeze_count", walk)
        assert GCPauses().stats()["gc_frozen_objects"] == frozen
    finally:
        monkeypatch.undo()
        gc.unfreeze()
    assert kept
