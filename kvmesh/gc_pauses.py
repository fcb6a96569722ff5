"""A serving process's garbage collector: start-up objects frozen, every collection's pause counted.

CPython's full (generation 2) collection walks every tracked object; a node or a router holds a few
hundred thousand of them after start-up (the model's modules and parameters, the pool's lists,
torch's, the tokenizer's and the RPC stacks' own), so one full collection stops the process, and
every stream it decodes or relays, for a tenth of a second or more on a small CPU. None of those
objects is ever garbage, so ``freeze_start_up`` moves them out of the collector's sight once start-up
is done (what ``gc.freeze`` is for), and later collections walk only what serving allocated since.
``GCPauses`` times every collection (a ``gc.callbacks`` hook: two clock reads each) for a node's stats.
How many objects were frozen is remembered at the freeze (``num_frozen``): ``gc.get_freeze_count`` walks
every frozen object under the GIL, tens of milliseconds a call in a node, far too long for a stats answer.
"""
from __future__ import annotations

import gc
import time


_num_frozen = 0  # objects frozen by ``freeze_start_up``, counted once at the freeze


def freeze_start_up() -> int:
    """Collect once, then freeze every object alive now (never scanned again); returns how many were frozen.
    Call when start-up is done and before serving begins: what it allocates from then on stays collectable."""
    global _num_frozen
    gc.collect()
    gc.freeze()
    _num_frozen = gc.get_freeze_count()
    return _num_frozen


def num_frozen() -> int:
    """Objects ``freeze_start_up`` froze, as counted then (some may have been freed since); no walk."""
    return _num_frozen


class GCPauses:
    """Per generation: collections seen and their longest and total pause (milliseconds), since ``install``."""

    def __init__(self):
        self.num_collections = [0, 0, 0]
        self.max_ms = [0.0, 0.0, 0.0]
        self.total_ms = [0.0, 0.0, 0.0]
        self._started = 0.0

    def install(self) -> GCPauses:
        gc.callbacks.append(self._on_collection)
        return self

    def uninstall(self) -> None:
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        generation = min(2, max(0, int(info.get("generation", 0))))
        pause_ms = (time.perf_counter() - self._started) * 1e3
        self.num_collections[generation] += 1
        self.total_ms[generation] += pause_ms
        self.max_ms[generation] = max(self.max_ms[generation], pause_ms)

    def stats(self) -> dict:
        """``{"gc_frozen_objects": n, "gc_collections": [g0, g1, g2], "gc_max_pause_ms": [...], "gc_total_pause_ms":
        [...]}``."""
        return {"gc_frozen_objects": num_frozen(), "gc_collections": list(self.num_collections),
                "gc_max_pause_ms": [round(v, 3) for v in self.max_ms],
                "gc_total_pause_ms": [round(v, 3) for v in self.total_ms]}
