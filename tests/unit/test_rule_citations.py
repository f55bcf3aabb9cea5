"""Code cites the design contract in the repository by rule id (docs/design/README.md).

Every rule id ``D<N>.<name>`` cited in ``shared/``, ``services/``, ``tests/``, ``bench/`` and ``tools/`` is an id
the design contract defines (``<a id="D3.gangs">``), and every section cited as ``design D<N>`` is a section
anchor there. No file the repository tracks cites the design by section number ("DESIGN section N") or by the
name of a file outside the repository ("DESIGN.md"); the change log keeps the history.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DESIGN_DOC = ROOT / "docs" / "design" / "README.md"
CITING_DIRS = ("shared", "services", "tests", "bench", "tools")

RULE_ID = re.compile(r"\bD\d+\.[a-z][a-z0-9]*(?:-[a-z0-9]+)*\b")
SECTION_CITE = re.compile(r"\bdesign (D\d+)\b(?!\.[a-z])")
ANCHOR = re.compile(r'<a id="(D\d+(?:\.[a-z0-9-]+)?)"></a>')
OLD_CITATION = re.compile(r"DESIGN(?:\s+#:?)?\s+sections?\b|DESIGN\.md")

#: Files other work is moving right now; their old citations go when they land. Each entry names a file
#: that still cites "DESIGN section N" and must be emptied as soon as that file is rewritten.
ALLOWED_OLD_CITATIONS: frozenset[str] = frozenset(
    {
        "shared/apportion/cli/main.py",
        "shared/apportion/identity.py",
    }
)
#: History is allowed to name what was cited before.
HISTORY = frozenset({"CHANGELOG.md"})
THIS_FILE = "tests/unit/test_rule_citations.py"


def defined_ids(text: str) -> set[str]:
    """The rule and section ids the design contract defines (its anchors)."""
    return set(ANCHOR.findall(text))


def cited_ids(text: str) -> set[str]:
    """The rule ids (``D3.gangs``) and section ids (``design D3`` -> ``D3``) a text cites."""
    return set(RULE_ID.findall(text)) | set(SECTION_CITE.findall(text))


def unknown_citations(files: dict[str, str], ids: set[str]) -> list[tuple[str, str]]:
    """``(path, id)`` of every citation in ``files`` (path -> text) that ``ids`` does not define."""
    return sorted((path, cid) for path, text in files.items() for cid in cited_ids(text) if cid not in ids)


def old_citations(files: dict[str, str]) -> list[tuple[str, int]]:
    """``(path, line)`` of every "DESIGN section N" or "DESIGN.md" outside the history and the allow-list."""
    found = []
    for path, text in files.items():
        if path in HISTORY or path in ALLOWED_OLD_CITATIONS or path == THIS_FILE:
            continue
        for m in OLD_CITATION.finditer(text):
            found.append((path, text.count("\n", 0, m.start()) + 1))
    return sorted(found)


def _tracked_text_files() -> dict[str, str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    files = {}
    for rel in out.decode().split("\0"):
        path = ROOT / rel
        if not rel or not path.is_file():
            continue
        try:
            files[rel] = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
    return files


def _code_files() -> dict[str, str]:
    return {
        str(p.relative_to(ROOT)): p.read_text(encoding="utf-8")
        for d in CITING_DIRS
        for p in sorted((ROOT / d).rglob("*.py"))
        if str(p.relative_to(ROOT)) != THIS_FILE
    }


DOC_IDS = defined_ids(DESIGN_DOC.read_text(encoding="utf-8"))


def test_design_doc_defines_rules_and_sections() -> None:
    # 13 sections, each with its anchor, and the rule the example in the doc's own introduction names
    assert {f"D{n}" for n in range(1, 14)} <= DOC_IDS
    assert "D3.refused-starts" in DOC_IDS


def test_every_cited_rule_id_exists() -> None:
    assert unknown_citations(_code_files(), DOC_IDS) == []


def test_no_citation_of_design_sections_by_number() -> None:
    assert old_citations(_tracked_text_files()) == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("# protected for its minimum runtime (rule D3.gangs)", [], id="known-rule"),
        pytest.param('"""Placement (design D3)."""', [], id="known-section"),
        pytest.param("# see rule D3.no-such-rule", [("f.py", "D3.no-such-rule")], id="unknown-rule"),
        pytest.param("# see design D14", [("f.py", "D14")], id="unknown-section"),
        pytest.param("# rule D99.gangs and D3.gangs", [("f.py", "D99.gangs")], id="unknown-section-of-rule"),
    ],
)
def test_unknown_citation_is_found(text: str, expected: list[tuple[str, str]]) -> None:
    assert unknown_citations({"f.py": text}, DOC_IDS) == expected


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        pytest.param({"a.py": "x = 1  # (DESIGN section 3)"}, [("a.py", 1)], id="section"),
        pytest.param({"a.py": '"""x\n(DESIGN sections 1 and 3)."""'}, [("a.py", 2)], id="sections"),
        pytest.param({"a.py": "# the DESIGN\n# section 10"}, [("a.py", 1)], id="comment-continued"),
        pytest.param({"docs/x.md": "how DESIGN.md is implemented"}, [("docs/x.md", 1)], id="file-name"),
        pytest.param({"a.py": "# (rule D3.gangs)"}, [], id="rule-id"),
        pytest.param({"CHANGELOG.md": "cited DESIGN section 3"}, [], id="history"),
        pytest.param({"shared/apportion/identity.py": "(DESIGN section 10)"}, [], id="allow-listed"),
    ],
)
def test_old_citation_is_found(files: dict[str, str], expected: list[tuple[str, int]]) -> None:
    assert old_citations(files) == expected
