"""The CPU's feature flags, read once from /proc/cpuinfo (no torch: a router reads configs too)."""
from __future__ import annotations

import functools


@functools.cache
def cpu_flags() -> tuple[str, ...]:
    """Every flag of the CPU (/proc/cpuinfo, read once; empty where it is not readable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return tuple(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return ()


def cpu_features() -> list[str]:
    """The CPU flags kvmesh decides on (``--dtype auto``, packed linears, the bf16 prefill attention)."""
    return sorted(set(cpu_flags()) & {"amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2"})
