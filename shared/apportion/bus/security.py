"""Kafka principals, their credentials and their ACLs (rule D10.authentication; ``docs/security.md``).

Credentials and transport: the one home of how a client connects. Every Kafka
client apportion builds takes :func:`kafka_auth`: SASL_SSL (TLS) with
SCRAM-SHA-512 as the principal named by ``APPORTION_KAFKA_USER``, with the
password from ``APPORTION_KAFKA_PASSWORD`` or the file
``APPORTION_KAFKA_PASSWORD_FILE`` (each from the environment, else from the
stack's ``stack.env``: files or the environment, never the repo; the password is
never logged). The server's certificate is verified, host name included, against
the CA file ``APPORTION_TLS_CA`` (env, else stack.env; without it the system's
trust store), through one shared context per process
(:func:`apportion.bus.tls.client_context`). Without a user the client speaks
plaintext, which only a broker started with ``APPORTION_KAFKA_PLAINTEXT=1``
accepts (``infra/kafka/start.sh``); with ``APPORTION_NO_TLS=1`` it signs in
without TLS (SASL_PLAINTEXT), which only a broker started with the same
development flag accepts (it measures what TLS costs: ``bench/bench_live.py
--no-tls``). Redis clients take :func:`redis_auth` (TLS for a ``rediss://``
URL, verified against the same CA).

Principals (:data:`PRINCIPALS`) and what each may do (:data:`GRANTS`, one
declared table, applied per topic namespace like the topics):

============  =====================================================================================
principal     may
============  =====================================================================================
admin         everything (super user: provisioning; the broker itself)
dispatcher    read submissions, jobs, nodes, budgets, commands; write jobs, nodes, commands, dead letters
accounting    read jobs, nodes, budgets; write usage, dead letters; its own faust topics
policy        read budgets, usage; write budgets (its rejections), ranking, dead letters; its own topics
node-agent    read commands, nodes; write nodes (reports), jobs (workload outcomes), dead letters
researcher    write submissions; read what the CLI shows (submissions, jobs, nodes, budgets, usage,
              ranking)
ops           what researchers may, and write budgets and nodes (drain, cordon), read every topic,
              describe every group (the CLI's verdicts read the policy's committed offsets)
web           the dashboard (``services/web``): read what its pages show (every topic a job timeline
              reads: submissions, jobs, nodes, commands, budgets, usage, ranking); its own group; no write
============  =====================================================================================

Every service's consumer group is its own (a ``PREFIXED`` group ACL on its
name). :func:`provision_security` creates the SCRAM users (passwords made
once in the broker's secrets directory) and the ACLs, idempotently.

One principal per node agent (rule D10.authentication): the agents declared by name in
``APPORTION_KAFKA_NODE_AGENTS`` (comma-separated; env, else stack.env) are each their own
principal, ``node-agent.<name>`` (:func:`node_agent_principal`), with the ``node-agent`` rows of
the table: one agent's password is not another's, and ops can lock one agent out (its SCRAM
credential deleted) while the rest run on. ``node-agent`` itself stays the principal of an agent
not declared by name (the test fixtures' in-process agents). Which *nodes* an agent may report
for is decided by signatures, not by Kafka (ACLs cannot restrict by record key): ``docs/security.md``.
"""

from __future__ import annotations

import os
import re
import secrets
import ssl
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from apportion import topics
from apportion.privatefiles import write_private
from apportion.settings import topic_prefix

MECHANISM = "SCRAM-SHA-512"

#: The super user the broker is formatted with (``infra/kafka/start.sh``).
ADMIN = "admin"

#: Every principal apportion provisions (``admin`` exists from the storage format on), besides the node agents
#: declared by name (:func:`principals`).
PRINCIPALS = ("dispatcher", "accounting", "policy", "node-agent", "researcher", "ops", "web")

#: The node agents' role in :data:`GRANTS` (and the principal of an agent not declared by name).
NODE_AGENT = "node-agent"

#: Where the node agents are declared by name (:func:`declared_node_agents`).
NODE_AGENTS_SETTING = "APPORTION_KAFKA_NODE_AGENTS"

_AGENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}")


