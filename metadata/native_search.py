"""The mirror's chain search in C (``chain_search.c``, a CPython extension), compiled on first use.

``load()`` returns the extension module, building it once per machine and interpreter into
``$KVMESH_CACHE_DIR/native`` (default ``~/.cache/kvmesh/native``) with the system C compiler and
this interpreter's headers, or None, the reason logged once, where that cannot be had (no compiler,
no headers, ``KVMESH_NATIVE_INDEX=0``); the mirror then searches in Python with the same answers.
Several processes building at once each write a temporary file and rename it into place.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("chain_search.c")
MODULE = "kvmesh_chain_search"
FLAGS = ("-O2", "-fPIC", "-shared", "-fno-strict-aliasing")
DISABLE_ENV = "KVMESH_NATIVE_INDEX"


def _cache_dir() -> Path:
    return Path(os.environ.get("KVMESH_CACHE_DIR", Path.home() / ".cache" / "kvmesh")) / "native"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build(compiler: str, include: str, out: Path) -> str | None:
    """Compile into ``out``; None, or why it failed."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out.parent, suffix=".so", delete=False) as tmp:
            tmp_path = Path(tmp.name)
    except OSError as exc:
        return f"cannot write {out.parent}: {exc}"
    cmd = [compiler, *FLAGS, f"-I{include}", "-o", str(tmp_path), str(SOURCE)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        tmp_path.unlink(missing_ok=True)
        return f"{compiler} failed to run: {exc}"
    if proc.returncode != 0:
        tmp_path.unlink(missing_ok=True)
        return f"{' '.join(cmd)}: {(proc.stderr.strip().splitlines() or [f'exit {proc.returncode}'])[-1]}"
    os.replace(tmp_path, out)
    return None


@functools.cache
def load() -> ModuleType | None:
    """The extension module, or None (see the module docstring)."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    compiler = _compiler()
    include = sysconfig.get_paths().get("include", "")
    if compiler is None or not Path(include, "Python.h").is_file():
        log.info("native chain search off (no C compiler or no Python headers): the mirror searches in Python")
        return None
    key = hashlib.blake2b(digest_size=8)
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), compiler.encode(), sys.version.encode(),
                 include.encode()):
        key.update(part)
    path = _cache_dir() / f"{MODULE}_{key.hexdigest()}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    if not path.exists():
        reason = _build(compiler, include, path)
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
