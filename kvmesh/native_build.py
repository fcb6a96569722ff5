"""Native code compiled on first use: where it is kept and how it is built (no torch: the router loads it too).

The CPU kernels (``kernels/cpu/library.py``) and the mirror's chain search (``metadata/native_search.py``)
each hash their sources, flags and compiler into a file name under ``cache_dir()`` and build it there once
with ``compile_library``: several processes building at once each write a temporary file and rename it
into place, so a reader never sees half a library.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path


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
    """``compiler *flags -o out *inputs`` through a temporary file renamed to ``out``; None, or why it failed."""
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
