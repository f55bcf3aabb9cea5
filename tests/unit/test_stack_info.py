"""`stack up`'s record of a stack with and without the dashboard, and the dashboard's read-only credentials."""

from __future__ import annotations

import os
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

from apportion.cli.stack import SERVICES, WEB, StackInfo, _as_web


def _info(tmp_path: Path, *, web: bool) -> StackInfo:
    info = StackInfo(tmp_path, "127.0.0.1:9092", "redis://127.0.0.1:6379/0", "p.")
    for i, name in enumerate(n for n in SERVICES if web or n != WEB):
        info.pids[name] = 1000 + i
        info.metrics[name] = 7000 + i
    return info


def test_the_dashboard_is_written_read_back_and_described_at_its_port(tmp_path: Path) -> None:
    info = _info(tmp_path, web=True)
    assert SERVICES[-1] == WEB  # started last, so `down` (reverse order) stops it first
    (tmp_path / "stack.env").write_text("\n".join(info.env_lines()) + "\n")
    back = StackInfo.read(tmp_path)
    assert back is not None and back.pids == info.pids and back.metrics == info.metrics
    assert back.web_url == "http://127.0.0.1:7004/"
    assert "WEB_URL=http://127.0.0.1:7004/" in info.env_lines()
    assert "dashboard http://127.0.0.1:7004/ (read-only, 127.0.0.1)" in back.describe()


def test_without_the_dashboard_nothing_names_it(tmp_path: Path) -> None:
    info = _info(tmp_path, web=False)
    assert info.web_url == ""
    assert not [ln for ln in info.env_lines() if "WEB" in ln]
    assert not [ln for ln in info.describe() if ln.startswith(("dashboard", "web"))]


def test_the_dashboard_connects_as_web_with_the_password_files_and_drops_anothers_password(tmp_path: Path) -> None:
    kafka, redis = tmp_path / "kafka", tmp_path / "redis"
    for d in (kafka, redis):
        d.mkdir()
        (d / "web.password").write_text("s3cret\n")
    info = StackInfo(tmp_path, "b", "r")
    env = {
        "APPORTION_KAFKA_USER": "admin",
        "APPORTION_KAFKA_PASSWORD": "admins",
        "APPORTION_KAFKA_SECRETS_DIR": str(kafka),
        "APPORTION_REDIS_USER": "admin",
        "APPORTION_REDIS_PASSWORD": "admins",
        "APPORTION_REDIS_SECRETS_DIR": str(redis),
    }
    _as_web(info, env)  # an external stack: the caller (admin) names the secrets directories
    assert env == {
        "APPORTION_KAFKA_USER": "web",
        "APPORTION_KAFKA_PASSWORD_FILE": str(kafka / "web.password"),
        "APPORTION_KAFKA_SECRETS_DIR": str(kafka),
        "APPORTION_REDIS_USER": "web",
        "APPORTION_REDIS_PASSWORD_FILE": str(redis / "web.password"),
        "APPORTION_REDIS_SECRETS_DIR": str(redis),
    }


def test_without_a_web_password_the_dashboard_keeps_the_callers_credentials(tmp_path: Path) -> None:
    env = {"APPORTION_KAFKA_USER": "ops", "APPORTION_KAFKA_SECRETS_DIR": str(tmp_path)}
    _as_web(StackInfo(tmp_path, "b", "r"), env)
    assert env == {"APPORTION_KAFKA_USER": "ops", "APPORTION_KAFKA_SECRETS_DIR": str(tmp_path)}


