"""``apportion stack up|down|status``: an interactive local stack in one command.

``up`` starts (or reuses) a native Kafka and Redis from ``infra/``
(:mod:`apportion.bus.stack`), provisions the topics of the namespace, starts
the four services as processes (``python -m services.<name>``, the node agent
with ``--sim-nodes``) and the read-only web dashboard (``services.web``, on a
free port of 127.0.0.1; ``--no-web`` leaves it out), waits until each says it
is ready, and writes where everything is to ``RUN_DIR/stack.env`` and to the
per-user state file (:func:`apportion.settings.user_stack_env`), so the CLI
finds the stack from any folder::

    RUN_DIR/stack.env          KAFKA_BOOTSTRAP, REDIS_URL, APPORTION_TOPIC_PREFIX, APPORTION_KEYRING, LOG_DIR, metrics
                               ports, WEB_URL (the dashboard; its own metrics at WEB_URL/metrics)
    RUN_DIR/keyring/           the development keyring: ops.json and each user enrolled on first use
    RUN_DIR/services/NAME.pid  one per service
    RUN_DIR/logs/NAME.log      each service's log (plain text)
    RUN_DIR/node_agent/        the node agent's journal, the jobs' checkpoints/ and job-logs/
    RUN_DIR/kafka, RUN_DIR/redis   broker and Redis data, logs and pid files (when started here)
    RUN_DIR/tls/               the local CA and the certificate Kafka and Redis present (when started here;
                               stack.env's APPORTION_TLS_CA names the CA every client verifies them against)
    RUN_DIR/researcher/        for the CLI of other users (modes 0755, 0644): stack.env with the addresses,
                               namespace, clock and dashboard but no credential, and ca.pem, a copy of the CA

``down`` stops every process ``up`` started (SIGTERM, then SIGKILL after a
grace period), then Kafka and Redis if ``up`` started them, removes both
state files and leaves ``RUN_DIR/researcher/stack.env`` as the marker of a
stopped stack (:func:`mark_stopped`). Metrics endpoints and the dashboard bind
127.0.0.1 on free ports, printed by ``up`` and ``status``.

Principals (``docs/security.md``): with a secured Kafka and Redis started here,
each service connects as its own Kafka principal, and the dashboard as ``web``
(read-only on Kafka and Redis). With ``--bootstrap``/``--redis`` the services
use the caller's credentials, except the dashboard, which is ``web`` whenever
the caller names the secrets directories (``APPORTION_KAFKA_SECRETS_DIR``,
``APPORTION_REDIS_SECRETS_DIR``: the caller is those servers' admin, as the
test fixtures are). Nothing here runs at import time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from apportion.bus.security import (
    NO_TLS_SETTING,
    NODE_AGENTS_SETTING,
    TLS_CA_SETTING,
    principal_env,
    redis_env,
    service_credentials,
)
from apportion.cli.common import fail, json_option
from apportion.domain.dispatch import DEFAULT_HEARTBEAT_TIMEOUT_S
from apportion.privatefiles import private_dir, write_private

#: The services in start order (the policy first: the others read the tree it validates); the dashboard last,
#: so ``down`` (reverse order) stops it first.
SERVICES = ("policy", "accounting", "dispatcher", "node_agent", "web")

#: The name of the stack's one node agent (it hosts every simulated node): its Kafka principal is
#: ``node-agent.local`` (:func:`apportion.bus.security.node_agent_principal`), declared when the stack provisions.
STACK_AGENT = "local"

#: The read-only dashboard's name in :data:`SERVICES` (``--no-web`` leaves it out).
WEB = "web"

#: Names of the stack's simulated nodes: ``sim-0`` .. (``apportion.gpu.sim_node_ids``).
SIM_PREFIX = "sim-"

#: A line each service logs once it is ready (looked for in what it logged since its start: a log is appended to).
READY_LINE = {
    "policy": "caught up:",
    "accounting": "started by",
    # once it leads with its state rebuilt and its read models written: `queue` right after `up` shows the jobs
    "dispatcher": "started from ",
    "node_agent": "registered ",
    "web": "Uvicorn running on",  # uvicorn's line once the socket is bound
}

#: Wall seconds ``up`` waits for every service to be ready.
READY_TIMEOUT_S = 120.0

#: Wall seconds ``down`` waits after SIGTERM before SIGKILL.
STOP_GRACE_S = 15.0


class StackUpError(RuntimeError):
    """The stack could not be started (the message says which part and where its log is)."""


def default_run_dir() -> Path:
    """``.run`` of the source checkout this package runs from, else ``$XDG_STATE_HOME/apportion/run``."""
    from apportion.bus.stack import DEFAULT_INFRA_DIR
    from apportion.settings import user_state_dir

    checkout = DEFAULT_INFRA_DIR.parent
    if (checkout / "infra").is_dir() and os.access(checkout, os.W_OK):
        return checkout / ".run"
    return user_state_dir() / "run"


@dataclass
class StackInfo:
    """Where a stack's parts are (the content of its ``stack.env``)."""

    run_dir: Path
    bootstrap: str
    redis_url: str
    prefix: str = ""
    infra: str = "local"  # local: started here (down stops it); external: given with --bootstrap/--redis
    pids: dict[str, int] = field(default_factory=dict)
    metrics: dict[str, int] = field(default_factory=dict)
    clock: dict[str, str] = field(default_factory=dict)
    keyring: str = ""  # the development keyring (apportion.identity): users enrolled on first use
    kafka_secrets: str = ""  # the broker's password files; the CLI connects as ops (apportion.bus.security)
    redis_secrets: str = ""  # Redis's password files; the CLI reads as cli
    tls_ca: str = ""  # the CA file every client verifies Kafka and Redis against (apportion.bus.tls)
    no_tls: bool = False  # a development stack without TLS (APPORTION_NO_TLS=1 when it was started)

    @property
    def web_url(self) -> str:
        """The dashboard's address (``""`` when the stack runs without it); its metrics at ``/metrics``."""
        port = self.metrics.get(WEB)
        return f"http://127.0.0.1:{port}/" if port and WEB in self.pids else ""

    @property
    def log_dir(self) -> Path:
        return self.run_dir / "logs"

    @property
    def researcher_dir(self) -> Path:
        """What users other than the stack's own may read (``docs/security.md``, "Other users of a local stack")."""
        return self.run_dir / "researcher"

    def researcher_lines(self) -> list[str]:
        """The researcher-facing ``stack.env``: where the servers are, the namespace, the clock, the dashboard and
        the CA copy to verify them with. No credential, no keyring, no secrets directory: each user brings their
        own (:meth:`env_lines` holds the stack owner's)."""
        lines = [
            "# written by `apportion stack up` for users other than its owner: no credentials (bring your own)",
            f"KAFKA_BOOTSTRAP={self.bootstrap}",
            f"REDIS_URL={self.redis_url}",
            f"APPORTION_TOPIC_PREFIX={self.prefix}",
        ]
        if self.tls_ca:
            lines.append(f"{TLS_CA_SETTING}={self.researcher_dir / 'ca.pem'}")
        if self.no_tls:
            lines.append(f"{NO_TLS_SETTING}=1")
        lines += [f"{k}={v}" for k, v in sorted(self.clock.items())]
        if self.web_url:
            lines.append(f"WEB_URL={self.web_url}")
        return lines

    @property
    def agent_dir(self) -> Path:
        """The node agent's state dir: journal, ``checkpoints/`` and ``job-logs/`` (``docs/checkpoints.md``)."""
        return self.run_dir / "node_agent"

    @property
    def job_log_dir(self) -> Path:
        """The jobs' output files, which `apportion logs` reads (``JOB_LOG_DIR``)."""
        return self.agent_dir / "job-logs"

    def env_lines(self) -> list[str]:
        lines = [
            "# written by `apportion stack up`; read by the apportion CLI",
            f"KAFKA_BOOTSTRAP={self.bootstrap}",
            f"REDIS_URL={self.redis_url}",
            f"APPORTION_TOPIC_PREFIX={self.prefix}",
            f"RUN_DIR={self.run_dir}",
            f"LOG_DIR={self.log_dir}",
            f"JOB_LOG_DIR={self.job_log_dir}",
            f"INFRA={self.infra}",
            f"APPORTION_KEYRING={self.keyring}",
        ]
        if self.kafka_secrets:
            lines += [f"{k}={v}" for k, v in principal_env("ops", Path(self.kafka_secrets)).items()]
            lines.append(f"{NODE_AGENTS_SETTING}={STACK_AGENT}")  # later provisioning keeps its principal
        if self.redis_secrets:
            lines += [f"{k}={v}" for k, v in redis_env("cli", Path(self.redis_secrets)).items()]
        if self.tls_ca:
            lines.append(f"{TLS_CA_SETTING}={self.tls_ca}")
        if self.no_tls:
            lines.append(f"{NO_TLS_SETTING}=1")
        lines += [f"{k}={v}" for k, v in sorted(self.clock.items())]
        lines += [f"PID_{n.upper()}={p}" for n, p in sorted(self.pids.items())]
        lines += [f"METRICS_{n.upper()}=127.0.0.1:{p}" for n, p in sorted(self.metrics.items())]
        if self.web_url:
            lines.append(f"WEB_URL={self.web_url}")
        return lines

    @classmethod
    def read(cls, run_dir: Path) -> StackInfo | None:
        from apportion.bus.stack import read_env_file

        env = read_env_file(run_dir / "stack.env")
        if "KAFKA_BOOTSTRAP" not in env:
            return None
        info = cls(
            run_dir,
            env["KAFKA_BOOTSTRAP"],
            env.get("REDIS_URL", ""),
            env.get("APPORTION_TOPIC_PREFIX", ""),
            env.get("INFRA", "local"),
            keyring=env.get("APPORTION_KEYRING", ""),
            kafka_secrets=str(Path(env["APPORTION_KAFKA_PASSWORD_FILE"]).parent)
            if env.get("APPORTION_KAFKA_PASSWORD_FILE")
            else "",
            redis_secrets=str(Path(env["APPORTION_REDIS_PASSWORD_FILE"]).parent)
            if env.get("APPORTION_REDIS_PASSWORD_FILE")
            else "",
            tls_ca=env.get(TLS_CA_SETTING, ""),
            no_tls=env.get(NO_TLS_SETTING) == "1",
        )
        for k, v in env.items():
            if k.startswith("PID_"):
                info.pids[k[4:].lower()] = int(v)
            elif k.startswith("METRICS_"):
                info.metrics[k[8:].lower()] = int(v.rsplit(":", 1)[1])
            elif k.startswith(("APPORTION_TIME_SCALE", "APPORTION_CLOCK_")):
                info.clock[k] = v
        return info

    def describe(self, probed: Mapping[str, Probe] | None = None) -> list[str]:
        """Lines for people; with ``probed`` (:func:`probe`) each part's answer too (``answers``, ``ready``,
        or ``NOT ANSWERING`` / ``NOT READY`` with why)."""

        def said(part: str) -> str:
            got = (probed or {}).get(part)
            if got is None:
                return ""
            ok = "answers" if part in ("kafka", "redis") else "ready"
            return f" {ok}" if got.ok else f" NOT {'ANSWERING' if ok == 'answers' else 'READY'}: {got.detail}"

        lines = [
            f"Kafka    {self.bootstrap}" + ("" if self.infra == "local" else " (external)") + said("kafka"),
            f"Redis    {self.redis_url}" + ("" if self.infra == "local" else " (external)") + said("redis"),
            f"prefix   {self.prefix or '(none: the default namespace)'}",
            f"logs     {self.log_dir} (services)",  # a line each: two paths on one line overran 80 columns
            f"job logs {self.job_log_dir} (`apportion logs JOB`)",
        ]
        for name in SERVICES:
            if name in self.pids:
                m = self.metrics.get(name)
                state = "running" if alive(self.pids[name]) else "NOT RUNNING"
                lines.append(
                    f"{name:<11} pid {self.pids[name]:<7} {state:<11}"
                    + (f" metrics http://127.0.0.1:{m}/metrics" if m else "")
                    + said(name)
                )
        if self.web_url:
            lines.append(f"dashboard {self.web_url} (read-only, 127.0.0.1)")
        return lines

    def status_doc(self, probed: Mapping[str, Probe]) -> dict[str, Any]:
        """``stack status --json``: what :meth:`describe` prints, as fields, with each part's answer."""
        return {
            "run_dir": str(self.run_dir),
            "kafka_bootstrap": self.bootstrap,
            "redis_url": self.redis_url,
            "prefix": self.prefix,
            "infra": self.infra,
            "log_dir": str(self.log_dir),
            "job_log_dir": str(self.job_log_dir),
            "kafka": probed["kafka"].to_dict(),
            "redis": probed["redis"].to_dict(),
            "services": {
                n: {
                    "pid": p,
                    "running": alive(p),
                    "metrics": f"http://127.0.0.1:{self.metrics[n]}/metrics",
                    "ready": probed[n].to_dict() if n in probed else None,
                }
                for n, p in sorted(self.pids.items())
            },
            "web": self.web_url or None,
        }


