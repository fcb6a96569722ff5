"""kvmesh/gc_pauses.py: start-up objects frozen, collections counted per generation while installed."""
from __future__ import annotations

import gc

from kvmesh.gc_pauses import GCPauses, freeze_start_up


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
