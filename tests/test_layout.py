"""The package layout rules (docs/ARCHITECTURE.md, "Layout"), checked on the source with ``ast``:

- no two folders import each other (a folder: a subpackage of ``sgl_remote_kv`` or one of its top-level
  modules, and each of the top-level ``dpu/``, ``nvdec/``, ``kernels/``, installed as
  ``sgl_remote_kv.dpu`` ...); imports inside functions count too;
- the data-plane contract (``sgl_remote_kv/contract/``) is a leaf, and ``nvdec/`` never imports the
  SGLang glue;
- no import cycle of any length, between folders or between modules (function-level and ``TYPE_CHECKING``
  imports count), except the ones listed in ``KNOWN_CYCLES`` (each may only shrink or go; the list may
  only get shorter);
- no product module is longer than 400 lines, except the ones listed in ``OVER_BUDGET`` (each may only
  shrink; the list may only get shorter).
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
PKG = "sgl_remote_kv"
# top-level folders installed under our namespace (pyproject.toml [tool.setuptools] package-dir)
MAPPED = {"dpu": f"{PKG}.dpu", "nvdec": f"{PKG}.nvdec", "kernels": f"{PKG}.kernels"}
MAX_LINES = 400
# Modules still over MAX_LINES, with their length when listed; a module may only shrink (none now).
OVER_BUDGET: dict[str, int] = {}


# Import cycles still present (strongly connected components); each may only shrink. None since 2026-11-28.
KNOWN_CYCLES: list[frozenset[str]] = []


def _files() -> dict[str, Path]:
    """Dotted module name -> file, for every product module."""
    out = {}
    for top in (PKG, *MAPPED):
        for f in (ROOT / top).rglob("*.py"):
            if "__pycache__" in f.parts:
                continue
            rel = f.relative_to(ROOT / top).with_suffix("").parts
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join((MAPPED.get(top, PKG), *rel))] = f
    return out


FILES = _files()
PACKAGES = {m for m, f in FILES.items() if f.name == "__init__.py"}


def _folder(module: str) -> str:
    """The folder ``module`` belongs to: ``sgl_remote_kv.<first part>`` (the package root itself: ``sgl_remote_kv``)."""
    return ".".join(module.split(".")[:2])


def _imports(module: str, path: Path) -> set[str]:
    """The product modules ``module`` imports (anywhere in the file)."""
    package = module if module in PACKAGES else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [f"{target}.{a.name}" if f"{target}.{a.name}" in FILES else target for a in node.names]
        else:
            continue
        found.update(n for n in names if n in FILES)
    return found


def _folder_edges() -> dict[tuple[str, str], list[str]]:
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for module, path in FILES.items():
        for target in _imports(module, path):
            a, b = _folder(module), _folder(target)
            if a != b:
                edges[a, b].append(f"{module} -> {target}")
    return edges


def test_the_import_scan_sees_the_package():
    edges = _folder_edges()
    assert f"{PKG}.fetch.dpu_client.client" in FILES and f"{PKG}.dpu.server" in FILES
    assert (f"{PKG}.fetch", f"{PKG}.contract") in edges  # the DPU client speaks the contract
    assert (f"{PKG}.dpu", f"{PKG}.contract") in edges


def test_no_two_folders_import_each_other():
    edges = _folder_edges()
    cycles = sorted(
        f"{a} <-> {b}: {edges[a, b][:3]} / {edges[b, a][:3]}" for a, b in edges if a < b and (b, a) in edges
    )
    assert not cycles, "\n".join(cycles)


def _cycles(nodes, edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_beyond_the_known_ones_and_those_only_shrink():
    modules = {m: _imports(m, p) for m, p in FILES.items()}
    folders: dict[str, set[str]] = defaultdict(set)
    for m, targets in modules.items():
        folders[_folder(m)].update(_folder(t) for t in targets if _folder(t) != _folder(m))
    found = _cycles({_folder(m) for m in FILES}, folders) + _cycles(set(FILES), modules)
    new = [sorted(c) for c in found if not any(c <= k for k in KNOWN_CYCLES)]
    assert not new, f"import cycles (a cycle may not be added or grow): {new}"
    gone = [sorted(k) for k in KNOWN_CYCLES if not any(k <= c for c in found)]
    assert not gone, f"KNOWN_CYCLES lists cycles that shrank or are gone (update the list): {gone}"


def test_the_cycle_check_sees_a_cycle_through_a_function_level_import():
    assert _cycles({"a", "b", "c"}, {"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [frozenset("abc")]
    assert f"{PKG}.sglang_glue.engine_api" in _imports(  # a function-level import only
        f"{PKG}.sglang_glue.plugin", FILES[f"{PKG}.sglang_glue.plugin"]
    )


def test_no_host_module_imports_the_data_plane():
    """What host and data plane share (settings, region sizing, messages) lives in ``contract/``."""
    edges = _folder_edges()
    into_dpu = [e for (a, b), es in edges.items() if b == f"{PKG}.dpu" for e in es]
    assert not into_dpu, into_dpu


def test_the_contract_is_a_leaf_and_nvdec_has_no_glue():
    edges = _folder_edges()
    contract = [e for (a, _), es in edges.items() if a == f"{PKG}.contract" for e in es]
    assert not contract, contract
    glue = edges.get((f"{PKG}.nvdec", f"{PKG}.sglang_glue"), [])
    assert not glue, glue


def test_product_modules_stay_small():
    too_long, grew = [], []
    for path in FILES.values():
        rel = str(path.relative_to(ROOT))
        n = len(path.read_text().splitlines())
        limit = OVER_BUDGET.get(rel, MAX_LINES)
        if n > limit:
            (grew if rel in OVER_BUDGET else too_long).append(f"{rel}: {n} lines (limit {limit})")
    assert not too_long and not grew, "\n".join(too_long + grew)
    stale = [r for r in OVER_BUDGET if not (ROOT / r).exists()]
    assert not stale, f"OVER_BUDGET names modules that are gone: {stale}"


_DOTTED = re.compile(r"sgl_remote_kv(?:\.[a-z_0-9]+)+")


def _product_edges() -> dict[str, set[str]]:
    """Module -> the product modules it uses: its imports, and dotted names in its string literals (registries
    such as the store URL schemes, ``"sgl_remote_kv.store.faulty:open_faulty"``, import by name)."""
    edges = {m: _imports(m, p) for m, p in FILES.items()}
    for m, p in FILES.items():
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for name in _DOTTED.findall(node.value):
                    while name and name not in FILES:
                        name = name.rpartition(".")[0]
                    if name and name != m:
                        edges[m].add(name)
    return edges


def _entry_points() -> set[str]:
    """What users start: pyproject's entry points and scripts, and every ``python -m`` main."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    targets = [v for group in project["entry-points"].values() for v in group.values()]
    targets += list(project["scripts"].values())
    return {t.split(":")[0] for t in targets} | {m for m in FILES if m.endswith(".__main__")}


def _unreached(modules: set[str], edges: dict[str, set[str]], roots: set[str]) -> set[str]:
    """Modules not reached from ``roots`` along ``edges`` (a reached module's parent packages are reached)."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        m = todo.pop()
        if m in seen or m not in modules:
            continue
        seen.add(m)
        parts = m.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        todo += edges.get(m, ())
    return modules - seen


def test_the_wheel_holds_no_module_only_tests_benchmarks_or_scripts_use():
    """Every packaged module is reached from what users start (entry points, ``python -m`` mains) through the
    product's own imports; one that only tests, benchmarks or scripts import belongs outside the package."""
    unreached = _unreached(set(FILES), _product_edges(), _entry_points())
    assert not unreached, f"packaged modules nothing in the product uses: {sorted(unreached)}"
    assert {f"{PKG}.sglang_glue.plugin", f"{PKG}.dpu.__main__"} <= _entry_points()


def test_the_reach_check_sees_a_module_only_tests_use():
    edges = {"p.a": {"p.b"}, "p.b": set(), "p.c": {"p.b"}}
    assert _unreached({"p", "p.a", "p.b", "p.c"}, edges, {"p.a"}) == {"p.c"}
