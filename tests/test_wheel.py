"""The wheel a user installs holds every module of the source tree, and each imports from it alone."""
from __future__ import annotations

import json
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.source_tree import PACKAGE_DIRS, ROOT, source_modules

# Run with -S (no site hooks, so no editable install mapping kvmesh back to the source tree): the wheel's
# folder first, then the dependencies' site-packages.
IMPORT_ALL = """
import importlib, json, sys
wheel_dir, deps, modules = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
sys.path[:0] = [wheel_dir]
sys.path += deps
report = {"outside": [], "missing_optional": [], "failed": []}
for name in modules:
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as e:
        (report["failed"] if (e.name or "").startswith("kvmesh") else report["missing_optional"]).append(
            f"{name}: {e}")
        continue
    except Exception as e:
        report["failed"].append(f"{name}: {type(e).__name__}: {e}")
        continue
    if not module.__file__.startswith(wheel_dir):
        report["outside"].append(f"{name}: {module.__file__}")
print(json.dumps(report))
"""


def test_the_wheel_holds_every_module_and_imports_without_the_source_tree(tmp_path):
    tree = tmp_path / "src"
    tree.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, tree / name)
    for folder in PACKAGE_DIRS.values():  # a copy: building in place would leave build/ in the checkout
        shutil.copytree(ROOT / folder, tree / folder, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.o"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(tree)], check=True, capture_output=True, timeout=600)
    wheel = next((tmp_path / "dist").glob("kvmesh-*.whl"))
    unpacked = tmp_path / "installed"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(unpacked)
        names = z.namelist()
    in_wheel = {n.removesuffix(".py").removesuffix("/__init__").replace("/", ".") for n in names
                if n.endswith(".py") and n.startswith("kvmesh/")}
    expected = set(source_modules())
    assert expected - in_wheel == set(), "modules of the source tree missing from the wheel"
    assert "kvmesh/cluster/proto/kvmesh.proto" in names and "kvmesh/kernels/cpu/common.h" in names
    native_sources = {f"kvmesh/{folder}/{path.relative_to(ROOT / folder).as_posix()}"
                      for folder in ("kernels", "metadata") for path in (ROOT / folder).rglob("*.[ch]")}
    assert {"kvmesh/metadata/chain_search.c", "kvmesh/kernels/extensions/blake2b_chain.c", "kvmesh/kernels/extensions/block_index.c"} <= native_sources
    assert native_sources - set(names) == set(), "C sources (built on first use) missing from the wheel"
    deps = [p for p in site.getsitepackages() if Path(p).exists()]
    proc = subprocess.run([sys.executable, "-S", "-c", IMPORT_ALL, str(unpacked), json.dumps(deps),
                           json.dumps(sorted(expected))], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["failed"] == [] and report["outside"] == [], report
    assert all(m.split(":")[0].startswith(("kvmesh.kernels.triton", "kvmesh.transfer.mooncake"))
               for m in report["missing_optional"]), report["missing_optional"]
