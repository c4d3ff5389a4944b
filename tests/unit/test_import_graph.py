"""The import graph of vlmc/ and passes/ (read with ast, nothing imported): no loop, no upward import, no
deferred import of a vlmc module but the few that keep a heavy optional dependency lazy.

Layers (docs/architecture.md): vlmc.runtime runs packages and compile outputs and imports no backend;
vlmc.backends only compile. A deferred import (inside a function) of a vlmc module is allowed only when it
is on :data:`LAZY` with its reason, and only while the reason holds: the imported module, at import time,
loads a heavy dependency (:data:`HEAVY`) that the importing module does not already load.
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# What a deferred import may keep lazy: importing these costs seconds (torch, transformers, onnxruntime)
# or needs an extra that may be absent (export, serve, CANN).
HEAVY = ("torch", "torch_npu", "transformers", "fastapi", "uvicorn", "acl", "onnxruntime")

# Deferred imports of vlmc modules that are allowed: module imported -> why it is imported late.
LAZY = {
    "vlmc.serve": "FastAPI and uvicorn (the serve extra): `vlmc serve` only",
    "vlmc.exporters.streaming": "torch (the export extra): exporting from a checkpoint only",
    "vlmc.ortsession": "onnxruntime: the pass registry (recipe checks, `vlmc schema`) and passes that never "
    "open a session load without it",
    "vlmc.runtime": "onnxruntime (its executors): prune measures and `vlmc plan` run the package only on request",
    "vlmc.runtime.preprocess": "onnxruntime (vlmc.runtime's executors load with it): `vlmc plan` and the prune "
    "pass's checks read preprocessing facts without running anything",
    "vlmc.runtime.patches": "onnxruntime (as vlmc.runtime.preprocess): `vlmc plan` counts patches only",
    "vlmc.passes.quantize.calib": "onnxruntime.quantization: loaded when a graph is quantized, not when the "
    "registry loads the quantize pass",
    "vlmc.passes.quantize.fidelity": "onnxruntime: fidelity runs sessions, only after quantizing",
}

# Importers whose deferred imports cannot hide a loop because nothing in vlmc imports them (checked below).
TOP = {
    "vlmc.cli": "the click layer: each command imports what it runs, so `vlmc --help` and the light commands "
    "start in about a second instead of loading onnx, onnxruntime and the passes (over ten seconds on a "
    "loaded machine)",
    "vlmc.__main__": "`python -m vlmc`: calls the CLI",
}

# The one package-level loop, on purpose: the pass registry discovers its plugins.
REGISTRY = {
    ("vlmc.pass_api", "vlmc.passes"): "plugin discovery: pass_api.registry() imports every module of "
    "vlmc.passes by name (pkgutil) on first use, and each registers itself with pass_api.register; "
    "vlmc.passes/__init__ imports no pass (checked below), so nothing loops at import time",
}


def _modules() -> dict[str, Path]:
    out = {}
    for base, prefix in (
        ("vlmc", ["vlmc"]),
        ("passes", ["vlmc", "passes"]),
    ):  # passes/ installs as vlmc.passes
        for path in sorted((REPO / base).rglob("*.py")):
            parts = list(path.relative_to(REPO / base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(prefix + parts)] = path
    return out


MODULES = _modules()
Import = collections.namedtuple("Import", "source target line deferred")


def _resolve(name: str) -> str | None:
    """The vlmc module ``name`` loads (a package's ``__init__`` for a name inside it)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> tuple[list[Import], set[str]]:
    """The module's imports of vlmc modules, and the third-party modules it imports at import time."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []
    third: set[str] = set()

    def visit(node: ast.AST, deferred: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue  # never runs
            inner = deferred or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    parts = package.split(".")
                    source = ".".join(parts[: len(parts) - child.level + 1] + [child.module or ""]).rstrip(
                        "."
                    )
                else:
                    source = child.module or ""
                names = [
                    f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source for a in child.names
                ]
            for name in names:
                if name == "vlmc" or name.startswith("vlmc."):
                    target = name if name in MODULES else _resolve(name)
                    if target is not None and target != module:
                        found.append(Import(module, target, child.lineno, inner))
                elif not inner:
                    third.add(name)
            visit(child, inner)

    visit(ast.parse(path.read_text(), str(path)), False)
    return found, third


IMPORTS: list[Import] = []
THIRD: dict[str, set[str]] = {}
for _name, _path in MODULES.items():
    _found, THIRD[_name] = _imports(_name, _path)
    IMPORTS += _found


def _unit(module: str) -> str:
    """The subpackage a module belongs to (vlmc.runtime, vlmc.backends, ...), or the top-level module itself."""
    parts = module.split(".")
    head = ".".join(parts[:2])
    return head if MODULES.get(head, Path()).name == "__init__.py" else module


def _heavy(module: str) -> set[str]:
    """The heavy dependencies importing ``module`` loads: its top-level imports, their packages' ``__init__``s, ..."""
    seen, todo, deps = {module}, [module], set()
    top = collections.defaultdict(list)
    for imp in IMPORTS:
        if not imp.deferred:
            top[imp.source].append(imp.target)
    while todo:
        current = todo.pop()
        deps |= {h for h in HEAVY for t in THIRD[current] if t == h or t.startswith(h + ".")}
        parts = current.split(".")
        parents = [".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in MODULES]
        for nxt in top[current] + parents:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return deps


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(edges.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
    return out


def test_the_graph_is_read():
    # The reader finds what it must, so the checks below cannot pass on an empty graph.
    assert {"vlmc.cli", "vlmc.runtime.ranks", "vlmc.runtime.executors.build", "vlmc.passes.quantize"} <= set(
        MODULES
    )
    edges = {(i.source, i.target) for i in IMPORTS}
    assert ("vlmc.runtime.ranks", "vlmc.runtime.executors") in edges
    assert ("vlmc.backends.ascend.rules._qdq_common", "vlmc.runtime.executors.reference") in edges
    assert any(i.source == "vlmc.cli" and i.deferred for i in IMPORTS)
    assert "onnxruntime" in _heavy("vlmc.ortsession") and "torch" in _heavy("vlmc.exporters.streaming")


def test_no_module_imports_in_a_loop():
    # Every import, deferred ones included: a loop a deferred import hides is still a loop.
    edges = collections.defaultdict(set)
    for imp in IMPORTS:
        edges[imp.source].add(imp.target)
    assert _cycles(edges) == []


def test_no_loop_between_subpackages():
    edges = collections.defaultdict(set)
    for imp in IMPORTS:
        a, b = _unit(imp.source), _unit(imp.target)
        if a != b and (imp.source, _unit(imp.target)) not in REGISTRY:
            edges[a].add(b)
    assert _cycles(edges) == []


def test_the_registry_loop_is_discovery_only():
    for source, package in REGISTRY:
        assert any(i.source == source and i.target == package for i in IMPORTS)
        assert not [i for i in IMPORTS if i.source == package], f"{package}/__init__ imports a vlmc module"


def test_the_runtime_imports_no_backend():
    upward = [f"{i.source}:{i.line} -> {i.target}" for i in IMPORTS if i.source.startswith("vlmc.runtime")]
    assert [u for u in upward if "-> vlmc.backends" in u] == []


def test_nothing_imports_the_cli():
    importers = {i.source for i in IMPORTS if i.target in TOP}
    assert importers <= set(TOP), sorted(importers - set(TOP))


def test_deferred_imports_only_keep_heavy_dependencies_lazy():
    wrong = []
    for imp in IMPORTS:
        if not imp.deferred or imp.source in TOP or (imp.source, imp.target) in REGISTRY:
            continue
        if imp.target not in LAZY:
            wrong.append(f"{imp.source}:{imp.line} imports {imp.target} inside a function (not on LAZY)")
        elif not _heavy(imp.target) - _heavy(imp.source):
            wrong.append(
                f"{imp.source}:{imp.line} defers {imp.target}, but it loads nothing heavy {imp.source} lacks"
            )
    assert wrong == []


@pytest.mark.parametrize("module", sorted(LAZY))
def test_every_lazy_entry_still_loads_something_heavy(module):
    # An entry whose module no longer loads a heavy dependency has lost its reason: remove it.
    assert module in MODULES
    assert _heavy(module), f"{module} loads none of {HEAVY}: {LAZY[module]}"
