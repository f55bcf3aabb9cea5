"""The import structure of ``shared/apportion`` and ``services``: no circles, no upward imports.

Layers, bottom first (docs/design/README.md, "Architecture: layers"): a module imports modules of its own
layer or of a layer below, never above; and no chain of imports, at module level or inside a function,
leads from a module back to itself. Every module belongs to a layer (a new module is placed in
:data:`LAYERS` before it can land).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: (layer, module prefixes), bottom first; a module's layer is that of its longest matching prefix (the
#: top package ``apportion`` names only its own ``__init__``)
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "contract",
        ("apportion", "apportion.timeutil", "apportion.topics", "apportion.durations", "apportion.events")
        + ("apportion.logrecord", "apportion.arrays"),
    ),
    ("domain", ("apportion.domain",)),
    (
        "computation",
        ("apportion.forecast", "apportion.report", "apportion.sim", "apportion.audit.invariants")
        + ("apportion.yamlio", "apportion.budgetfile", "apportion.statefile", "apportion.schemas_export")
        + ("apportion.jobdirs",)
        + ("apportion.identity.canonical", "apportion.identity.registry", "apportion.identity.gates"),
    ),
    (
        "adapters",
        ("apportion.clock", "apportion.settings", "apportion.readmodel", "apportion.gpu", "apportion.metrics")
        + ("apportion.identity", "apportion.bus", "apportion.client", "apportion.signers", "apportion.audit")
        + ("apportion.privatefiles", "apportion.heap"),
    ),
    ("entrypoints", ("apportion.cli", "services")),
)


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for ``root/shared/apportion`` and ``root/services``."""
    out: dict[str, Path] = {}
    for base in (root / "shared" / "apportion", root / "services"):
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _resolve(name: str, known: Iterable[str]) -> str | None:
    """The longest known module that ``name`` names or lies in (``pkg.mod.attr`` -> ``pkg.mod``)."""
    known = set(known)
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(files: Mapping[str, Path]) -> dict[str, dict[str, int]]:
    """Module -> {module it imports: first line}, over every import statement (module level or not)."""
    graph: dict[str, dict[str, int]] = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                names = [f"{src}.{a.name}" if f"{src}.{a.name}" in files else src for a in node.names]
            else:
                continue
            for name in names:
                target = _resolve(name, files)
                if target is not None and target != mod:
                    edges.setdefault(target, node.lineno)
        graph[mod] = edges
    return graph


def circles(graph: Mapping[str, Mapping[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def layer_of(mod: str, layers: tuple[tuple[str, tuple[str, ...]], ...] = LAYERS) -> int | None:
    """Index of ``mod``'s layer (longest matching prefix), or None when no layer names it."""
    best: tuple[int, int] | None = None
    for i, (_, prefixes) in enumerate(layers):
        for p in prefixes:
            inside = mod == p or (p != "apportion" and mod.startswith(p + "."))
            if inside and (best is None or len(p) > best[0]):
                best = (len(p), i)
    return None if best is None else best[1]


def upward(
    graph: Mapping[str, Mapping[str, int]], layers: tuple[tuple[str, tuple[str, ...]], ...] = LAYERS
) -> list[str]:
    """``module:line -> target`` for every import of a module from a higher layer."""
    out = []
    for mod, edges in sorted(graph.items()):
        for target, line in sorted(edges.items()):
            a, b = layer_of(mod, layers), layer_of(target, layers)
            if a is not None and b is not None and b > a:
                out.append(f"{mod}:{line} ({layers[a][0]}) -> {target} ({layers[b][0]})")
    return out


GRAPH = import_graph(module_files(ROOT))


def test_every_module_has_a_layer() -> None:
    assert [m for m in sorted(GRAPH) if layer_of(m) is None] == []


def test_no_import_circles() -> None:
    assert circles(GRAPH) == []


def test_no_upward_imports() -> None:
    assert upward(GRAPH) == []


def test_the_checks_see_a_circle_and_an_upward_import(tmp_path: Path) -> None:
    pkg = tmp_path / "shared" / "apportion"
    (pkg / "cli").mkdir(parents=True)
    (tmp_path / "services").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "events.py").write_text("def f():\n    from apportion.cli import main\n")  # hidden in a function
    (pkg / "cli" / "__init__.py").write_text("")
    (pkg / "cli" / "main.py").write_text("from . import helpers\nfrom apportion import events\n")
    (pkg / "cli" / "helpers.py").write_text("from apportion.cli.main import app\n")
    graph = import_graph(module_files(tmp_path))
    assert graph["apportion.cli.main"] == {"apportion.cli.helpers": 1, "apportion.events": 2}
    assert circles(graph) == [
        ["apportion.cli.helpers", "apportion.cli.main"],
        ["apportion.cli.main", "apportion.events"],
    ] or circles(graph) == [["apportion.cli.helpers", "apportion.cli.main", "apportion.events"]]
    assert upward(graph) == ["apportion.events:2 (contract) -> apportion.cli.main (entrypoints)"]
    assert layer_of("apportion.audit.invariants") == 2 and layer_of("apportion.audit.verify") == 3
