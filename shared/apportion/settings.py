"""Connection settings shared by the CLI, the Python client and the services.

Resolution order for each address (first wins):

1. an explicit argument (``--bootstrap``, ``--redis``);
2. the environment: ``APPORTION_KAFKA_BOOTSTRAP`` / ``APPORTION_REDIS_URL``,
   or the plain ``KAFKA_BOOTSTRAP`` / ``REDIS_URL`` that the test fixtures use;
3. ``stack.env`` of the local stack started by ``make up``: in
   ``APPORTION_STACK_DIR`` when set, else the nearest ``.run/`` in the current
   directory or one of its parents (as git finds ``.git``), so the CLI works
   from any folder of a checkout;
4. the defaults ``127.0.0.1:9092`` and ``redis://127.0.0.1:6379/0``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_BOOTSTRAP = "127.0.0.1:9092"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def stack_env_path() -> Path | None:
    """The ``stack.env`` to read (rule 3 of the module docstring), or ``None`` when there is none."""
    if "APPORTION_STACK_DIR" in os.environ:
        path = Path(os.environ["APPORTION_STACK_DIR"]) / "stack.env"
        return path if path.is_file() else None
    here = Path.cwd()
    for d in (here, *here.parents):
        if (d / ".run" / "stack.env").is_file():
            return d / ".run" / "stack.env"
    return None


def _stack_env() -> dict[str, str]:
    path = stack_env_path()
    out: dict[str, str] = {}
    if path is not None:
        for line in path.read_text().splitlines():
            if "=" in line and not line.lstrip().startswith("#"):
                k, v = line.split("=", 1)
                out[k.strip()] = v.strip()
    return out


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
