"""Package discovery, the one thing pyproject.toml cannot say: the wheel holds every directory with a .py
file under the roots of ``[tool.setuptools] package-dir`` (``sgl_remote_kv/`` and the top-level ``dpu/``,
``nvdec/``, ``kernels/``, installed as ``sgl_remote_kv.dpu`` ...), so a new subpackage is never left out
of the wheel. Files other than .py under those roots come in through MANIFEST.in (package data).
tests/test_packaging.py builds the sdist and the wheel and checks both against the tree."""

from pathlib import Path

from setuptools import setup

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: build-system requires tomli there
    import tomli as tomllib

HERE = Path(__file__).resolve().parent


def discover_packages(package_dir: dict[str, str]) -> list[str]:
    """Dotted names of every directory holding a .py file under each mapped root."""
    found = set()
    for name, src in package_dir.items():
        root = HERE / src
        for py in root.rglob("*.py"):
            rel = py.parent.relative_to(root).parts
            if "__pycache__" not in rel:
                found.add(".".join((name, *rel)))
    return sorted(found)


with open(HERE / "pyproject.toml", "rb") as f:
    PACKAGE_DIR = tomllib.load(f)["tool"]["setuptools"]["package-dir"]

setup(packages=discover_packages(PACKAGE_DIR))
