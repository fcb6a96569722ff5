"""The source tree as the wheel maps it: setup.py's folder mapping (read, not repeated) and every module in it."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _package_dirs() -> dict[str, str]:
    for node in ast.parse((ROOT / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "PACKAGE_DIRS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py defines no PACKAGE_DIRS")


PACKAGE_DIRS = _package_dirs()  # import name -> folder


def source_modules() -> dict[str, Path]:
    """Module name -> file, for every module of a package (a folder with ``__init__.py``) under the mapped roots;
    links from one root into another (the device scripts make some) are skipped."""
    out = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            if "__pycache__" in rel.parts or not (path.parent / "__init__.py").exists():
                continue
            if f"{package}.{rel.parts[0]}" in PACKAGE_DIRS:
                continue
            parts = [package, *rel.parts]
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out
