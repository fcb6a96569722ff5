"""The BLAKE2b block-hash chain in C (``blake2b_chain.c``, a CPython extension), compiled on first use.

``load()`` returns the extension module, built once per machine and interpreter into
``$KVMESH_CACHE_DIR/native`` (``kvmesh/native_build.py``), or None where it cannot be had (no compiler,
no Python headers, ``KVMESH_NATIVE_HASH=0``), the reason logged once; ``kv/block_hash.py`` then
hashes through hashlib, with the same digests. It needs no torch, so routers hash natively too.
"""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from types import ModuleType

from kvmesh.native_build import NativeBuildError, load_extension

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("blake2b_chain.c")
MODULE = "kvmesh_blake2b_chain"
# -mtune=generic: GCC 12 tunes a Zen 4 as a Zen 3, which made this chain ~2.8x slower.
FLAGS = ("-O3", "-march=native", "-mtune=generic", "-fno-strict-aliasing")
DISABLE_ENV = "KVMESH_NATIVE_HASH"


@functools.cache
def load() -> ModuleType | None:
    """The extension module, or None (see the module docstring)."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    try:
        return load_extension(SOURCE, MODULE, FLAGS)
    except NativeBuildError as exc:
        log.log(logging.INFO if exc.missing_tools else logging.WARNING,
                "native block hash off (hashlib computes the same digests): %s", exc)
        return None
