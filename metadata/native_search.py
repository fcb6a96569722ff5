"""The mirror's chain search in C (``chain_search.c``, a CPython extension), compiled on first use.

``load()`` returns the extension module, building it once per machine and interpreter into
``$KVMESH_CACHE_DIR/native`` (default ``~/.cache/kvmesh/native``) with the system C compiler and
this interpreter's headers, or None, the reason logged once, where that cannot be had (no compiler,
no headers, ``KVMESH_NATIVE_INDEX=0``); the mirror then searches in Python with the same answers.
(``kvmesh/native_build.py`` builds it.)
"""
from __future__ import annotations

import functools
import os
from pathlib import Path
from types import ModuleType

from kvmesh.native_build import load_extension_or_none

SOURCE = Path(__file__).with_name("chain_search.c")
MODULE = "kvmesh_chain_search"
FLAGS = ("-O2", "-fno-strict-aliasing")
DISABLE_ENV = "KVMESH_NATIVE_INDEX"


@functools.cache
def load() -> ModuleType | None:
    """The extension module, or None (see the module docstring)."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    return load_extension_or_none(SOURCE, MODULE, FLAGS, "native chain search off (the mirror searches in Python)")
