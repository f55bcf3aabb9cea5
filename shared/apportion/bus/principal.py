"""A service started alone signs in as its own Kafka principal (rule D10.authentication), never as the CLI's
principal that the stack.env names; without its own password file it exits saying what to set."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from apportion.bus.security import (
    NODE_AGENT,
    READ_MODEL_WRITERS,
    declared_node_agents,
    node_agent_principal,
    principal_env,
    redis_env,
)
from apportion.settings import stack_env, stack_env_path


class NoOwnPrincipal(RuntimeError):
    """A service would sign in to Kafka as another principal (the stack.env's, the CLI's) than its own."""


#: The exit status of a service that has no principal of its own (:func:`start_as`): bad input, as the CLI's 2.
NO_OWN_PRINCIPAL_EXIT = 2


def own_principal(service: str) -> str | None:
    """Make this process service ``service``'s own Kafka principal before it connects (rule D10.authentication:
    each service its own principal; ``apportion.bus.security``), and return it (``None``: nothing to do).

    ``service`` is its package under ``services/`` (``node_agent``). A user in the environment
    (``APPORTION_KAFKA_USER``) is whoever started it chose: kept. A stack.env without a user: a broker
    without principals. Otherwise the stack.env names the CLI's principal (``ops``): the service signs in as its
    own (``policy``, ``accounting``, ``dispatcher``, the declared node agent's ``node-agent.<name>``) with the
    password file beside the CLI's in the broker's secrets directory, and as its own Redis user where it has
    one (the read-model writers).

    Raises:
        NoOwnPrincipal: the stack.env's user is not the service's and its password file is not readable here.
    """
    if os.environ.get("APPORTION_KAFKA_USER"):
        return None
    stack = stack_env()
    user = stack.get("APPORTION_KAFKA_USER")
    if not user:
        return None
    agents = declared_node_agents() if service == "node_agent" else ()
    own = (node_agent_principal(agents[0]) if agents else NODE_AGENT) if service == "node_agent" else service
    if user == own:
        return None
    given = stack.get("APPORTION_KAFKA_PASSWORD_FILE")
    secrets = Path(given).parent if given else None
    if secrets is None or not os.access(secrets / f"{own}.password", os.R_OK):
        where = secrets / f"{own}.password" if secrets is not None else f"DATADIR/kafka/secrets/{own}.password"
        raise NoOwnPrincipal(
            f"services.{service} has no Kafka principal of its own: the stack's settings ({stack_env_path()}) sign "
            f"in as {user!r}, the CLI's; set APPORTION_KAFKA_USER={own} and "
            f"APPORTION_KAFKA_PASSWORD_FILE={where} (docs/operations.md, one service alone)"
        )
    os.environ.update(principal_env(own, secrets))
    given = stack.get("APPORTION_REDIS_PASSWORD_FILE")
    redis = Path(given).parent if given else None
    if redis is not None and service in READ_MODEL_WRITERS and (redis / f"{service}.password").is_file():
        os.environ.update(redis_env(service, redis))
    return own


def start_as(service: str) -> None:
    """:func:`own_principal` at a service's start; without one, one line ``error: ...`` on stderr and exit
    :data:`NO_OWN_PRINCIPAL_EXIT` (rather than retrying what its ACLs refuse)."""
    try:
        own_principal(service)
    except NoOwnPrincipal as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(NO_OWN_PRINCIPAL_EXIT) from None
