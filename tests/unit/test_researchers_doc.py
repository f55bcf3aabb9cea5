"""docs/researchers.md's table of pending reasons names every reason `apportion queue` can give."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args

from apportion.domain.engine.reasons import PendingReason

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs/researchers.md").read_text()


def test_every_pending_reason_kind_has_a_row() -> None:
    kinds = {cls.kind for cls in get_args(PendingReason)}
    rows = {
        k for line in DOC.splitlines() if line.startswith("| `") for k in re.findall(r"`([a-z_]+)`", line.split("|")[1])
    }
    assert kinds - rows == set()
