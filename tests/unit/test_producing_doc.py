"""docs/producing.md finds the stack's Kafka instead of hard-coding a port (`make up` picks free ones)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs/producing.md").read_text()


def _block_after(heading: str) -> str:
    rest = DOC[DOC.index(heading) :]
    found = re.search(r"```sh\n(.*?)```", rest, re.S)
    assert found is not None, heading
    return found.group(1)


def test_no_fixed_local_kafka_port_in_the_examples() -> None:
    for block in re.findall(r"```sh\n(.*?)```", DOC, re.S):
        assert "127.0.0.1:9092" not in block and "localhost:9092" not in block
        if "console-" in block:
            assert '--bootstrap-server "$BOOTSTRAP"' in block and "${PREFIX}apportion." in block


def test_the_where_block_reads_the_per_user_state_file_the_stack_writes(tmp_path: Path) -> None:
    # a stack.env as `apportion stack up` writes it (apportion.cli.stack.StackInfo.env_lines), found from any folder
    state = tmp_path / "state" / "apportion"
    state.mkdir(parents=True)
    (state / "stack.env").write_text(
        "# written by `apportion stack up`; read by the apportion CLI\n"
        "KAFKA_BOOTSTRAP=127.0.0.1:41234\nREDIS_URL=redis://127.0.0.1:41235/0\nAPPORTION_TOPIC_PREFIX=me.\n"
    )
    out = subprocess.run(
        ["bash", "-euc", _block_after("## Where the stack is")],
        cwd=tmp_path,
        env={"XDG_STATE_HOME": str(tmp_path / "state"), "HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out == "Kafka at 127.0.0.1:41234, submissions on me.apportion.submissions\n"
