"""Docs, comments and docstrings describe the product as it is, not how it was built.

No issue numbers and no numbered or ordinal development sessions in README.md, mkdocs.yml, ``docs/``,
``shared/``, ``services/`` and ``tools/``. History belongs in CHANGELOG.md and git. A Kafka, HTTP or
supervised session is the word's ordinary meaning and passes.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DIARY = re.compile(
    r"\bissues? #?\d+\b"
    r"|\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|\w+teenth|\w+tieth|\w+ieth|\d+(?:st|nd|rd|th))"
    r"[ -]session\b"
    r"|\bsessions? \d+\b",
    re.IGNORECASE,
)


def _files() -> list[Path]:
    out = [ROOT / "README.md", ROOT / "mkdocs.yml"]
    for folder, pattern in (("docs", "*.md"), ("shared", "*.py"), ("services", "*.py"), ("tools", "*.py")):
        out += sorted((ROOT / folder).rglob(pattern))
    return out


def diary_words(text: str) -> list[str]:
    """``line: match`` of every mention of an issue number or a development session in ``text``."""
    return [f"{i}: {m.group(0)}" for i, line in enumerate(text.splitlines(), 1) for m in DIARY.finditer(line)]


def test_no_issue_numbers_or_sessions_in_the_docs_or_the_code() -> None:
    found = {str(p.relative_to(ROOT)): hits for p in _files() if (hits := diary_words(p.read_text()))}
    assert found == {}


@pytest.mark.parametrize(
    "text",
    [
        "never stop (issue 17)",
        "issues 13 and 18",
        "see issue #4",
        "Sixteenth session: target by target",
        "the 14th session",
        "session 12 found it",
    ],
)
def test_the_check_finds_diary_words(text: str) -> None:
    assert diary_words(text) != []


@pytest.mark.parametrize(
    "text",
    [
        "faust's 60 s session timeout",
        "a failed session started again",
        "session fixtures",
        "an HTTP session",
        "the issue",
    ],
)
def test_the_ordinary_meanings_pass(text: str) -> None:
    assert diary_words(text) == []
