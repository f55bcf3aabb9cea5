"""Session fixtures for real infrastructure: ``kafka_bootstrap`` and ``redis_url``.

Where they come from, first match wins (rule D8.tests):

1. ``KAFKA_BOOTSTRAP`` / ``REDIS_URL`` from the environment;
2. testcontainers (apache/kafka, redis) when a Docker engine answers, secured as
   the native stack (TLS with SASL/SCRAM and ACLs, Redis TLS and ACL users: :mod:`apportion.bus.containers`);
3. the native stack from ``infra/`` (Kafka from Maven jars, Debian
   redis-server) on free ports in a temp dir, stopped after the session.

Every path is encrypted (rule D10.transport): the stack makes its
CA and the servers' certificate once (:mod:`apportion.bus.tls`), Kafka listens
SASL_SSL only and Redis TLS only (``rediss://``), and ``APPORTION_TLS_CA`` in
the environment makes every client of the session verify them.

Registry topics are provisioned in every case. Tests that use either fixture
are marked ``integration`` automatically.

``kafka_cluster`` is a module fixture, used only by the tests that lose a
broker (``test_broker_loss.py``): a 3-node KRaft cluster
(``infra/kafka/start-cluster.sh``, replication 3, ``min.insync.replicas`` 2)
with its own Redis, started when the module's first test asks for it and
stopped after its last, so the rest of the suite stays on the single fast
broker and does not share the machine with three idle brokers. Only infra fixtures live here; put
tier-specific fixtures in the tier's own conftest.py.

Identity (rule D10.proven-user): the dispatcher checks every signature in every
test. ``dev_keyring`` (autouse, session) points ``APPORTION_KEYRING`` at a
fresh development keyring with an ops identity, so the CLI and the client
(and the processes tests start, which inherit the environment) enrol each
user on first use and sign every request (:func:`apportion.client.identity_for`).
"""

from __future__ import annotations

import os
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.kit import environment
from tests.kit.infra import KafkaCluster

# The CLI's rich consoles fix their width at import when COLUMNS is set, and pytest-xdist's workers start with
# COLUMNS=80: without it the width follows each invocation's COLUMNS, as the CLI tests set it.
os.environ.pop("COLUMNS", None)

ROOT = Path(__file__).resolve().parents[1]

#: ``pytester`` runs a small test file in-process, with our fixtures, for the tests of the environment check.
pytest_plugins = ("pytester",)

INFRA_FIXTURES = {"kafka_bootstrap", "redis_url", "kafka_topic_factory", "kafka_cluster"}

#: Kafka nodes of the ``kafka_cluster`` fixture.
CLUSTER_BROKERS = 3

# Hypothesis profiles: "mutate" (make mutate) runs each property on fewer, fixed examples, so one mutant is
# judged in seconds; the default profile is hypothesis' own. Chosen with HYPOTHESIS_PROFILE.
try:
    from hypothesis import settings as _hyp_settings

    _hyp_settings.register_profile("mutate", max_examples=15, derandomize=True, deadline=None)
    _hyp_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
except ImportError:  # pragma: no cover - hypothesis is a test dependency
    pass


#: Test files that act on the machine itself (Unix accounts, cgroups, device files, their own stacks) without the
#: infra fixtures: they run in the serial group with the integration tests.
SERIAL_FILES = (
    "tests/chaos/",
    "tests/service/test_node_agent_boundary.py",
    "tests/service/test_node_agent_checkpoints.py",
    "tests/service/test_gpu_check.py",
)


