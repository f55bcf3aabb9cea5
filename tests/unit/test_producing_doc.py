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


def test_the_console_examples_sign_in_with_the_properties_file_the_sign_in_block_writes() -> None:
    # the broker takes SASL_SSL only: a console tool given the bootstrap alone gets no answer
    for block in re.findall(r"```sh\n(.*?)```", DOC, re.S):
        for tool in ("producer", "consumer"):
            if f"console-{tool}.sh" in block:
                assert f"--{tool}.config client.properties" in block, block


def _sign_in(tmp_path: Path, extra_env: dict[str, str]) -> tuple[str, int]:
    (tmp_path / "owner.password").write_text("s3cret\n")
    (tmp_path / "stack.env").write_text(
        "KAFKA_BOOTSTRAP=127.0.0.1:41234\nAPPORTION_TOPIC_PREFIX=\nAPPORTION_TLS_CA=/run/ca.pem\n"
        f"APPORTION_KAFKA_USER=ops\nAPPORTION_KAFKA_PASSWORD_FILE={tmp_path / 'owner.password'}\n"
    )
    script = f'STACK_ENV="{tmp_path / "stack.env"}"\n' + _block_after("## Signing in") + 'echo "$APPORTION_TLS_CA"\n'
    out = subprocess.run(
        ["bash", "-euc", script],
        cwd=tmp_path,
        env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin", **extra_env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    props = tmp_path / "client.properties"
    return out + props.read_text(), props.stat().st_mode & 0o777


def test_the_sign_in_block_writes_the_stack_owners_login_from_stack_env(tmp_path: Path) -> None:
    text, mode = _sign_in(tmp_path, {})
    assert text == (
        "/run/ca.pem\n"
        "security.protocol=SASL_SSL\nsasl.mechanism=SCRAM-SHA-512\n"
        "sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required "
        'username="ops" password="s3cret";\n'
    )
    assert mode == 0o600


def test_a_researchers_own_login_from_the_environment_wins_over_stack_env(tmp_path: Path) -> None:
    (tmp_path / "mine.password").write_text("r3search")
    env = {"APPORTION_KAFKA_USER": "researcher", "APPORTION_KAFKA_PASSWORD_FILE": str(tmp_path / "mine.password")}
    text, _ = _sign_in(tmp_path, env)
    assert 'username="researcher" password="r3search";' in text
