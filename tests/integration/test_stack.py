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
    assert tmp_path.stat().st_mode & 0o777 == 0o700  # private from the start (test below)


def test_the_data_directories_are_private_to_the_stack(tmp_path: Path) -> None:
    """The Kafka log holds every job's command and environment and the metadata every principal's SCRAM record:
    a job account (another uid on the node) must not read them past the ACLs, so each start script makes its data
    directory 0700 (docs/security.md, "Node boundary")."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    redis_dir = tmp_path / "redis"
    redis_dir.mkdir(mode=0o755)
    proc = subprocess.run(
        ["bash", str(INFRA / "redis/start.sh"), str(port), str(redis_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    try:
        assert proc.returncode == 0, proc.stderr
        assert redis_dir.stat().st_mode & 0o777 == 0o700
    finally:
        subprocess.run(["bash", str(INFRA / "redis/stop.sh"), str(redis_dir)], capture_output=True, timeout=60)