@dataclass(frozen=True, slots=True)
class Probe:
    """One part's answer to :func:`probe`: ``ok``, and ``detail`` (why not, or what it said)."""

    ok: bool
    detail: str = ""

    def to_dict(self) -> dict[str, object]:
        return {"ok": self.ok, "detail": self.detail}


def probe(info: StackInfo, timeout_s: float = 3.0) -> dict[str, Probe]:
    """Ask each part of the stack whether it answers: ``kafka`` (cluster metadata), ``redis`` (PING), and each
    service with a metrics port: ``GET /ready`` (200 ready; else its status and body), the dashboard ``GET
    /metrics``. Each wait is at most about ``timeout_s`` wall seconds (Kafka's bootstrap: 5 s).

    Returns:
        part name -> :class:`Probe`; nothing raises (an error is the part's ``detail``).
    """
    import urllib.error
    import urllib.request

    import redis as redis_lib

    from apportion.bus.security import redis_auth
    from apportion.cli import verdicts

    out: dict[str, Probe] = {}
    try:
        kc = verdicts._consumer(info.bootstrap)
        try:
            kc.topics()
        finally:
            kc.close()
        out["kafka"] = Probe(True)
    except Exception as exc:  # noqa: BLE001 - kafka errors have many types; any is "does not answer"
        out["kafka"] = Probe(False, f"{type(exc).__name__}: {exc}"[:200])
    try:
        r = redis_lib.Redis.from_url(
            info.redis_url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s, **redis_auth(info.redis_url)
        )
        r.ping()
        out["redis"] = Probe(True)
    except (redis_lib.RedisError, OSError, RuntimeError) as exc:
        out["redis"] = Probe(False, f"{type(exc).__name__}: {exc}"[:200])
    for name in SERVICES:
        port = info.metrics.get(name)
        if name not in info.pids or not port:
            continue
        url = f"http://127.0.0.1:{port}/{'metrics' if name == WEB else 'ready'}"
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as resp:
                out[name] = Probe(True, f"{resp.status}")
        except urllib.error.HTTPError as exc:
            out[name] = Probe(False, f"{exc.code} {exc.read(300).decode(errors='replace').strip()}")
        except (OSError, ValueError) as exc:
            out[name] = Probe(False, f"no answer at {url}: {getattr(exc, 'reason', exc)}")
    return out