@dataclass(frozen=True, slots=True)
class Grant:
    """One row of the ACL table: ``principal`` may do ``operations`` on a resource.

    Attributes:
        principal: a name of :data:`PRINCIPALS`.
        resource: ``"topic"``, ``"group"`` or ``"transactional_id"``.
        name: a registry topic's base name (namespaced by :func:`apportion.topics.prefix`), or a
            group or topic name prefix (namespaced too) when ``prefixed``.
        operations: Kafka operation names (``READ``, ``WRITE``, ``DESCRIBE``, ``CREATE``, ``ALL``).
        prefixed: a ``PREFIXED`` resource pattern instead of ``LITERAL``.
    """

    principal: str
    resource: str
    name: str
    operations: tuple[str, ...]
    prefixed: bool = False


def _reads(principal: str, *bases: str) -> list[Grant]:
    return [Grant(principal, "topic", b, ("READ", "DESCRIBE")) for b in bases]


def _writes(principal: str, *bases: str) -> list[Grant]:
    return [Grant(principal, "topic", b, ("WRITE", "DESCRIBE")) for b in bases]


def _own(principal: str, *groups: str, topics_too: bool = False) -> list[Grant]:
    out = [Grant(principal, "group", g, ("READ", "DESCRIBE"), prefixed=True) for g in groups]
    if topics_too:  # faust's changelog and repartition topics are named after its app id
        out += [Grant(principal, "topic", g, ("ALL",), prefixed=True) for g in groups]
    return out


SUB, JOBS, NODES, CMDS = (t.base for t in (topics.SUBMISSIONS, topics.JOBS, topics.NODES, topics.COMMANDS))
BUDGETS, USAGE, RANKING, DEAD = (t.base for t in (topics.BUDGETS, topics.USAGE, topics.RANKING, topics.DEADLETTER))
CLI_READS = (SUB, JOBS, NODES, BUDGETS, USAGE, RANKING)

#: The ACL table (module docstring). Anything not granted here is denied.
GRANTS: tuple[Grant, ...] = (
    *_reads("dispatcher", SUB, JOBS, NODES, BUDGETS, CMDS),  # commands: the fencing floor (lease)
    *_writes("dispatcher", JOBS, NODES, CMDS, DEAD),
    *_own("dispatcher", "dispatcher"),
    # the one transactional id of every dispatcher instance (DispatcherSettings.transactional_id): only
    # a dispatcher may take it over, so nobody else can fence the leader or write in its name
    Grant("dispatcher", "transactional_id", "dispatcher", ("WRITE", "DESCRIBE")),
    *_reads("accounting", JOBS, NODES, BUDGETS),
    *_writes("accounting", USAGE, DEAD),
    *_own("accounting", "accounting", topics_too=True),
    *_reads("policy", BUDGETS, USAGE),
    *_writes("policy", BUDGETS, RANKING, DEAD),
    *_own("policy", "policy", topics_too=True),
    *_reads("node-agent", CMDS, NODES),
    *_writes("node-agent", NODES, JOBS, DEAD),
    *_own("node-agent", "node-agent"),
    *_reads("researcher", *CLI_READS),
    *_writes("researcher", SUB),
    *_reads("ops", *CLI_READS, CMDS, DEAD),
    *_writes("ops", SUB, BUDGETS, NODES),
    Grant("ops", "group", "", ("DESCRIBE",), prefixed=True),
    *_reads("web", *CLI_READS, CMDS),  # the dashboard: what `audit explain` reads for a job page; writes nothing
    *_own("web", "web"),
)


def node_agent_principal(agent: str) -> str:
    """The Kafka principal (SCRAM user) of node agent ``agent``: ``node-agent.<agent>``.

    Raises:
        ValueError: ``agent`` is not 1-63 letters, digits, ``_`` or ``-`` starting with a letter or digit.
    """
    if not _AGENT_NAME.fullmatch(agent):
        raise ValueError(
            f"node agent name {agent!r}: 1-63 letters, digits, '_' or '-', starting with a letter or digit"
        )
    return f"{NODE_AGENT}.{agent}"


def declared_node_agents() -> tuple[str, ...]:
    """The node agents declared by name in :data:`NODE_AGENTS_SETTING` (env, else stack.env), in order.

    Raises:
        ValueError: a name :func:`node_agent_principal` refuses.
    """
    raw = _setting(NODE_AGENTS_SETTING) or ""
    names = tuple(dict.fromkeys(n.strip() for n in raw.split(",") if n.strip()))
    for n in names:
        node_agent_principal(n)
    return names


