"""What the infrastructure fixtures of ``tests/conftest.py`` hand out, beyond a bootstrap string or a URL."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class KafkaCluster:
    """The ``kafka_cluster`` fixture: a local multi-broker stack and the environment that connects to it.

    Attributes:
        stack: the :class:`apportion.bus.stack.LocalStack` (``node_ports``, ``node_pid``, ``start_kafka``).
        env: the variables that make a client the cluster's super user (set them with ``monkeypatch``; the
            session's own broker keeps the process environment).
    """

    stack: Any
    env: dict[str, str]

    @property
    def bootstrap(self) -> str:
        return str(self.stack.bootstrap)
