"""What users install is complete: the sdist holds every file under the package roots of pyproject's
``package-dir`` (``sgl_remote_kv/``, ``dpu/``, ``nvdec/``, ``kernels/``), and so do both wheels (the one
built from the sdist, the one ``pip wheel .`` builds from the tree), under ``sgl_remote_kv/`` only; every
entry point names a function the wheel defines. (A hand-written package list once left
``sgl_remote_kv.admission`` out of the wheel, and a plugin that does not import.) The installed wheel
serving requests: tests/test_installed_wheel_server.py."""

from __future__ import annotations

import ast
import configparser
import tarfile
import zipfile
from pathlib import PurePosixPath

import pytest

from tests.fixtures.dists import installed_path, package_dir

ENTRY_GROUPS = ("console_scripts", "sglang.srt.plugins", "sglang.srt.platforms")
CONSOLE_SCRIPTS = {"sgl-remote-kv-admin", "sgl-remote-kv-dpu", "sgl-remote-kv-build-model"}


def _package_files(files) -> dict[str, str]:
    """Checkout file -> its path in a wheel, for every file under a package root."""
    mapping = package_dir()
    out = {rel: installed_path(rel, mapping) for rel in files}
    return {rel: dst for rel, dst in out.items() if dst is not None}


def _missing_report(missing: dict[str, str]) -> str:
    packages = sorted({str(PurePosixPath(dst).parent).replace("/", ".") for dst in missing.values()})
    return f"{len(missing)} files missing, of packages {packages}: {sorted(missing)[:20]}"


def test_the_tree_has_the_packages_the_check_relies_on(built_dists):
    """The checks below compare against the checkout's file list: it must hold the package roots."""
    expected = _package_files(built_dists.files)
    dirs = {str(PurePosixPath(d).parent) for d in expected.values()}
    assert {"sgl_remote_kv", "sgl_remote_kv/admission", "sgl_remote_kv/dpu", "sgl_remote_kv/nvdec"} <= dirs
    assert "sgl_remote_kv/kernels" in dirs


@pytest.mark.parametrize("which", ["wheel_from_sdist", "wheel_from_tree"])
def test_wheel_holds_every_file_of_the_package_roots(built_dists, which):
    with zipfile.ZipFile(getattr(built_dists, which)) as z:
        names = set(z.namelist())
    expected = _package_files(built_dists.files)
    missing = {rel: dst for rel, dst in expected.items() if dst not in names}
    assert not missing, _missing_report(missing)
    # nothing else: no caches of a used tree, nothing outside our namespace (a top-level `kernels` would
    # shadow PyPI's, see docs/ARCHITECTURE.md)
    stray = {n for n in names if ".dist-info/" not in n} - set(expected.values())
    assert not stray, sorted(stray)


def test_sdist_holds_the_package_roots_and_the_build_files(built_dists):
    with tarfile.open(built_dists.sdist) as t:
        top = t.getnames()[0].split("/")[0]
        names = {n.partition("/")[2] for n in t.getnames()}
    expected = set(_package_files(built_dists.files)) | {
        "pyproject.toml",
        "setup.py",
        "MANIFEST.in",
        "README.md",
    }
    missing = sorted(expected - names)
    assert not missing, f"{top}: {len(missing)} files missing: {missing[:20]}"
    assert not [n for n in names if "__pycache__" in n], "the sdist holds caches of the tree"


def test_every_entry_point_names_a_function_of_the_wheel(built_dists):
    with zipfile.ZipFile(built_dists.wheel_from_sdist) as z:
        names = set(z.namelist())
        (ep_file,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        parser = configparser.ConfigParser(delimiters=("=",))
        parser.optionxform = str  # keep the names' case
        parser.read_string(z.read(ep_file).decode())
        assert CONSOLE_SCRIPTS <= set(parser["console_scripts"]), dict(parser["console_scripts"])
        for group in ENTRY_GROUPS:
            assert parser.has_section(group) and parser[group], group
            for name, target in parser[group].items():
                module, _, func = target.strip().partition(":")
                path = module.replace(".", "/") + ".py"
                if path not in names:
                    path = module.replace(".", "/") + "/__init__.py"
                assert path in names, f"{group} {name}: module {module} is not in the wheel"
                tree = ast.parse(z.read(path))
                defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
                assert func in defined, f"{group} {name}: {module} defines no function {func}"
