"""The layers of docs/structures.md, as code: no module imports a module of a higher layer (at any depth of the file,
lazy imports included), and every module belongs to a layer."""
from __future__ import annotations

import ast
from pathlib import Path

from tests.source_tree import source_modules

# Lowest first. A module's layer is that of the longest name below that it is or lies under; names ending in "="
# are the module itself only (the package root is the public API, above everything).
LAYERS = [
    ("base", ["kvmesh.errors", "kvmesh.wire", "kvmesh.auth", "kvmesh.lifecycle", "kvmesh.netaddr", "kvmesh.cpu_info",
              "kvmesh.device", "kvmesh.rate_meter", "kvmesh.router_endpoint", "kvmesh.native_build",
              "kvmesh.gc_pauses", "kvmesh.tracing", "kvmesh.file_lock", "kvmesh.openmp_pool"]),
    ("kernels", ["kvmesh.kernels"]),
    ("model", ["kvmesh.model", "kvmesh.tokenizer", "kvmesh.detokenizer"]),
    ("kv", ["kvmesh.kv"]),
    ("engine", ["kvmesh.engine", "kvmesh.parallel"]),
    ("metadata", ["kvmesh.metadata"]),
    ("transfer", ["kvmesh.transfer"]),
    ("node", ["kvmesh.node"]),
    ("roles", ["kvmesh.prefill_node", "kvmesh.decode_node"]),
    ("cluster", ["kvmesh.cluster"]),
    ("tools", ["kvmesh.bench", "kvmesh.cli", "kvmesh="]),
]


def layer_of(module: str) -> int | None:
    best = None
    for index, (_, names) in enumerate(LAYERS):
        for name in names:
            exact = name.endswith("=")
            name = name.rstrip("=")
            if module == name or (not exact and module.startswith(name + ".")):
                if best is None or len(name) > best[1]:
                    best = (index, len(name))
    return None if best is None else best[0]


def imports_of(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module != "kvmesh":  # ``from kvmesh import lifecycle`` imports the submodule, not the API
                found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name == "kvmesh" or name.startswith("kvmesh.")}


def test_no_module_imports_a_higher_layer():
    found = source_modules()
    assert len(found) > 100
    unplaced = sorted(m for m in found if layer_of(m) is None)
    assert unplaced == [], f"modules in no layer of LAYERS: {unplaced}"
    upward = []
    for module, path in sorted(found.items()):
        mine = layer_of(module)
        for target in sorted(imports_of(path)):
            theirs = layer_of(target)
            if theirs is not None and theirs > mine and target.rsplit(".", 1)[0] != module:
                upward.append(f"{module} ({LAYERS[mine][0]}) imports {target} ({LAYERS[theirs][0]})")
    assert upward == [], "\n".join(upward)


def test_the_check_sees_an_upward_import(tmp_path):
    """The test above would notice: a kv-layer file importing the node layer is flagged."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from kvmesh.node.runtime import NodeRuntime\n")
    assert layer_of("kvmesh.kv.bad") < max(layer_of(t) for t in imports_of(bad))
