"""The infra/ start scripts notice a broker that dies instead of waiting out a timeout."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

INFRA = Path(__file__).resolve().parents[2] / "infra"


def test_kafka_start_fails_fast_and_cleans_up_when_its_port_is_taken(tmp_path: Path) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        t0 = time.monotonic()
        proc = subprocess.run(
            ["bash", str(INFRA / "kafka/start.sh"), str(port), str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )
        elapsed = time.monotonic() - t0
    assert proc.returncode == 1
    assert "exited before the broker answered" in proc.stderr
    assert "Address already in use" in proc.stderr  # the cause, not just a timeout
    assert elapsed < 60  # well under the 90 s readiness deadline
    assert not (tmp_path / "kafka.pid").exists()
    ours = subprocess.run(["pgrep", "-f", f"kafka\\.Kafka {tmp_path}/"], capture_output=True)
    assert ours.returncode == 1, "no broker for this data dir may be left running"
