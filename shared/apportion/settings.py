"""Connection settings shared by the CLI, the Python client and the services.

Resolution order for each address (first wins):

1. an explicit argument (``--bootstrap``, ``--redis``);
2. the environment: ``APPORTION_KAFKA_BOOTSTRAP`` / ``APPORTION_REDIS_URL``,
   or the plain ``KAFKA_BOOTSTRAP`` / ``REDIS_URL`` that the test fixtures use;
3. ``stack.env`` of the local stack started by ``make up`` / ``apportion stack up``:
   in ``APPORTION_STACK_DIR`` when set, else the nearest ``.run/`` in the current
   directory or one of its parents (as git finds ``.git``; after ``apportion stack down``
   its ``researcher/stack.env``, the marker of the stopped stack, unless a stack started since
   wrote the per-user state file), else the per-user
   state file ``$XDG_STATE_HOME/apportion/stack.env`` (default
   ``~/.local/state/apportion/stack.env``) that ``apportion stack up`` writes,
   so the CLI finds the stack from any folder;
4. the defaults ``127.0.0.1:9092`` and ``redis://127.0.0.1:6379/0``.

A ``stack.env`` that ``apportion stack down`` left as a marker of a stopped stack (:data:`STOPPED`, no addresses)
names no address: resolving one from it raises :class:`StackStopped` rather than trying the defaults.

The topic namespace in force is ``APPORTION_TOPIC_PREFIX`` (:func:`topic_prefix`,
the one reader of it; the registry :mod:`apportion.topics` takes the prefix
as an argument); the stack's (in its ``stack.env``) applies when the
environment sets none (:func:`apply_stack_prefix`), and so does its clock
(:func:`event_clock`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from apportion.clock import ScaledClock, WallClock
    from apportion.topics import Topic

DEFAULT_BOOTSTRAP = "127.0.0.1:9092"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"

#: The key of a ``stack.env`` left by ``apportion stack down`` for the stack it stopped: when (UTC), with its
#: ``RUN_DIR``.
STOPPED = "APPORTION_STACK_STOPPED"


class StackStopped(RuntimeError):
    """The ``stack.env`` in force is the marker of a stopped stack and nothing else names an address."""


def user_state_dir() -> Path:
    """``$XDG_STATE_HOME/apportion``, default ``~/.local/state/apportion``."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "apportion"