def grants(agents: Iterable[str] = ()) -> tuple[Grant, ...]:
    """:data:`GRANTS` and, for each node agent of ``agents`` (names), the ``node-agent`` rows under its own
    principal (:func:`node_agent_principal`). Raises ``ValueError`` for a bad name."""
    role = [g for g in GRANTS if g.principal == NODE_AGENT]
    return GRANTS + tuple(replace(g, principal=node_agent_principal(a)) for a in agents for g in role)


def principals(agents: Iterable[str] = ()) -> tuple[str, ...]:
    """:data:`PRINCIPALS` and the principals of the node agents ``agents`` (names)."""
    return PRINCIPALS + tuple(node_agent_principal(a) for a in agents)


# --------------------------------------------------------------------------- client settings


def _setting(name: str) -> str | None:
    from apportion.settings import stack_env

    return os.environ.get(name) or stack_env().get(name) or None


#: The CA file every client verifies the servers against (env, else stack.env; ``apportion.bus.tls``).
TLS_CA_SETTING = "APPORTION_TLS_CA"

#: The development flag of a stack without TLS (``infra/kafka/start.sh``, ``infra/redis/start.sh``).
NO_TLS_SETTING = "APPORTION_NO_TLS"


def kafka_user() -> str | None:
    """The Kafka user this process authenticates as (``APPORTION_KAFKA_USER``: env, else stack.env); ``None``: it
    connects as the anonymous principal (plaintext, no SASL)."""
    return _setting("APPORTION_KAFKA_USER")


def tls_context() -> ssl.SSLContext:
    """The process's client TLS context for :data:`TLS_CA_SETTING`'s CA (the system's trust store without one)."""
    from apportion.bus.tls import client_context

    return client_context(_setting(TLS_CA_SETTING) or "")


def kafka_auth() -> dict[str, Any]:
    """Keyword settings for a kafka-python or aiokafka client (module docstring); ``{}`` for plaintext.

    Raises:
        RuntimeError: a user is set but no password (neither ``APPORTION_KAFKA_PASSWORD`` nor a readable
            ``APPORTION_KAFKA_PASSWORD_FILE``).
    """
    user = kafka_user()
    if not user:
        return {}
    password = _setting("APPORTION_KAFKA_PASSWORD")
    if password is None:
        path = _setting("APPORTION_KAFKA_PASSWORD_FILE")
        if path is None or not Path(path).is_file():
            raise RuntimeError(
                f"APPORTION_KAFKA_USER={user} but no password: set APPORTION_KAFKA_PASSWORD_FILE "
                "(or APPORTION_KAFKA_PASSWORD)"
            )
        password = Path(path).read_text().strip()
    return sasl_ssl(user, password)


def sasl_ssl(user: str, password: str) -> dict[str, Any]:
    """Client settings that sign in as ``user`` with ``password`` (SCRAM) over TLS verified by :func:`tls_context`:
    what :func:`kafka_auth` returns for the configured principal (tests sign in as each principal with it).
    Without TLS under :data:`NO_TLS_SETTING`."""
    if _setting(NO_TLS_SETTING) == "1":
        return {
            "security_protocol": "SASL_PLAINTEXT",
            "sasl_mechanism": MECHANISM,
            "sasl_plain_username": user,
            "sasl_plain_password": password,
        }
    return {
        "security_protocol": "SASL_SSL",
        "ssl_context": tls_context(),
        "sasl_mechanism": MECHANISM,
        "sasl_plain_username": user,
        "sasl_plain_password": password,
    }


def redis_tls(url: str | None = None) -> dict[str, Any]:
    """The TLS settings of a Redis client of ``url``: for a ``rediss://`` URL (or none given) while
    :data:`TLS_CA_SETTING` names a CA, verify the server against it, host name included; else ``{}``
    (a ``redis://`` URL is plaintext, which only a Redis started with ``APPORTION_NO_TLS=1`` serves; under that
    flag nothing asks for TLS). A caller that gives no URL gets the CA whenever one is set: with a CA, Redis is
    ``rediss://``."""
    ca = _setting(TLS_CA_SETTING)
    if not ca or _setting(NO_TLS_SETTING) == "1" or (url is not None and not url.startswith("rediss://")):
        return {}
    return {"ssl_ca_certs": ca, "ssl_cert_reqs": "required", "ssl_check_hostname": True}


