"""docs/researchers.md against the code: every pending reason `apportion queue` can give has a row, and what a
command needs on its node (its account; no `--duration` beside it on a simulated node) is said."""

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


def test_the_page_names_the_refusal_a_command_meets_on_a_node_without_the_users_account() -> None:
    """A researcher's first command (`submit ... -- python train.py`) fails at its start on a node without their
    Unix account: the page says so, with the reason `history` and `queue` show."""
    from services.node_agent.logic import NO_ACCOUNT

    assert f"`{NO_ACCOUNT}`" in DOC


def test_the_page_says_a_duration_takes_the_place_of_a_command_on_a_simulated_node() -> None:
    """`submit --duration 30s -- CMD` on a simulated node runs simulated and never starts CMD (the node agent's
    rule: a process only where the node is real or the job has no duration): the page says so."""
    from services.node_agent import logic

    assert "has no ``duration_s``), else as a simulated workload" in (logic.__doc__ or "")
    assert "a job given both runs simulated and its command never starts" in DOC