def default_data_dir() -> Path:
    """Where the traces are: ``$APPORTION_DATA_DIR``, else ``../shared/data`` beside the checkout."""
    env = os.environ.get("APPORTION_DATA_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[3] / "shared" / "data"


def user_stack_env() -> Path:
    """The per-user ``stack.env`` that ``apportion stack up`` writes (rule 3)."""
    return user_state_dir() / "stack.env"


def stack_env_path() -> Path | None:
    """The ``stack.env`` to read (rule 3 of the module docstring), or ``None`` when there is none."""
    if "APPORTION_STACK_DIR" in os.environ:
        path = Path(os.environ["APPORTION_STACK_DIR"]) / "stack.env"
        return path if path.is_file() else None
    try:
        here = Path.cwd()
    except OSError:  # the working directory was removed
        here = None
    user = user_stack_env()
    for d in (here, *here.parents) if here is not None else ():
        if (d / ".run" / "stack.env").is_file():
            return d / ".run" / "stack.env"
        if _is_stopped_marker(d / ".run" / "researcher" / "stack.env"):  # the owner's, after `down`
            # `down` removed the per-user file naming this stack: one there now is of a stack started since
            return user if user.is_file() else d / ".run" / "researcher" / "stack.env"
    return user if user.is_file() else None


def _is_stopped_marker(path: Path) -> bool:
    """True when ``path`` is the marker ``apportion stack down`` leaves of a stopped stack (:data:`STOPPED`)."""
    try:
        return STOPPED in read_env_file(path)
    except OSError:
        return False


def read_env_file(path: Path) -> dict[str, str]:
    """Parse a ``KEY=value`` file such as a stack.env (blank lines and ``#`` comments ignored; ``{}`` when
    there is no file)."""
    out: dict[str, str] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#") and "=" in line:
                k, v = line.split("=", 1)
                out[k.strip()] = v.strip()
    return out


def stack_env() -> dict[str, str]:
    """The ``KEY=value`` pairs of the stack.env in force (``{}`` without one)."""
    return _stack_env()


def topic_prefix() -> str:
    """The topic namespace prefix in force: ``APPORTION_TOPIC_PREFIX``, default empty.

    Read at each call (a CLI command may apply its stack's prefix, :func:`apply_stack_prefix`, and a test its own);
    it also namespaces the Redis keys and consumer groups of a stack.
    """
    return os.environ.get("APPORTION_TOPIC_PREFIX", "")


def topic_name(topic: Topic) -> str:
    """Physical name of the registry topic ``topic`` in the namespace in force (:func:`topic_prefix`)."""
    return topic.named(topic_prefix())


def apply_stack_prefix() -> str | None:
    """Set ``APPORTION_TOPIC_PREFIX`` from the stack.env when neither it nor a Kafka address is in the
    environment (a stack found by rule 3 brings its namespace); returns the prefix applied, if any."""
    env = os.environ
    if "APPORTION_TOPIC_PREFIX" in env or env.get("APPORTION_KAFKA_BOOTSTRAP") or env.get("KAFKA_BOOTSTRAP"):
        return None
    pre = _stack_env().get("APPORTION_TOPIC_PREFIX")
    if pre:
        env["APPORTION_TOPIC_PREFIX"] = pre
        return pre
    return None


def event_clock() -> WallClock | ScaledClock:
    """The event-time clock the services of this stack use (:func:`apportion.clock.make_clock` of
    ``APPORTION_TIME_SCALE`` and ``APPORTION_CLOCK_EPOCH_WALL``/``_EVENT`` from the environment, else
    from the stack.env): heartbeat ages are computed against it."""
    from datetime import datetime

    from apportion.clock import make_clock

    stack = _stack_env()

    def get(name: str) -> str | None:
        return os.environ.get(name) or stack.get(name) or None

    scale = float(get("APPORTION_TIME_SCALE") or 1.0)
    ew, ee = get("APPORTION_CLOCK_EPOCH_WALL"), get("APPORTION_CLOCK_EPOCH_EVENT")
    return make_clock(
        scale,
        datetime.fromisoformat(ew) if ew else None,
        datetime.fromisoformat(ee) if ee else None,
    )


def _stack_env() -> dict[str, str]:
    path = stack_env_path()
    return read_env_file(path) if path is not None else {}


@dataclass(frozen=True, slots=True)
class Connection:
    """Where Kafka and Redis are.

    Attributes:
        bootstrap: Kafka ``host:port[,host:port]``.
        redis_url: ``redis://host:port/db``.
    """

    bootstrap: str
    redis_url: str

    @classmethod
    def resolve(cls, bootstrap: str | None = None, redis_url: str | None = None) -> Connection:
        """Resolve both addresses by the order in the module docstring."""
        env = os.environ
        stack = _stack_env()
        if STOPPED in stack and not (
            (bootstrap or env.get("APPORTION_KAFKA_BOOTSTRAP") or env.get("KAFKA_BOOTSTRAP"))
            and (redis_url or env.get("APPORTION_REDIS_URL") or env.get("REDIS_URL"))
        ):
            raise StackStopped(
                f"no stack running: the stack of {stack.get('RUN_DIR', '?')} was stopped at {stack[STOPPED]} "
                f"({stack_env_path()}; `apportion stack up` starts one)"
            )
        b = (
            bootstrap
            or env.get("APPORTION_KAFKA_BOOTSTRAP")
            or env.get("KAFKA_BOOTSTRAP")
            or stack.get("KAFKA_BOOTSTRAP")
            or DEFAULT_BOOTSTRAP
        )
        r = (
            redis_url
            or env.get("APPORTION_REDIS_URL")
            or env.get("REDIS_URL")
            or stack.get("REDIS_URL")
            or DEFAULT_REDIS_URL
        )
        return cls(b, r)

    def _servers(self) -> list[tuple[str, str]]:
        """``(host, port)`` of each Kafka bootstrap server as written (brackets of an IPv6 literal kept; port ``""``
        where it names none) and of the Redis URL (Redis's default 6379 when it names none): the one parse of both
        that :meth:`ports` and :meth:`hosts` read."""
        from urllib.parse import urlsplit

        servers = [server.strip().rsplit(":", 1) for server in self.bootstrap.split(",") if server.strip()]
        redis = urlsplit(self.redis_url)
        kafka = [(parts[0], parts[1] if len(parts) == 2 else "") for parts in servers]
        return [*kafka, (redis.hostname or "localhost", str(redis.port or 6379))]

    def ports(self) -> set[int]:
        """The ports of the Kafka bootstrap servers and of the Redis URL (Redis's default 6379 when it names none):
        the control plane's ports a node agent closes to jobs by default.

        Raises:
            ValueError: a bootstrap server without a numeric port.
        """
        return {int(port) for _, port in self._servers()}

    def hosts(self) -> set[str]:
        """The host names or addresses of the Kafka bootstrap servers and of the Redis URL (brackets of an IPv6
        literal taken off): the control plane's hosts, whose addresses a node agent closes to jobs on
        :meth:`ports` as it does loopback."""
        return {host.strip("[]") for host, _ in self._servers()}
