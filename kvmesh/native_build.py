"""Native code compiled on first use: where it is kept and how it is built (no torch: the router loads it too).

The CPU kernels (``kernels/cpu/library.py``, through ctypes) and the CPython extensions
(``load_extension``: the block hash chain and the pool's index, ``kernels/extensions``; the mirror's chain search,
``metadata/native_search.py``) each hash their sources, flags, compiler and CPU into a file name under
``cache_dir()`` and build it there once with ``compile_library``: several processes building at once each
write a temporary file and rename it into place, so a reader never sees half a library.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from kvmesh.cpu_info import cpu_flags
from kvmesh.file_lock import exclusive

log = logging.getLogger(__name__)


class NativeBuildError(RuntimeError):
    """A native extension cannot be had here: no compiler, no Python headers (``missing_tools``), or its
    build failed."""

    def __init__(self, reason: str, missing_tools: bool = False):
        super().__init__(reason)
        self.missing_tools = missing_tools


def cache_dir() -> Path:
    """``$KVMESH_CACHE_DIR/native`` (default ``~/.cache/kvmesh/native``)."""
    return Path(os.environ.get("KVMESH_CACHE_DIR", Path.home() / ".cache" / "kvmesh")) / "native"


def c_compiler() -> str | None:
    """``$CC``, else ``cc``, else ``gcc`` (a full path), or None where there is none."""
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def compile_library(compiler: str, flags: Sequence[str], inputs: Sequence[str], out: Path) -> str | None:
    """``compiler *flags -o out *inputs`` through a temporary file renamed to ``out``; None, or why it failed.
    One process builds ``out`` at a time; one that waited for another's build takes it."""
    with exclusive(out.parent / f".{out.name}.lock"):
        return None if out.exists() else _compile(compiler, flags, inputs, out)


def _compile(compiler: str, flags: Sequence[str], inputs: Sequence[str], out: Path) -> str | None:
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out.parent, suffix=".so", delete=False) as tmp:
            tmp_path = Path(tmp.name)
    except OSError as exc:
        return f"cannot write {out.parent}: {exc}"
    cmd = [compiler, *flags, "-o", str(tmp_path), *inputs]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        tmp_path.unlink(missing_ok=True)
        return f"{compiler} failed to run: {exc}"
    if proc.returncode != 0:
        tmp_path.unlink(missing_ok=True)
        last = proc.stderr.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        return f"{' '.join(cmd)}: {last[0]}"
    os.replace(tmp_path, out)
    return None


def load_extension_or_none(source: Path, module: str, flags: Sequence[str], what: str) -> ModuleType | None:
    """``load_extension``, or None with the reason logged (INFO when the tools are missing, else WARNING;
    ``what`` says which path takes over). Callers cache the answer, so the reason is logged once."""
    try:
        return load_extension(source, module, flags)
    except NativeBuildError as exc:
        log.log(logging.INFO if exc.missing_tools else logging.WARNING, "%s: %s", what, exc)
        return None


def load_extension(source: Path, module: str, flags: Sequence[str]) -> ModuleType:
    """The CPython extension ``module`` built from the one C file ``source`` and the headers beside it (once
    per machine, interpreter, sources and flags) and imported; raises ``NativeBuildError`` saying why it
    cannot be."""
    compiler = c_compiler()
    include = sysconfig.get_paths().get("include", "")
    if compiler is None or not Path(include, "Python.h").is_file():
        raise NativeBuildError("no C compiler or no Python headers", missing_tools=True)
    key = hashlib.blake2b(digest_size=8)
    headers = sorted(source.parent.glob("*.h"))  # what the source may include beside it
    for part in (source.read_bytes(), *(h.read_bytes() for h in headers), " ".join(flags).encode(),
                 compiler.encode(), sys.version.encode(), include.encode(), " ".join(cpu_flags()).encode()):
        key.update(part)
    path = cache_dir() / f"{module}_{key.hexdigest()}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    if not path.exists():
        reason = compile_library(compiler, [*flags, "-fPIC", "-shared", f"-I{include}"], [str(source)], path)
        if reason is not None:
            raise NativeBuildError(reason)
    try:
        spec = importlib.util.spec_from_file_location(module, path)
        loaded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded)
    except (ImportError, OSError) as exc:
        raise NativeBuildError(str(exc)) from exc
    return loaded
