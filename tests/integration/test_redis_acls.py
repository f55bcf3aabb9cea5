"""Redis ACL users on the real server (rule D10.authentication; ``infra/redis/start.sh``).

The session's Redis runs with its default user off and one user per role:
a client without credentials is refused, the CLI's user reads the read
models and writes nothing, the dashboard's user reads the read models only,
a service's user writes apportion's keys only and cannot flush the database.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.kit.principals import as_user

pytestmark = pytest.mark.integration


def test_a_client_without_credentials_is_refused(redis_url: str) -> None:
    import redis

    from apportion.bus.security import redis_tls

    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(redis_url, **redis_tls(redis_url)).ping()


def test_redis_serves_tls_only_and_a_plaintext_client_is_not_answered(redis_url: str) -> None:
    """The plaintext port is off (``port 0``), the URL's port is the TLS port, and a client speaking plaintext
    to it (the same user and password, ``redis://``) gets no answer."""
    import redis

    assert redis_url.startswith("rediss://")
    admin = as_user(redis_url, "admin")
    assert admin.config_get("port") == {"port": "0"}
    port = redis_url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1]
    assert admin.config_get("tls-port") == {"tls-port": port}
    secrets = Path(os.environ["APPORTION_REDIS_SECRETS_DIR"])
    plain = redis.Redis.from_url(
        "redis://" + redis_url.split("://", 1)[1],
        username="admin",
        password=(secrets / "admin.password").read_text().strip(),
        socket_timeout=5,
    )
    with pytest.raises(redis.exceptions.ConnectionError):
        plain.ping()


@pytest.mark.parametrize("user", ["cli", "web"])
def test_the_cli_and_web_users_read_the_read_models_and_write_nothing(redis_url: str, user: str) -> None:
    import redis

    as_user(redis_url, "dispatcher").hset("acltest.apportion:rm:jobs", "j1", "{}")
    reader = as_user(redis_url, user)
    assert reader.hgetall("acltest.apportion:rm:jobs") == {"j1": "{}"}
    with pytest.raises(redis.exceptions.NoPermissionError):
        reader.hset("acltest.apportion:rm:jobs", "j1", "forged")
    with pytest.raises(redis.exceptions.NoPermissionError):
        reader.delete("acltest.apportion:rm:jobs")
    assert reader.hgetall("acltest.apportion:rm:jobs") == {"j1": "{}"}


def test_the_web_user_reads_nothing_of_apportions_but_the_read_models(redis_url: str) -> None:
    import redis

    as_user(redis_url, "accounting").hset("acltest.apportion:ckpt:accounting", "header", "h")
    assert as_user(redis_url, "cli").hgetall("acltest.apportion:ckpt:accounting") == {"header": "h"}
    with pytest.raises(redis.exceptions.NoPermissionError):
        as_user(redis_url, "web").hgetall("acltest.apportion:ckpt:accounting")  # apportion's, not a read model


@pytest.mark.parametrize("user", ["dispatcher", "accounting"])
def test_a_services_user_keeps_to_apportions_keys_and_cannot_flush(redis_url: str, user: str) -> None:
    import redis

    r = as_user(redis_url, user)
    assert r.hset(f"acltest.apportion:rm:{user}", "k", "v") in (0, 1)
    with pytest.raises(redis.exceptions.NoPermissionError):
        r.set("someone-elses-key", "x")
    with pytest.raises(redis.exceptions.NoPermissionError):
        r.flushdb()