@pytest.mark.parametrize(("flags", "web"), [((), True), (("--no-web",), False)])
def test_stack_up_starts_the_dashboard_unless_told_not_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: tuple[str, ...], web: bool
) -> None:
    from typer.testing import CliRunner

    from apportion.cli import stack as stack_mod
    from apportion.cli.main import app

    asked: dict[str, object] = {}

    def fake_up(run_dir: Path, **kw: object) -> StackInfo:  # what `up` was asked for; nothing is started
        asked.update(kw)
        return _info(tmp_path, web=bool(kw["web"]))

    monkeypatch.setattr(stack_mod, "up", fake_up)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    res = CliRunner().invoke(app, ["stack", "up", "--dir", str(tmp_path), *flags])
    assert res.exit_code == 0, res.output
    assert asked["web"] is web and asked["simulate_json"] == []
    assert ("dashboard http://127.0.0.1:7004/ (read-only, 127.0.0.1)" in res.stdout) is web


def _serve(status: int, body: bytes) -> tuple[ThreadingHTTPServer, int]:
    """A real HTTP server on a free 127.0.0.1 port answering every GET with ``status`` and ``body``."""
    import threading
    from http.server import BaseHTTPRequestHandler

    class H(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # the http.server name
            self.send_response(status)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, srv.server_address[1]


def test_status_probes_kafka_redis_and_each_services_ready(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from kafka.errors import KafkaTimeoutError

    from apportion.cli import verdicts
    from apportion.cli.stack import probe

    def unreachable(bootstrap: str) -> None:
        """What kafka-python raises when nothing answers, without a real consumer: one that fails to bootstrap
        leaves its network thread running (there is no client to close) for the rest of the test process."""
        raise KafkaTimeoutError(f"Unable to bootstrap from {bootstrap}")

    monkeypatch.setattr(verdicts, "_consumer", unreachable)
    ready, ready_port = _serve(200, b'{"ready": true}')
    busy, busy_port = _serve(503, b'{"ready": false, "kafka": "down"}')
    try:
        info = StackInfo(tmp_path, "127.0.0.1:1", "redis://127.0.0.1:1/0")  # nothing listens on port 1
        info.pids = {"policy": os.getpid(), "dispatcher": os.getpid(), "accounting": os.getpid()}
        info.metrics = {"policy": ready_port, "dispatcher": busy_port, "accounting": 1}
        got = probe(info, timeout_s=2.0)
        assert (got["kafka"].ok, got["redis"].ok) == (False, False)
        assert got["kafka"].detail == "KafkaTimeoutError: KafkaTimeoutError: Unable to bootstrap from 127.0.0.1:1"
        assert (got["policy"].ok, got["policy"].detail) == (True, "200")
        assert (got["dispatcher"].ok, got["dispatcher"].detail) == (False, '503 {"ready": false, "kafka": "down"}')
        assert got["accounting"].ok is False and got["accounting"].detail.startswith("no answer at http://127.0.0.1:1/")
        lines = info.describe(got)
        assert lines[0].startswith("Kafka    127.0.0.1:1 NOT ANSWERING: ")
        assert lines[1].startswith("Redis    redis://127.0.0.1:1/0 NOT ANSWERING: ")
        [pol] = [ln for ln in lines if ln.startswith("policy")]
        assert pol.endswith(f"metrics http://127.0.0.1:{ready_port}/metrics ready")
        [dis] = [ln for ln in lines if ln.startswith("dispatcher")]
        assert dis.endswith('NOT READY: 503 {"ready": false, "kafka": "down"}')
    finally:
        for srv in (ready, busy):
            srv.shutdown()


def test_restart_refuses_without_a_stack_a_service_or_a_record_of_its_start(tmp_path: Path) -> None:
    from apportion.cli.stack import StackUpError, restart

    with pytest.raises(StackUpError, match=f"no stack started from {tmp_path}"):
        restart(tmp_path, "policy", say=lambda *_: None)
    info = _info(tmp_path, web=False)
    (tmp_path / "stack.env").write_text("\n".join(info.env_lines()) + "\n")
    with pytest.raises(StackUpError, match="no service 'web' in the stack at .*services: accounting, dispatcher"):
        restart(tmp_path, "web", say=lambda *_: None)
    with pytest.raises(StackUpError, match="no record of how policy was started .*`apportion stack down` and `up`"):
        restart(tmp_path, "policy", say=lambda *_: None)


def test_other_users_get_a_stack_env_without_credentials_and_a_readable_ca(tmp_path: Path, monkeypatch) -> None:
    """``stack up`` made by root: other users' CLI reads ``RUN_DIR/researcher/stack.env`` (0644): the addresses,
    namespace, clock, dashboard and a copy of the CA (0644), and none of the owner's credentials, keyring or
    secrets directories, which stay in ``RUN_DIR/stack.env``."""
    from apportion.bus.stack import read_env_file
    from apportion.cli.stack import _write_state

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    ca = tmp_path / "tls" / "ca.pem"
    ca.parent.mkdir(mode=0o700)
    ca.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    ca.chmod(0o600)
    info = _info(tmp_path, web=True)
    info.kafka_secrets, info.redis_secrets = str(tmp_path / "kafka"), str(tmp_path / "redis")
    info.keyring, info.tls_ca = str(tmp_path / "keyring"), str(ca)
    info.clock = {"APPORTION_TIME_SCALE": "60"}
    _write_state(info)
    shared = tmp_path / "researcher"
    assert read_env_file(shared / "stack.env") == {
        "KAFKA_BOOTSTRAP": "127.0.0.1:9092",
        "REDIS_URL": "redis://127.0.0.1:6379/0",
        "APPORTION_TOPIC_PREFIX": "p.",
        "APPORTION_TLS_CA": str(shared / "ca.pem"),
        "APPORTION_TIME_SCALE": "60",
        "WEB_URL": "http://127.0.0.1:7004/",
    }
    modes = {p.name: p.stat().st_mode & 0o777 for p in (shared, shared / "stack.env", shared / "ca.pem")}
    assert modes == {"researcher": 0o755, "stack.env": 0o644, "ca.pem": 0o644}
    assert (shared / "ca.pem").read_text() == ca.read_text()
    owner = read_env_file(tmp_path / "stack.env")  # the owner's: what the researcher file leaves out
    assert {"APPORTION_KAFKA_USER", "APPORTION_KAFKA_PASSWORD_FILE", "APPORTION_KEYRING"} <= set(owner)


def test_the_owners_stack_env_and_its_per_user_copy_are_private_from_the_first_write(
    tmp_path: Path, monkeypatch
) -> None:
    """The owner's ``stack.env`` names the owner's principal, password files and keyring: 0600 from the write on,
    both the run directory's and the per-user copy, whatever the umask (the node agent narrowed only the first,
    and only once it started)."""
    from apportion import settings
    from apportion.cli.stack import _write_state

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    info = _info(tmp_path, web=True)
    info.keyring = str(tmp_path / "keyring")
    old = os.umask(0o022)
    try:
        _write_state(info)
    finally:
        os.umask(old)
    for path in (tmp_path / "stack.env", settings.user_stack_env()):
        assert path.stat().st_mode & 0o777 == 0o600, path
        assert f"APPORTION_KEYRING={info.keyring}" in path.read_text()


#: What the dispatcher logged in an earlier `up` of the same run directory (its log is appended to).
EARLIER_RUN = (
    "dispatcher: leading with fencing token 1\n"
    "dispatcher: started from offset 0: 90 records read, rebuilt in 0.20 s\n"
    "dispatcher: stopped\n"
)


def test_up_in_a_used_run_directory_waits_for_this_starts_rebuild_not_the_earlier_runs_line(tmp_path: Path) -> None:
    import os

    from apportion.cli.stack import StackUpError, _log_end, wait_ready

    info = _info(tmp_path, web=False)
    info.pids["dispatcher"] = os.getpid()  # alive
    info.log_dir.mkdir(parents=True)
    log = info.log_dir / "dispatcher.log"
    log.write_text(EARLIER_RUN)
    since = {"dispatcher": _log_end(info, "dispatcher")}
    with log.open("a") as f:  # this start: elected, its read models not yet rebuilt
        f.write("dispatcher: leading with fencing token 2\n")
    with pytest.raises(StackUpError) as got:
        wait_ready(info, since, timeout_s=0)
    assert str(got.value) == f"dispatcher not ready within 0 s; see the logs in {info.log_dir}"
    with log.open("a") as f:
        f.write("dispatcher: started from a snapshot: 12 records read, rebuilt in 0.31 s\n")
    wait_ready(info, since, timeout_s=0)


def test_a_service_that_exits_before_it_is_ready_is_named_with_its_log(tmp_path: Path) -> None:
    from apportion.cli.stack import StackUpError, wait_ready

    info = _info(tmp_path, web=False)
    info.pids["policy"] = 2**22 + 1  # above pid_max's default: no such process
    with pytest.raises(StackUpError) as got:
        wait_ready(info, {"policy": 0})
    assert str(got.value) == f"policy exited at start; see {info.log_dir / 'policy.log'}"


def test_infra_ups_stack_env_is_private_from_the_first_write(tmp_path: Path) -> None:
    """`make infra-up`'s ``DATADIR/stack.env`` names the admin's password file: 0600 whatever the umask."""
    from apportion.bus.stack import LocalStack

    stack = LocalStack(tmp_path / "data", kafka_port=19092, redis_port=16379, provision_topics=False)
    stack.datadir.mkdir()
    stack.kafka_secrets = tmp_path / "secrets"
    old = os.umask(0o022)
    try:
        stack.write_env_file()
    finally:
        os.umask(old)
    assert stack.env_file.stat().st_mode & 0o777 == 0o600
    assert f"APPORTION_KAFKA_PASSWORD_FILE={tmp_path / 'secrets' / 'admin.password'}" in stack.env_file.read_text()


def test_every_line_fits_80_columns_for_a_checkout_in_a_home_folder() -> None:
    info = StackInfo(Path("/home/alice/apportion/.run"), "127.0.0.1:45147", "rediss://127.0.0.1:44561/0", "")
    for i, name in enumerate(SERVICES):
        info.pids[name] = 27372 + i
        info.metrics[name] = 55845 + i
    lines = info.describe()
    assert [ln for ln in lines if len(ln) > 80] == []
    assert "logs     /home/alice/apportion/.run/logs (services)" in lines
    assert "job logs /home/alice/apportion/.run/node_agent/job-logs (`apportion logs JOB`)" in lines


def test_status_json_carries_every_folder_the_text_shows() -> None:
    from apportion.cli.stack import Probe

    info = StackInfo(Path("/home/alice/apportion/.run"), "127.0.0.1:45147", "rediss://127.0.0.1:44561/0", "")
    info.pids, info.metrics = {"policy": os.getpid()}, {"policy": 55845}
    doc = info.status_doc({"kafka": Probe(True), "redis": Probe(True), "policy": Probe(True, "200")})
    assert (doc["log_dir"], doc["job_log_dir"]) == (
        "/home/alice/apportion/.run/logs",
        "/home/alice/apportion/.run/node_agent/job-logs",
    )
    assert doc["services"]["policy"] == {
        "pid": os.getpid(),
        "running": True,
        "metrics": "http://127.0.0.1:55845/metrics",
        "ready": {"ok": True, "detail": "200"},
    }


def test_status_json_without_a_stack_is_the_json_error_object_exit_3(tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from apportion.cli.main import app

    res = CliRunner().invoke(app, ["stack", "status", "--dir", str(tmp_path), "--json"])
    assert res.exit_code == 3
    assert json.loads(res.stdout) == {
        "ok": False,
        "verdict": "unreachable",
        "reason": "",
        "message": f"no stack started from {tmp_path.resolve()} (`apportion stack up`)",
        "exit_code": 3,
    }