def alive(pid: int) -> bool:
    """True while process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def _write_state(info: StackInfo) -> None:
    from apportion.settings import user_stack_env

    text = ("\n".join(info.env_lines()) + "\n").encode()  # the owner's principal, password files, keyring: 0600
    write_private(info.run_dir / "stack.env", text)
    user = user_stack_env()
    user.parent.mkdir(parents=True, exist_ok=True)
    write_private(user, text)
    shared = info.researcher_dir
    shared.mkdir(exist_ok=True)
    shared.chmod(0o755)
    if info.tls_ca:
        write_private(shared / "ca.pem", Path(info.tls_ca).read_bytes(), mode=0o644)  # a certificate: public
    write_private(shared / "stack.env", ("\n".join(info.researcher_lines()) + "\n").encode(), mode=0o644)


def _ready(info: StackInfo, name: str, since: int = 0) -> bool:
    """True once ``name``'s log says it is ready after byte ``since`` (a restart's start)."""
    log = info.log_dir / f"{name}.log"
    try:
        with open(log, "rb") as f:
            f.seek(since)
            return READY_LINE[name] in f.read().decode(errors="replace")
    except OSError:
        return False


def wait_ready(info: StackInfo, since: Mapping[str, int], timeout_s: float = READY_TIMEOUT_S) -> None:
    """Wait until each service of ``since`` has logged its :data:`READY_LINE` after byte ``since[name]`` of its log
    (where its start began logging, :func:`_log_end`).

    Raises:
        StackUpError: one exited (its pid in ``info.pids`` is gone), or not all were ready within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    waiting = list(since)
    while waiting:
        for name in list(waiting):
            if _ready(info, name, since[name]):
                waiting.remove(name)
            elif not alive(info.pids[name]):
                raise StackUpError(f"{name} exited at start; see {info.log_dir / (name + '.log')}")
        if waiting and time.monotonic() > deadline:
            raise StackUpError(f"{', '.join(waiting)} not ready within {timeout_s:g} s; see the logs in {info.log_dir}")
        if waiting:
            time.sleep(0.2)


