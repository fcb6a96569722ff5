"""The CPython extensions beside this file, compiled on first use: ``load(name)``.

Each is built once per machine, interpreter and source into ``$KVMESH_CACHE_DIR/native``
(``kvmesh/native_build.py``) with the system C compiler and this interpreter's headers. Where that
cannot be had (no compiler, no headers, a failed build) ``load`` returns None, the reason logged
once, and the caller keeps its Python path, which gives the same answers: hashlib for the block hash
(``kv/block_hash.py``), a dict for the pool's index (``kv/block_index.py``).
"""
from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

from kvmesh.native_build import load_extension_or_none

# -mtune=generic: GCC 12 tunes a Zen 4 as a Zen 3, which made the BLAKE2b chain ~2.8x slower.
FLAGS = ("-O3", "-march=native", "-mtune=generic", "-fno-strict-aliasing")
FALLBACKS = {"blake2b_chain": "hashlib computes the same digests", "block_index": "the block pool keeps a dict"}


@functools.cache
def load(name: str) -> ModuleType | None:
    """The extension built from ``<name>.c`` (one of ``FALLBACKS``), or None (see the module docstring)."""
    if name not in FALLBACKS:
        raise ValueError(f"no extension {name!r}: expected one of {sorted(FALLBACKS)}")
    return load_extension_or_none(Path(__file__).with_name(f"{name}.c"), f"kvmesh_{name}", FLAGS,
                                  f"native {name} off ({FALLBACKS[name]})")
