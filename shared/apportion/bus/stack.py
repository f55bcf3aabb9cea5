"""Start and stop a local Kafka + Redis from ``infra/`` (no Docker).

Used by the test fixtures, by ``make up`` / ``make down`` and by the main
job. Each stack lives in one data directory::

    DATADIR/kafka/      broker data, server.properties, kafka.log, kafka.pid
                        (a cluster, ``brokers`` > 1: DATADIR/kafka/broker-N/ each, cluster.ports)
    DATADIR/kafka/secrets/   Kafka passwords (mode 0600): admin, controller, one per principal
    DATADIR/redis/      redis.log, redis.pid
    DATADIR/tls/        the local CA and the servers' certificate (:mod:`apportion.bus.tls`, mode 0600)
    DATADIR/stack.env   KAFKA_BOOTSTRAP=..., REDIS_URL=..., the CA and the admin credentials' file
                        (shell-sourceable)

Kafka runs with TLS, SASL/SCRAM and ACLs (SASL_SSL; ``docs/security.md``)
unless ``APPORTION_KAFKA_PLAINTEXT=1``, and Redis with TLS only (``rediss://``)
and ACL users unless ``APPORTION_REDIS_NOAUTH=1``; ``APPORTION_NO_TLS=1`` keeps
the authentication and ACLs without TLS (development only, to measure TLS). :meth:`LocalStack.start` makes the CA and the certificate
both servers present (``DATADIR/tls``) and puts the CA and the super user's
credentials in this process's environment (:meth:`LocalStack.client_env`: the
files, never the password), so what this process and its children connect
with is ``admin`` over TLS; ``apportion stack up`` gives each service its own
principal instead.

Python::

    with LocalStack(tmp_path).start() as stack:     # free ports, topics provisioned
        use(stack.bootstrap, stack.redis_url)

Command line (what the Makefile runs)::

    python -m apportion.bus.stack up --dir .run      # prints the addresses
    python -m apportion.bus.stack down --dir .run
    python -m apportion.bus.stack status --dir .run

Nothing here starts or connects at import time.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from apportion.settings import read_env_file  # the one parser of KEY=value files; its callers import it here too

#: ``infra/`` of the source checkout (the stack is a development tool; it is
#: not used inside containers). Override with ``APPORTION_INFRA_DIR``.
DEFAULT_INFRA_DIR = Path(__file__).resolve().parents[3] / "infra"


class StackError(RuntimeError):
    """A start or stop script failed; the message carries its output."""


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports that were free a moment ago."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def listener_ports(datadir: str | os.PathLike[str]) -> set[int]:
    """Every port a broker or KRaft controller of the stack in ``datadir`` listens on: the ``listeners=`` lines
    of each ``server.properties`` under ``DATADIR/kafka`` (one, or one per broker of a cluster). A node agent on
    the same machine closes them all to jobs (``cli.stack.agent_env``): the controller's port is not among the
    bootstrap servers the agent is given, and a job holding connections to it runs the broker out of file
    descriptors."""
    ports: set[int] = set()
    for props in sorted((Path(datadir) / "kafka").rglob("server.properties")):
        for line in props.read_text().splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "listeners":
                ports.update(int(url.rsplit(":", 1)[1]) for url in value.split(",") if url.strip())
    return ports


def _alive(pidfile: Path) -> bool:
    try:
        pid = int(pidfile.read_text().strip())
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, ValueError, IndexError):
        return False


class LocalStack:
    """A native Kafka broker and redis-server started from ``infra/`` scripts.

    Args:
        datadir: where both keep their data, logs and pid files.
        kafka_port, redis_port: ports on 127.0.0.1; ``0`` picks free ones.
        provision_topics: create the registry topics once Kafka answers.
        brokers: Kafka nodes (``infra/kafka/start-cluster.sh`` when more than one; ``kafka_port`` is then
            node 1's); topics get :func:`apportion.topics.replication` of it.
        infra_dir: the ``infra/`` folder (default: this checkout's).
        echo: print the scripts' output (the CLI does; tests do not).
    """

    def __init__(
        self,
        datadir: str | os.PathLike[str],
        *,
        kafka_port: int = 0,
        redis_port: int = 0,
        provision_topics: bool = True,
        infra_dir: str | os.PathLike[str] | None = None,
        echo: bool = False,
        brokers: int = 1,
    ) -> None:
        if brokers < 1:
            raise ValueError(f"brokers must be at least 1, got {brokers}")
        self.brokers = brokers
        #: every node's client address, once started (a cluster's are read from its ports file)
        self._bootstrap = ""
        self.datadir = Path(datadir).resolve()
        if not kafka_port or not redis_port:
            picked = free_ports(2)
            kafka_port = kafka_port or picked[0]
            redis_port = redis_port or picked[1]
        self.kafka_port = kafka_port
        self.redis_port = redis_port
        self.provision_topics = provision_topics
        self.infra_dir = Path(infra_dir or os.environ.get("APPORTION_INFRA_DIR") or DEFAULT_INFRA_DIR)
        self.echo = echo
        self.startup_report: list[str] = []
        #: the broker's secrets directory (``None``: a plaintext broker)
        self.kafka_secrets: Path | None = None
        #: Redis's secrets directory (``None``: the open default user)
        self.redis_secrets: Path | None = None
        #: the CA both servers' certificates chain to (``None``: neither speaks TLS)
        self.tls_ca: Path | None = None
        #: Kafka's listeners are TLS (false for a plaintext or an ``APPORTION_NO_TLS`` broker)
        self.kafka_tls = False

    @property
    def bootstrap(self) -> str:
        """Kafka bootstrap addresses, ``127.0.0.1:PORT`` (a cluster: every node's, comma-separated)."""
        if self.brokers > 1:
            return self._bootstrap or ",".join(f"127.0.0.1:{p}" for p in self.node_ports().values())
        return f"127.0.0.1:{self.kafka_port}"

    def node_ports(self) -> dict[int, int]:
        """Node id -> client port of a cluster (``{1: kafka_port}`` for one broker; ``{}`` before it started)."""
        if self.brokers == 1:
            return {1: self.kafka_port}
        path = self.datadir / "kafka" / "cluster.ports"
        if not path.is_file():
            return {}
        rows = (line.split() for line in path.read_text().splitlines() if line.strip())
        return {int(r[0]): int(r[1]) for r in rows}

    def node_pid(self, node: int) -> int | None:
        """Process id of Kafka node ``node`` while it runs (its pid file), else ``None``."""
        d = self.datadir / "kafka" / (f"broker-{node}" if self.brokers > 1 else "")
        pidfile = d / "kafka.pid"
        return int(pidfile.read_text().strip()) if _alive(pidfile) else None

    def start_kafka(self) -> str:
        """Start Kafka (every node of a cluster that is not running; idempotent); the script's output."""
        if self.brokers > 1:
            out = self._run(
                "kafka/start-cluster.sh", str(self.brokers), str(self.datadir / "kafka"), str(self.kafka_port)
            )
            found = [ln.split("=", 1)[1] for ln in out.splitlines() if ln.startswith("KAFKA_BOOTSTRAP=")]
            self._bootstrap = found[-1] if found else self._bootstrap
            return out
        return self._run("kafka/start.sh", str(self.kafka_port), str(self.datadir / "kafka"))

    @property
    def tls_dir(self) -> Path:
        """The CA and the servers' certificate (:mod:`apportion.bus.tls`), shared by Kafka and Redis."""
        return self.datadir / "tls"

    @property
    def redis_url(self) -> str:
        """Redis URL, ``rediss://127.0.0.1:PORT/0`` (TLS; ``redis://`` for a plaintext development Redis)."""
        plain = (self.datadir / "redis" / "plaintext").is_file()
        return f"{'redis' if plain else 'rediss'}://127.0.0.1:{self.redis_port}/0"

    @property
    def env_file(self) -> Path:
        return self.datadir / "stack.env"

    def _run(self, script: str, *args: str) -> str:
        cmd = ["bash", str(self.infra_dir / script), *args]
        env = {**os.environ, "APPORTION_TLS_DIR": str(self.tls_dir)}
        proc = subprocess.run(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            check=False,
            env=env,
        )
        if self.echo and proc.stdout:
            print(proc.stdout, end="", flush=True)
        if proc.returncode != 0:
            raise StackError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout}")
        return proc.stdout

    def start(self) -> LocalStack:
        """Make the CA and the servers' certificate; start Redis, then Kafka; provision topics; write ``stack.env``.

        On failure whatever was started is stopped again before raising.
        """
        from apportion.bus.tls import ensure

        self.datadir.mkdir(parents=True, exist_ok=True)
        try:
            ensure(self.tls_dir)
            out = self._run("redis/start.sh", str(self.redis_port), str(self.datadir / "redis"))
            out += self.start_kafka()
            self.startup_report = [ln for ln in out.splitlines() if " ready on " in ln]
            found = [ln.split("=", 1)[1] for ln in out.splitlines() if ln.startswith("KAFKA_SECRETS=")]
            self.kafka_secrets = Path(found[-1]) if found else None
            found = [ln.split("=", 1)[1] for ln in out.splitlines() if ln.startswith("REDIS_SECRETS=")]
            self.redis_secrets = Path(found[-1]) if found else None
            tls = any(ln.startswith(("KAFKA_TLS=", "REDIS_TLS=")) for ln in out.splitlines())
            self.tls_ca = self.tls_dir / "ca.pem" if tls else None
            self.kafka_tls = any(ln.startswith("KAFKA_TLS=") for ln in out.splitlines())
            if self.kafka_tls:
                os.environ.pop("APPORTION_NO_TLS", None)  # the broker speaks TLS, whatever asked otherwise
            if self.tls_ca is None:
                os.environ.pop("APPORTION_TLS_CA", None)  # another stack's CA: nothing here speaks TLS
            os.environ.update(self.client_env())
            if self.provision_topics:
                from apportion.bus.provision import provision

                report = provision(self.bootstrap)
                if self.echo:
                    print(
                        f"topics: {len(report.created)} created, {len(report.existing)} existing, "
                        f"{len(report.drift)} drifted"
                    )
                    for d in report.drift:
                        print(f"  DRIFT {d}")
        except BaseException:
            self.stop()
            raise
        self.write_env_file()
        return self

    def write_env_file(self) -> None:
        """Write ``DATADIR/stack.env``: the addresses and :meth:`client_env` (the admin's password file), mode
        0600 from the first byte whatever the umask (:mod:`apportion.privatefiles`)."""
        from apportion.privatefiles import write_private

        extra = "".join(f"{k}={v}\n" for k, v in self.client_env().items())
        text = f"KAFKA_BOOTSTRAP={self.bootstrap}\nKAFKA_BROKERS={self.brokers}\nREDIS_URL={self.redis_url}\n{extra}"
        write_private(self.env_file, text.encode())

    def client_env(self) -> dict[str, str]:
        """The environment that makes Kafka and Redis clients the super user ``admin`` over TLS, verifying the
        stack's CA (``{}``: no security)."""
        from apportion.bus.security import ADMIN, NO_TLS_SETTING, TLS_CA_SETTING, principal_env, redis_env

        env: dict[str, str] = {TLS_CA_SETTING: str(self.tls_ca)} if self.tls_ca is not None else {}
        if self.kafka_secrets is not None and not self.kafka_tls:
            env[NO_TLS_SETTING] = "1"  # SASL without TLS: the clients must not ask for it
        if self.kafka_secrets is not None:
            env.update(principal_env(ADMIN, self.kafka_secrets), APPORTION_KAFKA_SECRETS_DIR=str(self.kafka_secrets))
        if self.redis_secrets is not None:
            env.update(redis_env(ADMIN, self.redis_secrets), APPORTION_REDIS_SECRETS_DIR=str(self.redis_secrets))
        return env

    def stop(self) -> None:
        """Stop Kafka, then Redis (each a no-op when not running)."""
        errors = []
        for script, sub in (("kafka/stop.sh", "kafka"), ("redis/stop.sh", "redis")):
            try:
                self._run(script, str(self.datadir / sub))
            except StackError as exc:
                errors.append(str(exc))
        self.env_file.unlink(missing_ok=True)
        if errors:
            raise StackError("\n".join(errors))

    def running(self) -> bool:
        """True when Redis and every Kafka node of this data dir are alive."""
        nodes = self.node_ports() or {1: 0}
        return all(self.node_pid(n) is not None for n in nodes) and _alive(self.datadir / "redis" / "redis.pid")

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def attach(datadir: str | os.PathLike[str], **kwargs: Any) -> LocalStack:
    """A :class:`LocalStack` for ``datadir`` reusing the ports of a running one.

    Without a running stack there, ports are fresh free ones.
    """
    datadir = Path(datadir).resolve()
    env = read_env_file(datadir / "stack.env")
    ports: dict[str, Any] = {}  # LocalStack's keywords (int ports, brokers), passed on with the caller's
    if env:
        ports["kafka_port"] = int(env["KAFKA_BOOTSTRAP"].split(",", 1)[0].rsplit(":", 1)[1])
        ports["redis_port"] = int(env["REDIS_URL"].rsplit(":", 1)[1].split("/", 1)[0])
        if "brokers" not in kwargs:  # the running stack's size (a cluster is kept as it was made)
            ports["brokers"] = int(env.get("KAFKA_BROKERS", "1"))
    return LocalStack(datadir, **ports, **kwargs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Local Kafka + Redis for apportion (no Docker).")
    ap.add_argument("command", choices=["up", "down", "status"])
    ap.add_argument("--dir", default=".run", help="data directory (default .run)")
    ap.add_argument("--kafka-port", type=int, default=0, help="0 = reuse the running one or pick a free port")
    ap.add_argument("--redis-port", type=int, default=0)
    ap.add_argument("--brokers", type=int, default=0, help="Kafka nodes (default: the running stack's, else 1)")
    args = ap.parse_args(argv)

    stack = attach(args.dir, echo=True, **({"brokers": args.brokers} if args.brokers else {}))
    if args.kafka_port:
        stack.kafka_port = args.kafka_port
    if args.redis_port:
        stack.redis_port = args.redis_port
    try:
        if args.command == "up":
            stack.start()
            print(
                f"\nKafka  {stack.bootstrap}\nRedis  {stack.redis_url}\n"
                f"(addresses also in {stack.env_file}; stop with: make down)"
            )
        elif args.command == "down":
            stack.stop()
        else:
            state = "running" if stack.running() else "not running"
            print(f"{state}: Kafka {stack.bootstrap}, Redis {stack.redis_url} ({stack.datadir})")
            return 0 if stack.running() else 1
    except StackError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