def _log_end(info: StackInfo, name: str) -> int:
    """The size of ``name``'s log: where what a start logs begins (:func:`_ready`'s ``since``)."""
    log = info.log_dir / f"{name}.log"
    return log.stat().st_size if log.exists() else 0


def _launch_file(info: StackInfo, name: str) -> Path:
    return info.run_dir / "services" / f"{name}.launch.json"


def _save_launch(info: StackInfo, name: str, args: Sequence[str], env: Mapping[str, str]) -> None:
    """Record how ``name`` was started (argv and environment: passwords stay in their files), mode 0600."""
    import json

    path = _launch_file(info, name)
    write_private(path, json.dumps({"args": list(args), "env": dict(env)}).encode())


def _spawn(info: StackInfo, name: str, args: Sequence[str], env: Mapping[str, str]) -> int:
    """Start service ``name`` (its own session, output appended to its log, pid file written); its pid."""
    logf = open(info.log_dir / f"{name}.log", "ab")  # handed to the child
    try:
        proc = subprocess.Popen(
            list(args), env=dict(env), stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True
        )
    finally:
        logf.close()
    (info.run_dir / "services" / f"{name}.pid").write_text(f"{proc.pid}\n")
    return proc.pid


def restart(run_dir: Path, name: str, *, say: Callable[[str], object] = print) -> int:
    """Start service ``name`` of the stack in ``run_dir`` again, with the arguments and environment ``up``
    gave it (stopping it first if it still runs), record its new pid (``stack.env``, the pid file: ``status``
    and ``down`` see it) and wait until it is ready; returns the new pid.

    Raises:
        StackUpError: no stack there, no such service, no record of its start (a stack started before
            ``restart`` existed), or it exited or was not ready within :data:`READY_TIMEOUT_S`.
    """
    import json

    run_dir = Path(run_dir).resolve()
    info = StackInfo.read(run_dir)
    if info is None:
        raise StackUpError(f"no stack started from {run_dir} (`apportion stack up`)")
    if name not in info.pids:
        raise StackUpError(f"no service {name!r} in the stack at {run_dir} (services: {', '.join(sorted(info.pids))})")
    try:
        launch = json.loads(_launch_file(info, name).read_text())
    except (OSError, ValueError):
        raise StackUpError(
            f"no record of how {name} was started in {run_dir / 'services'} (a stack from before `stack restart`): "
            "`apportion stack down` and `up`"
        ) from None
    old = info.pids[name]
    if alive(old):
        killed = _stop_pid(old, STOP_GRACE_S)
        say(f"stopped {name} (pid {old}{', killed after the grace period' if killed else ''})")
    since = {name: _log_end(info, name)}
    pid = _spawn(info, name, launch["args"], launch["env"])
    info.pids[name] = pid
    _write_state(info)
    wait_ready(info, since)
    say(f"restarted {name} (pid {pid}), ready")
    return pid


def dev_keyring(path: Path) -> Path:
    """A development keyring at ``path`` with an ops identity (``ops.json``), made once (mode 0700).

    The CLI and the client enrol each user there on first use (:func:`apportion.client.identity_for`),
    so a local stack runs with signature checks on and no key ceremony. Whoever can read it is ops: it
    is for development stacks only (docs/security.md).
    """
    from apportion.identity.keys import Identity

    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if not (path / "ops.json").is_file():
        Identity.generate("ops", "ops").save(path / "ops.json")
    return path


