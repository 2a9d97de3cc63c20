"""Imports point only down the layers (docs/architecture.md, "Layers").

    4  cluster/           CLI, app builder, benchmarks, load tester, local runs
    3  router/            HTTP ingress, routing policy, placement
    2  workers/ (rest)    Serve deployments, worker stream, KV glue, metrics
    1  transport/         KV transport: control plane, data paths, wire
    0  workers/engine/    the engine and the whole KV interface it offers

A module may import its own layer and lower ones. `cluster.config`, the pure config
schema, may be imported from any layer, so it imports nothing from cluster/ or router/.
Every import is read with `ast`: top-level and inside functions, `import x` and
`from x import y` (relative ones resolved), under `if TYPE_CHECKING:` (reported as such),
and `importlib.import_module("...")` with a literal name.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("workers.engine", "transport", "workers", "router", "cluster")  # bottom to top
SHARED_SCHEMA = "cluster.config"

# (importing file, imported module) -> why this upward import is allowed. Keep it empty.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Import:
    file: str  # relative to the repo root
    line: int
    module: str  # the dotted module imported
    type_only: bool  # under `if TYPE_CHECKING:`

    def where(self) -> str:
        return f"{self.file}:{self.line}" + (" (TYPE_CHECKING)" if self.type_only else "")


def layer_of(module: str) -> int | None:
    """The layer of a dotted module name; None outside the four folders."""
    if module == "workers":  # the package runs before any workers.engine module
        return 0
    for prefix in sorted(LAYERS, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return LAYERS.index(prefix)
    return None


def describe(layer: int) -> str:
    return f"layer {layer} ({LAYERS[layer].replace('.', '/')}/)"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_known(module: str) -> bool:
    path = ROOT.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports_of(path: Path) -> list[Import]:
    rel = str(path.relative_to(ROOT))
    tree = ast.parse(path.read_text(), filename=rel)
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, type_only: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, type_only)
            return
        if isinstance(node, ast.Import):
            found.extend(Import(rel, node.lineno, a.name, type_only) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node, package)
            for alias in node.names:
                sub = f"{base}.{alias.name}"  # `from pkg import submodule`
                found.append(Import(rel, node.lineno, sub if is_known(sub) else base, type_only))
        elif isinstance(node, ast.Call) and _is_import_module(node):
            found.append(Import(rel, node.lineno, node.args[0].value, type_only))
        for child in ast.iter_child_nodes(node):
            visit(child, type_only)

    visit(tree, False)
    return list(dict.fromkeys(found))  # `from m import a, b` once


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _is_import_module(call: ast.Call) -> bool:
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    return (name in ("import_module", "__import__") and bool(call.args)
            and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str))


def _resolve(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    base = parts[: len(parts) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def all_modules() -> list[Path]:
    return sorted(p for folder in ("workers", "transport", "router", "cluster")
                  for p in (ROOT / folder).rglob("*.py"))


def all_imports() -> list[Import]:
    return [imp for path in all_modules() for imp in imports_of(path)]


def upward_imports() -> list[str]:
    problems = []
    for imp in all_imports():
        src = module_name(ROOT / imp.file)
        src_layer, dst_layer = layer_of(src), layer_of(imp.module)
        if src_layer is None or dst_layer is None or dst_layer <= src_layer:
            continue
        if imp.module == SHARED_SCHEMA or (imp.file, imp.module) in ALLOWED_UPWARD:
            continue
        problems.append(f"{imp.where()} imports {imp.module}, {describe(dst_layer)}, "
                        f"from {describe(src_layer)}")
    return problems


def test_the_scanner_sees_every_kind_of_import(tmp_path, monkeypatch):
    pkg = tmp_path / "transport"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "sibling.py").write_text("")
    (pkg / "probe.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "import router.policy\n"
        "from . import sibling\n"
        "if TYPE_CHECKING:\n"
        "    from cluster.app import build_app\n"
        "def f():\n"
        "    from workers import decode\n"
        "    import importlib\n"
        "    importlib.import_module('router.ingress')\n")
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    got = {(i.line, i.module, i.type_only) for i in imports_of(pkg / "probe.py")}
    assert {(2, "router.policy", False), (3, "transport.sibling", False),
            (5, "cluster.app", True), (7, "workers", False),
            (9, "router.ingress", False)} <= got


def test_imports_point_only_down_the_layers():
    problems = upward_imports()
    assert not problems, "upward imports:\n  " + "\n  ".join(problems)


def test_allowed_upward_imports_still_exist():
    present = {(i.file, i.module) for i in all_imports()}
    stale = [f"{f} -> {m}" for f, m in ALLOWED_UPWARD if (f, m) not in present]
    assert not stale, f"ALLOWED_UPWARD lists imports that are gone: {stale}"


def test_the_engine_imports_nothing_from_transport():
    bad = [f"{i.where()} imports {i.module}" for i in all_imports()
           if i.file.startswith("workers/engine/") and layer_of(i.module) == 1]
    assert not bad, "\n".join(bad)


def test_the_shared_schema_imports_nothing_from_cluster_or_router():
    bad = [f"{i.where()} imports {i.module}" for i in imports_of(ROOT / "cluster" / "config.py")
           if i.module.split(".")[0] in ("cluster", "router")]
    assert not bad, "cluster/config.py is imported by every layer:\n" + "\n".join(bad)


def project_closure(module: str) -> set[str]:
    """Every project module `module` imports at run time, directly or through others."""
    seen, todo = set(), [module]
    while todo:
        path = ROOT.joinpath(*todo.pop().split("."))
        path = path.with_suffix(".py") if path.with_suffix(".py").is_file() else path / "__init__.py"
        if not path.is_file():
            continue
        for imp in imports_of(path):
            if not imp.type_only and layer_of(imp.module) is not None and imp.module not in seen:
                seen.add(imp.module)
                todo.append(imp.module)
    return seen


def test_the_shared_schema_pulls_in_nothing_above_its_importers():
    """Importing cluster.config runs its own imports: they must be fine for the importer."""
    pulled = project_closure(SHARED_SCHEMA) - {SHARED_SCHEMA}
    problems = []
    for imp in all_imports():
        src_layer = layer_of(module_name(ROOT / imp.file))
        if imp.module != SHARED_SCHEMA or imp.type_only or src_layer is None:
            continue
        problems += [f"{imp.where()} imports {SHARED_SCHEMA}, which pulls in {dep}, "
                     f"{describe(layer_of(dep))}, into {describe(src_layer)}"
                     for dep in sorted(pulled) if layer_of(dep) > src_layer]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("package", ["workers", "cluster"])
def test_packages_on_a_lower_import_path_stay_empty(package):
    """Importing workers.engine.* or cluster.config runs these first."""
    imports = imports_of(ROOT / package / "__init__.py")
    assert not imports, [f"{i.where()} imports {i.module}" for i in imports]


def test_no_product_module_imports_the_tests():
    bad = [f"{i.where()} imports {i.module}" for i in all_imports()
           if i.module == "tests" or i.module.startswith("tests.")]
    assert not bad, "\n".join(bad)
