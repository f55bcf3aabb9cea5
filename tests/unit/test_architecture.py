"""The rooms of the house and what each may import (docs/architecture.md), checked statically with ``ast``.

* the domain imports only the domain and the event contract (no bus, sim, audit, CLI, services);
* the simulator imports no I/O layer (bus, services, CLI);
* the shared library never imports a service;
* a service imports the shared library (its plumbing: ``apportion.bus.service``), never another service.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "shared" / "apportion"

#: room -> apportion modules it may import (prefixes); anything else under ``apportion`` is refused
ALLOWED: dict[str, tuple[str, ...]] = {
    "domain": (
        "apportion.domain",
        "apportion.events",
        "apportion.arrays",
        "apportion.durations",
        "apportion.timeutil",
        "apportion.topics",
    ),
    "sim": (
        "apportion.sim",
        "apportion.domain",
        "apportion.events",
        "apportion.arrays",
        "apportion.timeutil",
        "apportion.topics",
        "apportion.yamlio",
        "apportion.budgetfile",
        "apportion.durations",
        "apportion.report",
        "apportion.audit.invariants",
    ),
}


def _imports(path: Path) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_room_imports_only_what_it_may(room: str) -> None:
    bad = [
        f"{_rel(f)}:{line}: {mod}"
        for f in sorted((PKG / room).rglob("*.py"))
        for line, mod in _imports(f)
        if (mod == "apportion" or mod.startswith("apportion."))
        and not any(mod == a or mod.startswith(a + ".") for a in ALLOWED[room])
    ]
    assert bad == []


def test_shared_library_never_imports_a_service() -> None:
    bad = [
        f"{_rel(f)}:{line}: {mod}"
        for f in sorted(PKG.rglob("*.py"))
        for line, mod in _imports(f)
        if mod == "services" or mod.startswith("services.")
    ]
    assert bad == []


def test_services_never_import_each_other() -> None:
    bad = []
    for f in sorted((ROOT / "services").rglob("*.py")):
        parts = f.relative_to(ROOT / "services").parts
        own = parts[0] if len(parts) > 1 else None
        for line, mod in _imports(f):
            bits = mod.split(".")
            if bits[0] == "services" and len(bits) > 1 and bits[1] != own:
                bad.append(f"{_rel(f)}:{line}: {mod}")
    assert bad == []


def test_the_checks_see_a_forbidden_import(tmp_path: Path) -> None:
    f = tmp_path / "x.py"
    f.write_text("import os\nfrom apportion.bus.producer import EventProducer\nfrom services.policy import logic\n")
    assert [m for _, m in _imports(f)] == ["os", "apportion.bus.producer", "services.policy"]


def test_only_the_audit_source_reads_kafka() -> None:
    """Log records and their order are pure (``apportion.logrecord``): the audit reads Kafka in one module."""
    kafka = ("kafka", "aiokafka", "apportion.bus.reader", "apportion.bus.consumer", "apportion.bus.producer")
    bad = [
        f"{_rel(f)}:{line}: {mod}"
        for f in sorted((PKG / "audit").rglob("*.py"))
        if f.name != "source.py"
        for line, mod in _imports(f)
        if any(mod == k or mod.startswith(k + ".") for k in kafka)
    ]
    assert bad == []