#: Integration tests that start a stack of their own (broker, Redis and services in their own directory) and use
#: no session fixture, Unix account or cgroup: their own xdist group, so they run beside the serial one.
OWN_STACK_FILES = (
    "tests/integration/test_service_outages.py",
    "tests/integration/test_broker_loss.py",
    "tests/chaos/test_chaos_campaign.py",
)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook turns ``xdist_group`` marks into the group's node ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the tests that need Kafka and Redis ``integration``; put them, and the tests that act on the machine,
    in one xdist group, ``serial``: under ``make test`` (pytest-xdist, ``--dist loadgroup``) they run one after the
    other on one worker (one broker, one set of test accounts) while the other worker takes the pure tiers and the
    tests with stacks of their own (group ``own-stack``)."""
    for item in items:
        if INFRA_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)
        path = Path(str(item.fspath)).resolve().relative_to(ROOT).as_posix()
        if path in OWN_STACK_FILES:
            item.add_marker(pytest.mark.xdist_group("own-stack"))
        elif item.get_closest_marker("integration") is not None or path.startswith(SERIAL_FILES):
            item.add_marker(pytest.mark.xdist_group("serial"))


@pytest.fixture(scope="session", autouse=True)
def dev_keyring(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A development keyring for the session (``APPORTION_KEYRING``): ``ops.json``, users enrolled on first use."""
    from apportion.cli.stack import dev_keyring as make

    path = str(make(tmp_path_factory.mktemp("keyring") / "keyring"))
    saved = os.environ.get("APPORTION_KEYRING")
    os.environ["APPORTION_KEYRING"] = path
    try:
        yield path
    finally:
        if saved is None:
            os.environ.pop("APPORTION_KEYRING", None)
        else:
            os.environ["APPORTION_KEYRING"] = saved


