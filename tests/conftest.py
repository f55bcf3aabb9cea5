"""Session fixtures for real infrastructure: ``kafka_bootstrap`` and ``redis_url``.

Where they come from, first match wins (DESIGN section 8):

1. ``KAFKA_BOOTSTRAP`` / ``REDIS_URL`` from the environment;
2. testcontainers (apache/kafka, redis) when a Docker engine answers;
3. the native stack from ``infra/`` (Kafka from Maven jars, Debian
   redis-server) on free ports in a temp dir, stopped after the session.

Registry topics are provisioned in every case. Tests that use either fixture
are marked ``integration`` automatically. Only infra fixtures live here; put
tier-specific fixtures in the tier's own conftest.py.

Identity (DESIGN section 10): the dispatcher checks every signature in every
test. ``dev_keyring`` (autouse, session) points ``APPORTION_KEYRING`` at a
fresh development keyring with an ops identity, so the CLI and the client
(and the processes tests start, which inherit the environment) enrol each
user on first use and sign every request (:func:`apportion.client.identity_for`).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator

import pytest

INFRA_FIXTURES = {"kafka_bootstrap", "redis_url", "kafka_topic_factory"}

# Hypothesis profiles: "mutate" (make mutate) runs each property on fewer, fixed examples, so one mutant is
# judged in seconds; the default profile is hypothesis' own. Chosen with HYPOTHESIS_PROFILE.
try:
    from hypothesis import settings as _hyp_settings

    _hyp_settings.register_profile("mutate", max_examples=15, derandomize=True, deadline=None)
    _hyp_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
except ImportError:  # pragma: no cover - hypothesis is a test dependency
    pass


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if INFRA_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)


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


@pytest.fixture(scope="session")
def _started_infra(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """Kafka and Redis started for this session: containers, else native."""
    from docker.errors import DockerException

    from apportion.bus.containers import start_containers
    from apportion.bus.stack import LocalStack

    try:
        containers = start_containers()
    except DockerException:
        containers = None
    if containers is not None:
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