def up(
    run_dir: Path,
    *,
    sim_nodes: int = 8,
    gpus_per_node: int = 8,
    bootstrap: str | None = None,
    redis_url: str | None = None,
    prefix: str = "",
    time_scale: float = 1.0,
    heartbeat_timeout_s: float | None = None,
    web: bool = True,
    simulate_json: Sequence[str] = (),
    brokers: int = 1,
    sandbox_memory_mb_per_gpu: int | None = None,
    say: Callable[[str], object] = print,
) -> StackInfo:
    """Start the stack (see the module docstring); on failure stop what was started and raise.

    A stack already running from ``run_dir`` is returned as it is (``up`` twice is harmless).
    ``brokers``: Kafka nodes to start (a local KRaft cluster when more than one; topics replicated
    :func:`apportion.topics.replication`); ignored with an external Kafka.

    Args:
        web: start the read-only dashboard too (``services.web`` on a free 127.0.0.1 port).
        sandbox_memory_mb_per_gpu: the node agent's memory limit of a job replica per GPU it holds, MiB
            (``None``: the agent's default, the machine's memory over every simulated GPU).
        simulate_json: ``apportion simulate --json`` files for the dashboard's ``/simulate`` page.

    Raises:
        StackUpError: a part did not start or become ready within :data:`READY_TIMEOUT_S`.
    """
    from datetime import UTC, datetime

    from apportion.bus.provision import provision
    from apportion.bus.stack import LocalStack, StackError, attach, free_ports
    from apportion.client import enrol
    from apportion.domain.admission import DISPATCHER, node_principal
    from apportion.gpu import sim_node_ids

    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    existing = StackInfo.read(run_dir)
    if existing is not None and existing.pids and all(alive(p) for p in existing.pids.values()):
        say(f"already running from {run_dir}")
        return existing
    if existing is not None and any(alive(p) for p in existing.pids.values()):
        raise StackUpError(f"part of a stack is running from {run_dir}: `apportion stack down` first")
    external = bootstrap is not None or redis_url is not None
    if external and (bootstrap is None or redis_url is None):
        raise StackUpError("give both --bootstrap and --redis to use an external Kafka and Redis")
    local: LocalStack | None = None
    if not external:
        local = attach(run_dir, provision_topics=False, brokers=brokers)
        say(f"starting Kafka and Redis in {run_dir} ...")
        try:
            local.start()
        except StackError as exc:
            raise StackUpError(str(exc)) from exc
        bootstrap, redis_url = local.bootstrap, local.redis_url
    assert bootstrap is not None and redis_url is not None
    info = StackInfo(run_dir, bootstrap, redis_url, prefix, "external" if external else "local")
    info.keyring = str(dev_keyring(run_dir / "keyring"))
    if local is not None and local.kafka_secrets is not None:
        info.kafka_secrets = str(local.kafka_secrets)
    if local is not None and local.redis_secrets is not None:
        info.redis_secrets = str(local.redis_secrets)
    # the CA the clients verify the servers against: the stack's own, else the caller's
    info.tls_ca = str(local.tls_ca or "") if local is not None else os.environ.get(TLS_CA_SETTING, "")
    info.no_tls = NO_TLS_SETTING in (local.client_env() if local is not None else os.environ)
    for private in (info.log_dir, run_dir / "services"):  # service logs and pid files: not for job accounts
        private_dir(private)
    saved = os.environ.get("APPORTION_TOPIC_PREFIX")
    os.environ["APPORTION_TOPIC_PREFIX"] = prefix
    try:
        provision(bootstrap, node_agents=(STACK_AGENT,))
        # the node agent's keys (one per simulated node), registered here as ops: the agent's own Kafka
        # principal may not write apportion.budgets, and it signs every report (docs/security.md)
        enrol(  # and the dispatcher's, which signs every decision
            [DISPATCHER, *(node_principal(n) for n in sim_node_ids(SIM_PREFIX, sim_nodes))],
            bootstrap=bootstrap,
            ring=Path(info.keyring),
        )
    except Exception as exc:
        if local is not None:
            local.stop()
        raise StackUpError(f"cannot provision topics at {bootstrap}: {exc}") from exc
    finally:
        if saved is None:
            os.environ.pop("APPORTION_TOPIC_PREFIX", None)
        else:
            os.environ["APPORTION_TOPIC_PREFIX"] = saved
    names = [n for n in SERVICES if web or n != WEB]
    ports = free_ports(len(names))
    epoch = datetime.now(UTC).isoformat()
    base = {
        k: v for k, v in os.environ.items() if not (k.startswith("APPORTION_") or k in ("KAFKA_BOOTSTRAP", "REDIS_URL"))
    }
    if external:  # the caller's own Kafka and Redis credentials, if any
        base.update({k: v for k, v in os.environ.items() if k.startswith(("APPORTION_KAFKA_", "APPORTION_REDIS_"))})
        base.pop("APPORTION_REDIS_URL", None)  # set below from redis_url
    base.update(
        APPORTION_KAFKA_BOOTSTRAP=bootstrap,
        APPORTION_REDIS_URL=redis_url,
        APPORTION_TOPIC_PREFIX=prefix,
        APPORTION_METRICS_HOST="127.0.0.1",
        APPORTION_LOG_JSON="false",
        PYTHONUNBUFFERED="1",
    )
    if info.tls_ca:
        base[TLS_CA_SETTING] = info.tls_ca
    if info.no_tls:
        base[NO_TLS_SETTING] = "1"
    if time_scale != 1.0:
        info.clock = {
            "APPORTION_TIME_SCALE": str(time_scale),
            "APPORTION_CLOCK_EPOCH_WALL": epoch,
            "APPORTION_CLOCK_EPOCH_EVENT": epoch,
        }
        base.update(info.clock)
    since: dict[str, int] = {}
    try:
        for name, port in zip(names, ports, strict=True):
            args = [sys.executable, "-m", f"services.{name}"]
            if name == "node_agent":
                args += ["--sim-nodes", str(sim_nodes), "--gpus-per-node", str(gpus_per_node)]
                args += ["--node-prefix", SIM_PREFIX]
            if name == "dispatcher" and heartbeat_timeout_s is not None:
                args += ["--heartbeat-timeout-s", str(heartbeat_timeout_s)]
            env = dict(base, APPORTION_METRICS_PORT=str(port))
            if name == WEB:  # one port: its pages and its own /metrics
                args += ["--port", str(port), "--host", "127.0.0.1"]
                args += [a for f in simulate_json for a in ("--simulate-json", str(Path(f).resolve()))]
                env.pop("APPORTION_METRICS_PORT")
                _as_web(info, env)
            else:  # each service is its own Kafka principal (ACLs: apportion.bus.security) and Redis user
                kafka = Path(info.kafka_secrets) if info.kafka_secrets else None
                redis = Path(info.redis_secrets) if info.redis_secrets else None
                env.update(service_credentials(name, STACK_AGENT, kafka, redis))
            if name == "node_agent":
                env.update(agent_env(info, sandbox_memory_mb_per_gpu, ports))
            if name == "dispatcher":
                env.update(dispatcher_env(info))
            _save_launch(info, name, args, env)  # `stack restart` starts it again the same way
            since[name] = _log_end(info, name)  # an `up` in a run directory used before appends to its logs
            info.pids[name] = _spawn(info, name, args, env)
            info.metrics[name] = port
        _write_state(info)
        wait_ready(info, since)
    except BaseException:
        down(run_dir, say=lambda *_: None)
        raise
    return info