def redis_auth(url: str | None = None) -> dict[str, Any]:
    """Keywords for ``redis.Redis.from_url(url, ...)``: ``username``/``password`` (``APPORTION_REDIS_USER``
    with ``APPORTION_REDIS_PASSWORD`` or ``APPORTION_REDIS_PASSWORD_FILE``; env, else stack.env) and
    :func:`redis_tls` of ``url``; ``{}`` without either.

    The URL stays free of secrets, so logging it leaks nothing.

    Raises:
        RuntimeError: a user is set but no password.
    """
    user = _setting("APPORTION_REDIS_USER")
    if not user:
        return redis_tls(url)
    password = _setting("APPORTION_REDIS_PASSWORD")
    if password is None:
        path = _setting("APPORTION_REDIS_PASSWORD_FILE")
        if path is None or not Path(path).is_file():
            raise RuntimeError(f"APPORTION_REDIS_USER={user} but no password: set APPORTION_REDIS_PASSWORD_FILE")
        password = Path(path).read_text().strip()
    return {"username": user, "password": password, **redis_tls(url)}


def redis_env(user: str, secrets_dir: Path) -> dict[str, str]:
    """The environment that makes a process's Redis client ``user`` (``infra/redis/start.sh``'s users)."""
    return {"APPORTION_REDIS_USER": user, "APPORTION_REDIS_PASSWORD_FILE": str(secrets_dir / f"{user}.password")}


def faust_auth() -> dict[str, Any]:
    """The same credentials as faust app settings (``broker_credentials``), or ``{}``."""
    auth = kafka_auth()
    if not auth:
        return {}
    import faust

    return {
        "broker_credentials": faust.SASLCredentials(
            username=auth["sasl_plain_username"],
            password=auth["sasl_plain_password"],
            mechanism=MECHANISM,
            ssl_context=auth.get("ssl_context"),  # SASL_SSL (None: SASL_PLAINTEXT, APPORTION_NO_TLS)
        )
    }


def principal_env(name: str, secrets_dir: Path) -> dict[str, str]:
    """The environment that makes a process's clients ``name`` (its password stays in its file)."""
    return {
        "APPORTION_KAFKA_USER": name,
        "APPORTION_KAFKA_PASSWORD_FILE": str(secrets_dir / f"{name}.password"),
    }


#: The services that keep read models in Redis, each as its own Redis user (``infra/redis/acl.sh``).
READ_MODEL_WRITERS = ("dispatcher", "accounting")


def service_credentials(
    service: str, agent: str, kafka_secrets: Path | None, redis_secrets: Path | None
) -> dict[str, str]:
    """The environment that makes ``service`` (its package under ``services/``, e.g. ``node_agent``) its own
    principal: its Kafka principal when ``kafka_secrets`` is given (the node agent's is
    :func:`node_agent_principal` of ``agent``), and its own Redis user when it is one of
    :data:`READ_MODEL_WRITERS` and ``redis_secrets`` is given. ``apportion stack up`` and ``make run`` use it."""
    env: dict[str, str] = {}
    if kafka_secrets is not None:
        who = node_agent_principal(agent) if service == "node_agent" else service.replace("_", "-")
        env.update(principal_env(who, kafka_secrets))
    if redis_secrets is not None and service in READ_MODEL_WRITERS:
        env.update(redis_env(service, redis_secrets))
    return env


# --------------------------------------------------------------------------- provisioning


def password_of(secrets_dir: Path, name: str) -> str:
    """``name``'s password in ``secrets_dir`` (``<name>.password``, mode 0600), made once."""
    path = secrets_dir / f"{name}.password"
    if not path.is_file():
        secrets_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_private(path, (secrets.token_hex(32) + "\n").encode(), exclusive=True)
    return path.read_text().strip()


