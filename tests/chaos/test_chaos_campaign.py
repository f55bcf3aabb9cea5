"""The short seeded chaos campaign (``bench/chaos.py --quick``): its own broker and Redis, kills, a broker
kill -9, a Redis restart and 300 hostile records during a 30-job replay of signed submissions; every figure
of its last line must be right (exit status 0). Seed 7 is the one that failed ``audit verify`` on an
accounting snapshot (docs/reliability.md). About 2 minutes on the loaded 2-core machine; in ``make test``.
The full campaign is ``make chaos``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(540)
def test_short_chaos_campaign_loses_nothing_and_verifies() -> None:
    out = subprocess.Popen(
        [sys.executable, str(REPO / "bench" / "chaos.py"), "--quick", "--seed", "7"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = out.communicate(timeout=440)
    except subprocess.TimeoutExpired:
        out.terminate()  # SIGTERM: the campaign stops its services, broker and Redis (a SIGKILL would leave them)
        stdout, stderr = out.communicate(timeout=90)
    last = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    assert out.returncode == 0, f"{stdout[-3000:]}\n{stderr[-3000:]}"
    m = re.fullmatch(
        r"chaos: kills (\d+), broker kills (\d+), hostile (\d+) \((\d+) dead-lettered\), submitted (\d+), lost 0, "
        r"double-booked 0, protection violations 0, failed by restart 0, audit verify ok",
        last,
    )
    assert m, last
    kills, broker, hostile, dead, submitted = map(int, m.groups())
    assert (kills, broker, hostile, submitted) == (4, 1, 300, 30)
    assert 250 <= dead < hostile  # the poison ones (about 10/11); the rest name unknown entities