def agent_env(
    info: StackInfo, sandbox_memory_mb_per_gpu: int | None = None, service_ports: Iterable[int] = ()
) -> dict[str, str]:
    """The node agent's own settings in the stack in ``info.run_dir`` (``services.node_agent.config``): its
    journal, the jobs' checkpoints and output files (``RUN_DIR/node_agent``), its nodes' keys, the dispatcher's
    public key (a ``NodeLost`` it did not sign is disregarded), its cgroup parent, one per run directory
    (:func:`stack_cgroup_parent`: two stacks on one machine never share job cgroups), the loopback ports closed
    to jobs (:func:`closed_ports`) and, when given, the memory limit of a replica per GPU."""
    import json

    from apportion.domain.admission import DISPATCHER

    env = {
        "APPORTION_STATE_DIR": str(info.agent_dir),
        "APPORTION_KEYRING": info.keyring,
        "APPORTION_DISPATCHER_PUBLIC_KEY_FILE": str(Path(info.keyring) / f"{DISPATCHER}.json"),
        "APPORTION_CGROUP_PARENT": stack_cgroup_parent(info.run_dir, info.prefix),
        "APPORTION_SANDBOX_CLOSED_PORTS": json.dumps(closed_ports(info, service_ports)),
    }
    if sandbox_memory_mb_per_gpu is not None:
        env["APPORTION_SANDBOX_MEMORY_MB_PER_GPU"] = str(sandbox_memory_mb_per_gpu)
    return env


def closed_ports(info: StackInfo, service_ports: Iterable[int] = ()) -> list[int]:
    """Every loopback port of the stack in ``info.run_dir``, ascending: the Kafka bootstrap servers', every
    listener of its brokers and KRaft controllers (:func:`apportion.bus.stack.listener_ports`), Redis's, and the
    services' metrics and dashboard ports (``service_ports`` and ``info.metrics``). The node agent closes them
    to jobs (``D10.node-boundary``); its own default closes only the bootstrap servers and Redis, which would
    leave a job free to flood the controller's port until the broker runs out of file descriptors."""
    from apportion.bus.stack import listener_ports
    from apportion.settings import Connection

    ports = Connection(info.bootstrap, info.redis_url).ports()
    ports |= listener_ports(info.run_dir)
    ports |= set(service_ports) | set(info.metrics.values())
    return sorted(ports)


def dispatcher_env(info: StackInfo) -> dict[str, str]:
    """The dispatcher's own settings in the stack in ``info.run_dir``: the keyring that holds its signing key
    (``service:dispatcher``), given outright: found through a ``stack.env`` it could be another stack's, or the
    marker of a stopped one in the working directory's checkout, which names none."""
    return {"APPORTION_KEYRING": info.keyring}


def stack_cgroup_parent(run_dir: Path, prefix: str) -> str:
    """The cgroup parent of the node agent of the stack in ``run_dir`` with topic namespace ``prefix``:
    ``apportion/stack-<first 12 hex digits of the SHA-256 of the run directory's absolute path>/<prefix>sim``
    (characters outside ``[A-Za-z0-9._-]`` of the prefix made ``_``), one per run directory and namespace."""
    import hashlib
    import re

    digest = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]
    ns = re.sub(r"[^A-Za-z0-9._-]", "_", prefix)
    return f"apportion/stack-{digest}/{ns}{SIM_PREFIX.rstrip('-')}"