@pytest.fixture(autouse=True)
def machine_stack_hidden_below_integration(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The unit, service and simulator tiers never read the machine's own stack: after ``make up`` (its
    ``stack.env``) or ``make down`` (the marker of a stopped stack, which refuses every address) in this checkout,
    a test that resolves addresses would otherwise reach, or be refused by, the developer's stack. A test that
    means to read one sets ``APPORTION_STACK_DIR`` itself (``monkeypatch`` restores both after it)."""
    path = Path(str(request.node.fspath)).resolve().relative_to(ROOT).as_posix()
    if path.startswith(("tests/unit/", "tests/service/", "tests/sim/")):
        environment.hide_machine_stack(monkeypatch, tmp_path_factory.mktemp("no-stack"))


@pytest.fixture(autouse=True)
def environment_unchanged() -> Iterator[None]:
    """Fail a test that leaves a watched variable (``APPORTION_*``, ``KAFKA_*``, ``REDIS_*``, ``TZ``,
    ``COLUMNS``: :mod:`tests.kit.environment`) changed, and put it back so later tests of the worker start clean.

    Autouse and defined here, it is set up before every fixture of the test's own scope and torn down after them,
    ``monkeypatch`` included, so a variable set through ``monkeypatch`` is restored before the comparison. Fixtures
    of a wider scope (the session's broker, Redis and keyring) are set up before this snapshot and torn down after
    the comparison, so what they set on purpose is not a leak."""
    before = environment.watched(os.environ)
    yield
    after = environment.watched(os.environ)
    message = environment.leak_message(before, after)
    if message is not None:
        environment.restore(before)
        pytest.fail(message, pytrace=False)


class KafkaClientLeftRunning(UserWarning):
    """A test left a kafka-python client running (:func:`kafka_clients_closed`)."""


@pytest.fixture(autouse=True)
def kafka_clients_closed(request: pytest.FixtureRequest) -> Iterator[None]:
    """Close every kafka-python client the test made and left running, and say which test left which
    (``KafkaClientLeftRunning``, naming the client's network thread): its thread would run on under every later
    test of the worker, drawing on the global ``random`` module (:mod:`tests.kit.kafka_clients`). Clients of
    fixtures of a wider scope are made before this block and are theirs to close."""
    from tests.kit.kafka_clients import closing_kafka_clients, left_running

    with closing_kafka_clients() as made:
        yield
        left = left_running(made)
    if left:
        warnings.warn(
            f"{request.node.nodeid} left kafka-python clients running ({', '.join(left)}); closed after it",
            KafkaClientLeftRunning,
            stacklevel=1,
        )


@pytest.fixture(autouse=True)
def collector_restored() -> Iterator[None]:
    """Put the cyclic collector back as the test found it: code under test that settles the heap
    (:func:`apportion.heap.settle_heap`: the dispatcher's rebuild, the forecast commands) freezes the worker's
    objects and raises its thresholds, which later tests of the worker must not inherit."""
    import gc

    thresholds = gc.get_threshold()
    yield
    if gc.get_freeze_count() or gc.get_threshold() != thresholds:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


@pytest.fixture(scope="session")
def _started_infra(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """Kafka and Redis started for this session: containers, else native."""
    from docker.errors import DockerException

    from apportion.bus.containers import start_containers
    from apportion.bus.stack import LocalStack

    try:
        containers = start_containers(tmp_path_factory.mktemp("container-secrets"))
    except DockerException:
        containers = None
    if containers is not None:
        os.environ.update(containers.env)  # SASL and Redis ACLs: the session's clients are its admin
        try:
            yield containers.bootstrap, containers.redis_url
        finally:
            containers.stop()
        return
    stack = LocalStack(tmp_path_factory.mktemp("stack"))
    try:
        stack.start()
    except Exception as exc:  # noqa: BLE001 - turn into a readable failure
        pytest.fail(f"cannot start the native Kafka/Redis stack from infra/: {exc}", pytrace=False)
    try:
        yield stack.bootstrap, stack.redis_url
    finally:
        stack.stop()


@pytest.fixture(scope="session")
def kafka_bootstrap(request: pytest.FixtureRequest) -> str:
    """``host:port`` of a Kafka broker with the registry topics provisioned."""
    from apportion.bus.provision import provision

    bootstrap = os.environ.get("KAFKA_BOOTSTRAP") or request.getfixturevalue("_started_infra")[0]
    provision(bootstrap)
    return bootstrap


@pytest.fixture(scope="session")
def redis_url(request: pytest.FixtureRequest) -> str:
    """``redis://host:port/db`` of a Redis server."""
    return os.environ.get("REDIS_URL") or request.getfixturevalue("_started_infra")[1]


@pytest.fixture
def kafka_topic_factory(kafka_bootstrap: str) -> Callable[..., str]:
    """Create a fresh, uniquely named topic: ``make(partitions=1, **configs) -> name``."""
    from apportion.bus.provision import admin_client, create_missing
    from apportion.topics import Topic

    def make(prefix: str = "test", partitions: int = 1, retention_ms: int = -1, compact: bool = False) -> str:
        name = f"{prefix}.{uuid.uuid4().hex[:12]}"
        admin = admin_client(kafka_bootstrap)
        try:
            create_missing(admin, [Topic(name, "key", partitions, retention_ms, compact)])
        finally:
            admin.close()
        return name

    return make


@pytest.fixture(scope="module")
def kafka_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaCluster]:
    """A native 3-broker KRaft cluster with TLS, SASL/SCRAM and ACLs, topics provisioned (replication 3,
    ``min.insync.replicas`` 2), and its own Redis; stopped after the module that asked for it (three idle JVMs
    for the rest of the session slowed every later test). Only for tests that need more than one broker (it
    costs about a minute to start on the shared machine)."""
    from apportion.bus.stack import LocalStack

    saved = dict(os.environ)
    stack = LocalStack(tmp_path_factory.mktemp("cluster"), brokers=CLUSTER_BROKERS)
    try:
        stack.start()  # provisions as the cluster's admin, through the process environment
        env = stack.client_env()
    except Exception as exc:  # noqa: BLE001 - turn into a readable failure
        pytest.fail(f"cannot start the native {CLUSTER_BROKERS}-broker cluster from infra/: {exc}", pytrace=False)
    finally:  # the session's single broker keeps its credentials
        os.environ.clear()
        os.environ.update(saved)
    try:
        yield KafkaCluster(stack, env)
    finally:
        stack.stop()
