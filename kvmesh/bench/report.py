"""Shared output of every benchmark: a JSON file and a Markdown-style table on stdout."""
from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``: the nearest rank, 0.0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def time_call(fn: Callable[[], object], repeat: int = 7, number: int = 1,
              setup: Callable[[], object] | None = None) -> float:
    """Median seconds per call of ``fn`` over ``repeat`` rounds of ``number`` calls (``setup`` untimed)."""
    if setup is not None:
        setup()
    fn()  # warm-up: first-call costs are not what we measure
    samples = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        start = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - start) / number)
    return statistics.median(samples)


def machine() -> dict[str, str]:
    return {"python": platform.python_version(), "machine": platform.machine(), "system": platform.system()}


def print_table(title: str, header: list[str], rows: list[list[object]]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    print(f"\n{title}")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(str(x).ljust(w) for x, w in zip(row, widths)) + " |")


def write_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(payload, indent=2))
        print(f"\nwrote {path}")