def _as_web(info: StackInfo, env: dict[str, str]) -> None:
    """Make ``env`` the dashboard's: Kafka principal and Redis user ``web`` (read-only, ``docs/security.md``).

    The secrets directories are the stack's own (started here), else the caller's
    ``APPORTION_KAFKA_SECRETS_DIR`` / ``APPORTION_REDIS_SECRETS_DIR`` (an admin of the given servers); without
    them (or without a ``web`` password there) the dashboard keeps the caller's credentials. A password given
    in the environment is dropped with the user it belonged to.
    """
    kafka = info.kafka_secrets or env.get("APPORTION_KAFKA_SECRETS_DIR", "")
    if kafka and (Path(kafka) / f"{WEB}.password").is_file():
        env.pop("APPORTION_KAFKA_PASSWORD", None)
        env.update(principal_env(WEB, Path(kafka)))
    redis = info.redis_secrets or env.get("APPORTION_REDIS_SECRETS_DIR", "")
    if redis and (Path(redis) / f"{WEB}.password").is_file():
        env.pop("APPORTION_REDIS_PASSWORD", None)
        env.update(redis_env(WEB, Path(redis)))


def _stop_pid(pid: int, grace_s: float) -> bool:
    """SIGTERM ``pid``'s process group, SIGKILL after ``grace_s``; True when it had to be killed."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return False
        except PermissionError:
            os.kill(pid, sig)
        end = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < end:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)  # our child: reap it
            except ChildProcessError:
                done = 0 if alive(pid) else pid
            if done or not alive(pid):
                return sig == signal.SIGKILL
            time.sleep(0.1)
    return True


def down(run_dir: Path, *, say: Callable[[str], object] = print) -> list[str]:
    """Stop what ``up`` started from ``run_dir``; returns one line per part stopped."""
    from apportion.bus.stack import LocalStack, StackError, attach
    from apportion.settings import user_stack_env

    run_dir = Path(run_dir).resolve()
    info = StackInfo.read(run_dir)
    lines: list[str] = []
    pids: dict[str, int] = dict(info.pids) if info is not None else {}
    for f in sorted((run_dir / "services").glob("*.pid")) if (run_dir / "services").is_dir() else []:
        try:
            pids.setdefault(f.stem, int(f.read_text().strip()))
        except ValueError:
            pass
    for name in reversed(SERVICES):  # agents first: nothing is left placed on a node nobody hosts
        pid = pids.get(name)
        if pid is None:
            continue
        if alive(pid):
            killed = _stop_pid(pid, STOP_GRACE_S)
            lines.append(f"stopped {name} (pid {pid}{', killed after the grace period' if killed else ''})")
        (run_dir / "services" / f"{name}.pid").unlink(missing_ok=True)
    if info is None or info.infra == "local":
        stack: LocalStack = attach(run_dir, provision_topics=False)
        if stack.running() or (run_dir / "kafka" / "kafka.pid").exists() or (run_dir / "redis" / "redis.pid").exists():
            try:
                stack.stop()
                lines.append(f"stopped Kafka {stack.bootstrap} and Redis {stack.redis_url}")
            except StackError as exc:
                lines.append(f"stopping Kafka/Redis: {exc}")
    (run_dir / "stack.env").unlink(missing_ok=True)
    user = user_stack_env()
    if user.is_file():
        from apportion.bus.stack import read_env_file

        if read_env_file(user).get("RUN_DIR") == str(run_dir):
            user.unlink()
    mark_stopped(run_dir)
    for ln in lines:
        say(ln)
    return lines


def mark_stopped(run_dir: Path) -> None:
    """Replace the other users' ``RUN_DIR/researcher/stack.env``, if any, by the marker of a stopped stack:
    ``APPORTION_STACK_STOPPED`` (when, UTC) and ``RUN_DIR``, no address. Their CLI, pointed at it by
    ``APPORTION_STACK_DIR``, then says no stack is running (:class:`apportion.settings.StackStopped`) instead of
    trying the addresses of the stopped one, or the defaults had the file gone."""
    from datetime import UTC, datetime

    from apportion.settings import STOPPED

    path = run_dir / "researcher" / "stack.env"
    if path.is_file():
        when = datetime.now(UTC).isoformat(timespec="seconds")
        write_private(path, f"{STOPPED}={when}\nRUN_DIR={run_dir}\n".encode(), mode=0o644)


# --------------------------------------------------------------------------- the `apportion stack` commands


stack_app = typer.Typer(
    help="An interactive local stack: Kafka, Redis, the four services, N simulated nodes, the web dashboard.",
    no_args_is_help=True,
)

RunDir = Annotated[
    Path | None, typer.Option("--dir", help="Run directory (default: the checkout's .run/).", file_okay=False)
]


def register(app: typer.Typer) -> None:
    """Attach ``apportion stack up|down|status|restart`` to the CLI."""
    app.add_typer(stack_app, name="stack")


def _err(msg: str, code: int) -> NoReturn:
    """``error: msg`` on stderr, exit ``code``; under ``--json`` also the JSON error object on stdout (:func:`fail`)."""
    fail(msg, code)


@stack_app.command("up")
def up_cmd(
    sim_nodes: Annotated[int, typer.Option("--sim-nodes", min=1, help="Simulated nodes to host.")] = 8,
    gpus_per_node: Annotated[int, typer.Option("--gpus-per-node", min=1, help="GPUs per simulated node.")] = 8,
    run_dir: RunDir = None,
    prefix: Annotated[str, typer.Option("--prefix", help="Topic namespace (APPORTION_TOPIC_PREFIX).")] = "",
    time_scale: Annotated[
        float, typer.Option("--time-scale", min=0.001, help="Event seconds per wall second (1 = real time).")
    ] = 1.0,
    bootstrap: Annotated[
        str | None, typer.Option("--bootstrap", help="Use this Kafka instead of starting one.")
    ] = None,
    redis_url: Annotated[str | None, typer.Option("--redis", help="Use this Redis instead of starting one.")] = None,
    web: Annotated[
        bool, typer.Option("--web/--no-web", help="Start the read-only web dashboard (127.0.0.1, a free port).")
    ] = True,
    simulate_json: Annotated[
        list[Path] | None,
        typer.Option(
            "--simulate-json", help="A `simulate --json` file for the dashboard's /simulate page.", exists=True
        ),
    ] = None,
    brokers: Annotated[
        int, typer.Option("--brokers", min=1, help="Kafka nodes to start (3: replication 3, min.insync.replicas 2).")
    ] = 1,
    sandbox_memory_mb_per_gpu: Annotated[
        int | None,
        typer.Option(
            "--sandbox-memory-mb-per-gpu",
            min=1,
            help="Memory limit of a job replica per GPU it holds, MiB (default: the machine's memory over every "
            "simulated GPU).",
        ),
    ] = None,
) -> None:
    """Start Kafka + Redis (unless given), the four services, N simulated nodes and the web dashboard; print where
    they are."""
    d = run_dir or default_run_dir()
    try:
        info = up(
            d,
            sim_nodes=sim_nodes,
            gpus_per_node=gpus_per_node,
            bootstrap=bootstrap,
            redis_url=redis_url,
            prefix=prefix,
            time_scale=time_scale,
            heartbeat_timeout_s=max(DEFAULT_HEARTBEAT_TIMEOUT_S, 3 * time_scale) if time_scale != 1.0 else None,
            web=web,
            simulate_json=[str(p) for p in simulate_json or ()],
            brokers=brokers,
            sandbox_memory_mb_per_gpu=sandbox_memory_mb_per_gpu,
            say=typer.echo,
        )
    except StackUpError as exc:
        _err(str(exc), 3)
    from apportion.settings import user_stack_env

    for ln in [*info.describe(), *state_lines(d / "stack.env", user_stack_env())]:
        typer.echo(ln)
    typer.echo("stop with: apportion stack down   (or: make down)")


def state_lines(run_env: Path, user_env: Path) -> list[str]:
    """What ``up`` prints of its two state files: a line each, as the log folders are (two paths and a note on one
    line ran past 80 columns), and a note of what they are for on a line of its own."""
    return [
        f"state    {run_env}",
        f"         {user_env}",
        "         (the CLI finds the stack from any folder)",
    ]


@stack_app.command("down")
def down_cmd(run_dir: RunDir = None) -> None:
    """Stop every process `stack up` started from the run directory (services, then Kafka and Redis)."""
    d = run_dir or _found_run_dir() or default_run_dir()
    lines = down(d, say=typer.echo)
    if not lines:
        typer.echo(f"nothing running from {d}")


@stack_app.command("restart")
def restart_cmd(
    service: Annotated[str, typer.Argument(help=f"The service to start again: {', '.join(SERVICES)}.")],
    run_dir: RunDir = None,
) -> None:
    """Start one service of the stack again (after a crash, or to pick up a change), with the arguments and
    environment `stack up` gave it; a running one is stopped first. Exit 0 when it is ready again, 2 for an
    unknown service, 3 when it cannot be restarted."""
    if service not in SERVICES:
        _err(f"no service {service!r}: use one of {', '.join(SERVICES)}", 2)
    d = run_dir or _found_run_dir() or default_run_dir()
    try:
        restart(d, service, say=typer.echo)
    except StackUpError as exc:
        _err(str(exc), 3)


@stack_app.command("status")
def status_cmd(
    run_dir: RunDir = None,
    as_json: Annotated[bool, json_option("Print JSON for scripts.")] = False,
) -> None:
    """Where the stack is and whether each part runs and answers (Kafka, Redis, each service's /ready); exit 1
    when something is down or not ready, 3 when no stack was started."""
    import json

    d = run_dir or _found_run_dir() or default_run_dir()
    info = StackInfo.read(Path(d).resolve())
    if info is None:
        _err(f"no stack started from {d} (`apportion stack up`)", 3)
    probed = probe(info)
    if as_json:
        doc = info.status_doc(probed)
        typer.echo(json.dumps(doc, indent=2, sort_keys=True))
    else:
        for ln in info.describe(probed):
            typer.echo(ln)
    if not all(alive(p) for p in info.pids.values()) or not all(p.ok for p in probed.values()):
        raise typer.Exit(1)


def _found_run_dir() -> Path | None:
    """The run directory of the stack the CLI would talk to (its stack.env's RUN_DIR), if any."""
    from apportion.settings import stack_env

    run = stack_env().get("RUN_DIR")
    return Path(run) if run else None
