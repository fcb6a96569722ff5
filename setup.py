"""Packages are found, not listed: ``kvmesh`` and the top-level folders the layout maps into it.

Everything else about the project is in pyproject.toml. A folder with an ``__init__.py`` under
one of these roots is a package of the wheel, so a new subpackage can never be left out of it.
"""
from setuptools import find_packages, setup

PACKAGE_DIRS = {  # import name -> folder (docs/structures.md)
    "kvmesh": "kvmesh",
    "kvmesh.kernels": "kernels",
    "kvmesh.transfer": "transfer",
    "kvmesh.metadata": "metadata",
    "kvmesh.prefill_node": "prefill_node",
    "kvmesh.decode_node": "decode_node",
    "kvmesh.cluster": "cluster",
}


def found_packages() -> list[str]:
    packages = []
    for name, folder in PACKAGE_DIRS.items():
        packages.append(name)
        packages += [f"{name}.{sub}" for sub in find_packages(folder) if f"{name}.{sub}" not in PACKAGE_DIRS]
    return packages


setup(package_dir=PACKAGE_DIRS, packages=found_packages())
