"""The generated rules page (``tools/docs_hooks.rules_page``): each rule of the design contract with the code
that cites it and the tests that name it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tools import docs_hooks


def row(page: str, rid: str) -> str:
    [line] = [ln for ln in page.splitlines() if ln.startswith(f"| [`{rid}`]")]
    return line


def test_every_rule_of_the_contract_has_one_row() -> None:
    page = docs_hooks.rules_page()
    design = (docs_hooks.ROOT / "docs" / "design" / "README.md").read_text()
    ids = re.findall(r'<a id="(D\d+\.[a-z0-9-]+)"></a>', design)
    assert len(ids) == len(set(ids)) > 50
    assert list(re.findall(r"^\| \[`(D\d+\.[a-z0-9-]+)`\]", page, flags=re.M)) == ids


def test_a_rule_names_its_home_and_its_tests() -> None:
    line = row(docs_hooks.rules_page(), "D13.code-size")
    assert "`tests/unit/test_code_size.py`" in line  # it cites the rule in its docstring
    line = row(docs_hooks.rules_page(), "D1.node")
    assert line.split(" | ")[2] == "`shared/apportion/domain/nodes.py`"


def test_citations_are_found_per_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("# rule D3.gangs and rule D3.gangs again, design D3\n")
    (tmp_path / "pkg" / "b.py").write_text('"""D10.proven-user."""\n')
    monkeypatch.setattr(docs_hooks, "ROOT", tmp_path)
    assert docs_hooks._citing(("pkg",)) == {"D3.gangs": {"pkg/a.py"}, "D10.proven-user": {"pkg/b.py"}}