def acls(grants: Iterable[Grant] = GRANTS) -> list[Any]:
    """The kafka-python ``ACL`` objects of ``grants`` in the current topic namespace."""
    from kafka.admin import ACL, ACLOperation, ACLPermissionType, ACLResourcePatternType, ResourcePattern, ResourceType

    _RESOURCE_TYPES = {
        "topic": ResourceType.TOPIC,
        "group": ResourceType.GROUP,
        "transactional_id": ResourceType.TRANSACTIONAL_ID,
    }
    out = []
    for g in grants:
        kind = _RESOURCE_TYPES[g.resource]
        pattern = ACLResourcePatternType.PREFIXED if g.prefixed else ACLResourcePatternType.LITERAL
        # a group is named with the namespace by some services and without it by others: allow both
        names = {topic_prefix() + g.name} | ({g.name} if g.resource == "group" else set())
        for name in sorted(names):
            pat = pattern
            if g.prefixed and not name:  # a prefix of nothing: every resource of the kind
                name, pat = "*", ACLResourcePatternType.LITERAL
            for op in g.operations:
                out.append(
                    ACL(
                        f"User:{g.principal}",
                        "*",
                        ACLOperation[op],
                        ACLPermissionType.ALLOW,
                        ResourcePattern(kind, name, pat),
                    )
                )
    return out


def provision_security(admin: Any, secrets_dir: Path | None, agents: Sequence[str] | None = None) -> tuple[int, int]:
    """Create the SCRAM users (when ``secrets_dir`` is given) and the ACLs of :func:`grants`; idempotent.

    Args:
        admin: a kafka-python admin client connected as a super user.
        secrets_dir: where the passwords are kept (the broker's ``secrets/``); ``None`` leaves users alone.
        agents: the node agents declared by name; ``None``: :func:`declared_node_agents`.

    Returns:
        ``(users upserted, ACLs created)``.

    Raises:
        RuntimeError: the broker refused a user or an ACL.
        ValueError: a node agent name :func:`node_agent_principal` refuses.
    """
    agents = declared_node_agents() if agents is None else tuple(agents)
    users = 0
    if secrets_dir is not None:
        from kafka.admin import UserScramCredentialUpsertion

        have = _scram_users(admin)
        ups = [
            UserScramCredentialUpsertion(name, MECHANISM, password_of(secrets_dir, name))
            for name in principals(agents)
            if name not in have
        ]
        if ups:
            bad = {u: e for u, e in admin.alter_user_scram_credentials(ups).items() if e}
            if bad:
                raise RuntimeError(f"cannot create Kafka users: {bad}")
        users = len(ups)
    wanted = acls(grants(agents))
    result = admin.create_acls(wanted)  # creating an ACL that exists is a no-op on the broker
    failed = result.get("failed", []) if isinstance(result, dict) else []
    if failed:
        raise RuntimeError(f"cannot create ACLs: {failed[:3]}")
    _wait_visible(admin, wanted)
    return users, len(wanted)


def _key(acl: Any) -> tuple:
    rp = acl.resource_pattern
    return (acl.principal, int(acl.operation), int(rp.resource_type), rp.resource_name, int(rp.pattern_type))


def _wait_visible(admin: Any, wanted: list[Any], deadline_s: float = 15.0) -> None:
    """Poll until the broker's authorizer lists every ACL of ``wanted`` (KRaft applies them asynchronously).

    Raises:
        RuntimeError: some are still missing after ``deadline_s`` wall seconds.
    """
    import time

    from kafka.admin import (
        ACLFilter,
        ACLOperation,
        ACLPermissionType,
        ACLResourcePatternType,
        ResourcePatternFilter,
        ResourceType,
    )

    everything = ACLFilter(
        None, None, ACLOperation.ANY, ACLPermissionType.ANY,
        ResourcePatternFilter(ResourceType.ANY, None, ACLResourcePatternType.ANY),
    )  # fmt: skip
    want = {_key(a) for a in wanted}
    end = time.monotonic() + deadline_s
    while True:
        have, _err = admin.describe_acls(everything)
        missing = want - {_key(a) for a in have}
        if not missing:
            return
        if time.monotonic() > end:
            raise RuntimeError(f"{len(missing)} ACLs not in force after {deadline_s:g} s, e.g. {sorted(missing)[0]}")
        time.sleep(0.1)  # poll interval; bounded by the deadline above


def _scram_users(admin: Any) -> set[str]:
    try:
        got = admin.describe_user_scram_credentials()
    except Exception:  # noqa: BLE001 - an old broker or none yet: upsert all
        return set()
    if isinstance(got, dict):
        return {u for u, v in got.items() if v and not isinstance(v, str)}
    return set()


def secrets_dir() -> Path | None:
    """The broker's secrets directory (``APPORTION_KAFKA_SECRETS_DIR``, env or stack.env), or ``None``."""
    path = _setting("APPORTION_KAFKA_SECRETS_DIR")
    return Path(path) if path else None
