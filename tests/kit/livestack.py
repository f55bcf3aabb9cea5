"""A live stack for integration tests: `apportion stack up` of the four services and the web dashboard on the
session's Kafka and Redis, in a namespace and Redis db of its own, stopped on exit, and :class:`Stack`, a CLI runner
bound to such a stack."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest


def until(fn: Callable[[], Any], what: str, deadline_s: float = 60.0) -> Any:
    """Poll ``fn`` every 0.2 s until it returns something true; fail the test after ``deadline_s`` (bounded wait)."""
    end = time.monotonic() + deadline_s
    while not (got := fn()):
        if time.monotonic() > end:
            pytest.fail(f"timed out after {deadline_s}s waiting for {what}")
        time.sleep(0.2)
    return got


@contextmanager
def live_stack(
    kafka_bootstrap: str,
    redis_url: str,
    tmp_path_factory: pytest.TempPathFactory,
    *,
    name: str,
    db: int,
    sim_nodes: int,
    gpus_per_node: int,
    simulate_json: tuple[str, ...] = (),
) -> Iterator[tuple[Any, dict[str, str], Path]]:
    """``(stack info, CLI environment, run dir)`` of a fresh stack: topics under ``name<random>.``, Redis db
    ``db`` flushed first, ``sim_nodes`` simulated nodes of ``gpus_per_node`` GPUs, the per-user state file in
    a temp folder (``XDG_STATE_HOME``) so the developer's own stack is not touched. The dashboard connects as
    the read-only principal ``web`` (the session's secrets directories are in the environment) and shows
    ``simulate_json`` on its /simulate page."""
    import redis as redis_lib

    from apportion.cli import stack as stack_mod

    run_dir = tmp_path_factory.mktemp(f"{name}-run")
    state = tmp_path_factory.mktemp(f"{name}-state")
    prefix = f"{name}{uuid.uuid4().hex[:8]}."
    db_url = redis_url.rsplit("/", 1)[0] + f"/{db}"
    from apportion.bus.security import redis_auth

    redis_lib.Redis.from_url(db_url, **redis_auth(db_url)).flushdb()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_STATE_HOME", str(state))
        for v in ("APPORTION_KAFKA_BOOTSTRAP", "APPORTION_REDIS_URL", "APPORTION_TOPIC_PREFIX", "APPORTION_STACK_DIR"):
            mp.delenv(v, raising=False)
        info = stack_mod.up(
            run_dir,
            sim_nodes=sim_nodes,
            gpus_per_node=gpus_per_node,
            bootstrap=kafka_bootstrap,
            redis_url=db_url,
            prefix=prefix,
            simulate_json=simulate_json,
            say=lambda *_: None,
        )
        env = {
            "APPORTION_KAFKA_BOOTSTRAP": info.bootstrap,
            "APPORTION_REDIS_URL": info.redis_url,
            "APPORTION_TOPIC_PREFIX": prefix,
            "XDG_STATE_HOME": str(state),
        }
        try:
            yield info, env, run_dir
        finally:
            stack_mod.down(run_dir, say=lambda *_: None)


class Stack:
    """A live stack and a CLI runner bound to it."""

    def __init__(self, info: Any, env: dict[str, str | None]) -> None:
        from typer.testing import CliRunner

        self.info = info
        self.env = env
        self.runner = CliRunner()

    def run(self, *args: str, code: int = 0, env: dict[str, str | None] | None = None) -> Any:
        from apportion.cli.main import app

        res = self.runner.invoke(app, list(args), env=env if env is not None else self.env)
        assert res.exit_code == code, f"exit {res.exit_code} != {code}: {res.output}"
        return res

    def json(self, *args: str) -> Any:
        return json.loads(self.run(*args, "--json").stdout)

    def until(self, fn: Callable[[], Any], what: str) -> Any:
        return until(fn, what)
