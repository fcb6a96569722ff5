"""The mirror's chain search in C (``chain_search.c``, a CPython extension), compiled on first use.

``load()`` returns the extension module, building it once per machine and interpreter into
``$KVMESH_CACHE_DIR/native`` (default ``~/.cache/kvmesh/native``) with the system C compiler and
this interpreter's headers, or None, the reason logged once, where that cannot be had (no compiler,
no headers, ``KVMESH_NATIVE_INDEX=0``); the mirror then searches in Python with the same answers.
(``kvmesh/native_build.py`` builds it.)
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

from kvmesh.native_build import c_compiler, cache_dir, compile_library

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("chain_search.c")
MODULE = "kvmesh_chain_search"
FLAGS = ("-O2", "-fPIC", "-shared", "-fno-strict-aliasing")
DISABLE_ENV = "KVMESH_NATIVE_INDEX"


@functools.cache
def load() -> ModuleType | None:
    """The extension module, or None (see the module docstring)."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    compiler = c_compiler()
    include = sysconfig.get_paths().get("include", "")
    if compiler is None or not Path(include, "Python.h").is_file():
        log.info("native chain search off (no C compiler or no Python headers): the mirror searches in Python")
        return None
    key = hashlib.blake2b(digest_size=8)
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), compiler.encode(), sys.version.encode(),
                 include.encode()):
        key.update(part)
    path = cache_dir() / f"{MODULE}_{key.hexdigest()}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    if not path.exists():
        reason = compile_library(compiler, [*FLAGS, f"-I{include}"], [str(SOURCE)], path)
        if reason is not None:
            log.warning("native chain search off (the mirror searches in Python): %s", reason)
            return None
    try:
        spec = importlib.util.spec_from_file_location(MODULE, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError) as exc:
        log.warning("native chain search off (the mirror searches in Python): %s", exc)
        return None
    return module
