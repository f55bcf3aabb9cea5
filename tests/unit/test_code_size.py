"""Code size of the domain (``D13.code-size``): no function in ``shared/apportion/domain`` is over 120 lines, and
the scheduling cycle's phases (``domain/engine/cycle.py``) take at most 6 parameters (one per-cycle context
instead of a dozen arguments). Ruff's statement and argument ceilings apply to the whole tree; these two are the
domain's own, tighter bounds."""

from __future__ import annotations

import ast
from pathlib import Path

DOMAIN = Path(__file__).resolve().parents[2] / "shared" / "apportion" / "domain"
MAX_LINES = 120
MAX_CYCLE_PARAMS = 6


def functions(path: Path) -> list[tuple[str, int, int]]:
    """(name, lines, parameters other than self/cls) of every function and method in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs]
            n = len(params) - (1 if params and params[0].arg in ("self", "cls") else 0)
            out.append((node.name, (node.end_lineno or node.lineno) - node.lineno + 1, n))
    return out


def test_no_domain_function_is_over_120_lines() -> None:
    long = [
        f"{p.relative_to(DOMAIN)}:{name} ({lines} lines)"
        for p in sorted(DOMAIN.rglob("*.py"))
        for name, lines, _ in functions(p)
        if lines > MAX_LINES
    ]
    assert long == []


def test_the_cycles_phases_take_at_most_6_parameters() -> None:
    wide = [f"{name} ({n})" for name, _, n in functions(DOMAIN / "engine" / "cycle.py") if n > MAX_CYCLE_PARAMS]
    assert wide == []


def test_the_measure_sees_a_long_function(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("def f(self, a, b, *, c):\n" + "    x = 1\n" * 130)
    assert functions(src) == [("f", 131, 3)]
