"""The four services on real Kafka and Redis, in-process, on an accelerated clock (``SCALE`` event seconds per
wall second): ``running_cluster`` starts them on a fresh topic namespace and Redis database, the ``cluster``
fixture gives each test its own, and :class:`Cluster` is the handle a test talks to them through (submissions in,
the log out, every wait bounded by ``DEADLINE_S``). ``of_job`` lists a job's events by type.

Everything the services write lives in the cluster's own folder (the test's ``tmp_path``, or a temporary folder
removed when the cluster stops): the node agents' journals and job files in ``node_agent``, the policy's data in
``policy`` and the logs of the processes a test starts in ``logs``."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from apportion.bus.security import redis_auth
from apportion.settings import topic_name

SCALE = 60.0  # event seconds per wall second
DEADLINE_S = 60.0


@dataclass
class Cluster:
    """Handles on a running in-process cluster."""

    bootstrap: str
    redis_url: str
    clock: Any
    producer: Any
    stop: asyncio.Event
    tag: str
    epoch: datetime
    root: Path

    def spawn_env(self, env: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of a process :meth:`spawn` starts: this cluster's folders (:func:`state_settings`;
        ``env`` may name others), ``env``, then the cluster's Kafka, Redis and clock."""
        import os

        dirs = state_settings(self.root)
        out = {**os.environ, "APPORTION_STATE_DIR": str(dirs["state_dir"]), "APPORTION_FAUST_DIR": dirs["faust_dir"]}
        out.update(env or {})
        out.update(
            APPORTION_KAFKA_BOOTSTRAP=self.bootstrap,
            APPORTION_REDIS_URL=self.redis_url,
            APPORTION_TIME_SCALE=str(SCALE),
            APPORTION_CLOCK_EPOCH_WALL=self.epoch.isoformat(),
            APPORTION_CLOCK_EPOCH_EVENT=self.epoch.isoformat(),
            APPORTION_LOG_JSON="false",
        )
        return out

    def log_path(self, module: str, args: tuple[str, ...]) -> Path:
        """Where :meth:`spawn` writes the output of ``python -m module args``: ``<root>/logs``."""
        return self.root / "logs" / f"{module.rsplit('.', 1)[-1]}-{len(args)}.log"

    def spawn(self, module: str, *args: str, env: dict[str, str] | None = None) -> Any:
        """Start ``python -m module args`` as a process sharing this cluster's namespace, clock and folder."""
        import subprocess
        import sys

        log = self.log_path(module, args)
        log.parent.mkdir(parents=True, exist_ok=True)
        logf = open(log, "ab")
        return subprocess.Popen(
            [sys.executable, "-m", module, *args],
            env=self.spawn_env(env),
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=logf,
        )

    def publish(self, *evts: Any) -> None:
        for e in evts:
            self.producer.publish(e)

    def log(self) -> list[Any]:
        from apportion import topics
        from apportion.bus.reader import read_log

        names = [topic_name(t) for t in topics.ALL_TOPICS]
        return [r.event for r in read_log(self.bootstrap, names) if r.event is not None]

    def submit(
        self, job_id: str, budget: str, gpus: int, min_runtime_s: float, duration_s: float, user: str = "alice"
    ) -> Any:
        from apportion import events
        from apportion.client import identity_for

        signer = identity_for(user, bootstrap=self.bootstrap)  # the dev keyring (tests/conftest.py)
        now = self.clock.now()
        ev = events.JobSubmitted(
            job_id=job_id,
            budget=budget,
            user=user,
            gpus_per_replica=gpus,
            min_runtime_s=min_runtime_s,
            duration_s=duration_s,
            submitted_at=now,
            ts=now,
            producer="test",
        )
        ev = signer.sign(ev)
        self.publish(ev)
        return ev

    async def until(self, pred: Callable[[list[Any]], Any], what: str) -> list[Any]:
        """Poll the log until ``pred(log)`` is truthy; fail after the deadline."""
        loop = asyncio.get_running_loop()
        end = loop.time() + DEADLINE_S
        while True:
            evs = await asyncio.to_thread(self.log)
            if pred(evs):
                return evs
            if loop.time() > end:
                kinds = [(type(e).__name__, getattr(e, "job_id", getattr(e, "node_id", ""))) for e in evs[-30:]]
                pytest.fail(f"timed out after {DEADLINE_S}s waiting for {what}; last events: {kinds}")
            await asyncio.sleep(0.1)


def of_job(evs: list[Any], job_id: str) -> list[str]:
    """Type names of the job-topic and submission events of ``job_id``, in log order."""
    from apportion import events

    return [
        e.type
        for e in evs
        if getattr(e, "job_id", None) == job_id
        and events.TOPIC_OF[e.type].base in ("apportion.jobs", "apportion.submissions")
    ]


def state_settings(root: Path) -> dict[str, Any]:
    """The services' folders in a cluster's folder ``root``: the node agents' (``state_dir``: journals, job files)
    and the policy's (``faust_dir``, made here: the policy makes its own folder in it)."""
    (root / "policy").mkdir(parents=True, exist_ok=True)
    return {"state_dir": root / "node_agent", "faust_dir": str(root / "policy")}


@contextlib.contextmanager
def cluster_root(root: Path | None) -> Iterator[Path]:
    """``root`` as it is (the test's ``tmp_path``: pytest keeps or removes it), or, with none, a new temporary
    folder removed on leaving."""
    if root is not None:
        yield root
        return
    with tempfile.TemporaryDirectory(prefix="apportion-e2e-") as made:
        yield Path(made)


@pytest.fixture
async def cluster(
    kafka_bootstrap: str,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
    tmp_path: Path,
) -> AsyncIterator[Cluster]:
    """A cluster of its own for each test, its folder the test's ``tmp_path``; ``request.param`` (indirect
    parametrization) overrides the spec of :func:`running_cluster`."""
    spec = getattr(request, "param", {})
    async with running_cluster(kafka_bootstrap, redis_url, monkeypatch, root=tmp_path, **spec) as c:
        yield c


@asynccontextmanager
async def running_cluster(
    kafka_bootstrap: str, redis_url: str, monkeypatch: pytest.MonkeyPatch, root: Path | None = None, **overrides: Any
) -> AsyncIterator[Cluster]:
    """The four services in-process on a fresh topic namespace (set with ``monkeypatch``) and Redis db 12,
    ready and with their nodes registered; stopped on exit. Their folders are in ``root``
    (:func:`state_settings`; ``None``: a temporary folder of the cluster's own, removed once they stopped).
    ``overrides`` of the spec: ``nodes`` (2), ``gpus`` (4 per node), ``heartbeat_timeout_s`` (600 event-s), and
    ``agent``, ``dispatcher``, ``accounting`` (each ``True``; ``False``: the test runs that service itself).
    Used per test by the ``cluster`` fixture and per module by the poison tests'."""
    with cluster_root(root) as own:
        async with _running_cluster(kafka_bootstrap, redis_url, monkeypatch, own, **overrides) as c:
            yield c


@asynccontextmanager
async def _running_cluster(
    kafka_bootstrap: str, redis_url: str, monkeypatch: pytest.MonkeyPatch, root: Path, **overrides: Any
) -> AsyncIterator[Cluster]:
    """:func:`running_cluster` with its folder ``root``."""
    import redis as redis_lib

    from apportion import events
    from apportion.bus.producer import EventProducer
    from apportion.bus.provision import provision
    from apportion.clock import ScaledClock
    from services.accounting.app import run as run_accounting
    from services.accounting.config import AccountingSettings
    from services.dispatcher.app import run as run_dispatcher
    from services.dispatcher.config import DispatcherSettings
    from services.node_agent.app import run as run_agent
    from services.node_agent.config import NodeAgentSettings
    from services.policy.app import run as run_policy
    from services.policy.config import PolicySettings

    spec: dict[str, Any] = {
        "nodes": 2,
        "gpus": 4,
        "heartbeat_timeout_s": 600.0,
        "agent": True,
        "dispatcher": True,
        "accounting": True,
    }
    spec.update(overrides)
    nodes, gpus = spec["nodes"], spec["gpus"]
    tag = uuid.uuid4().hex[:8]
    monkeypatch.setenv("APPORTION_TOPIC_PREFIX", f"e2e{tag}.")
    await asyncio.to_thread(provision, kafka_bootstrap)
    db_url = redis_url.rsplit("/", 1)[0] + "/12"
    redis_lib.Redis.from_url(db_url, **redis_auth()).flushdb()

    now = datetime.now(UTC)
    clock = ScaledClock(SCALE, now, now)
    common: dict[str, Any] = {"kafka_bootstrap": kafka_bootstrap, "redis_url": db_url, "log_json": False}
    stop = asyncio.Event()
    ready = [asyncio.Event() for _ in range(4)]
    producer = EventProducer(kafka_bootstrap, client_id="e2e-test")
    t0 = clock.now()
    for path, share in (("lab", 1.0), ("lab/a", 0.5), ("lab/b", 0.5)):
        producer.publish(events.BudgetSet(path=path, share=share, ts=t0, producer="test"))
    for i, wanted in ((0, spec["agent"]), (1, spec["dispatcher"]), (2, spec["accounting"])):
        if not wanted:
            ready[i].set()  # the test runs this one itself (as a process it can kill)
    dirs = state_settings(root)
    policy = PolicySettings(**common, faust_dir=dirs["faust_dir"])
    tasks = [asyncio.create_task(run_policy(policy, stop, clock=clock, ready=ready[3]))]
    if spec["accounting"]:
        tasks.append(
            asyncio.create_task(
                run_accounting(
                    AccountingSettings(**common, snapshot_debounce_wall_s=0.1), stop, clock=clock, ready=ready[2]
                )
            )
        )
    if spec["agent"]:
        tasks.append(
            asyncio.create_task(
                run_agent(
                    NodeAgentSettings(
                        **common,
                        sim_nodes=nodes,
                        gpus_per_node=gpus,
                        node_prefix=f"n{tag}-",
                        group_id=f"agent-{tag}",
                        heartbeat_interval_s=30.0,
                        state_dir=dirs["state_dir"],
                    ),
                    stop,
                    clock=clock,
                    ready=ready[0],
                )
            )
        )
    if spec["dispatcher"]:
        tasks.append(
            asyncio.create_task(
                run_dispatcher(
                    DispatcherSettings(
                        **common, instance_id=f"d-{tag}", grace_s=5.0, heartbeat_timeout_s=spec["heartbeat_timeout_s"]
                    ),
                    stop,
                    clock=clock,
                    ready=ready[1],
                )
            )
        )
    try:
        all_ready = asyncio.create_task(asyncio.wait_for(asyncio.gather(*(r.wait() for r in ready)), DEADLINE_S))
        done, _ = await asyncio.wait([all_ready, *tasks], return_when=asyncio.FIRST_COMPLETED)
        if all_ready not in done:  # a service ended before it was ready: show why
            all_ready.cancel()
            failed = next(t for t in tasks if t in done)
            raise AssertionError("a service stopped during start-up") from failed.exception()
        all_ready.result()
        c = Cluster(kafka_bootstrap, db_url, clock, producer, stop, tag, now, root)
        if spec["agent"]:
            await c.until(
                lambda evs: sum(isinstance(e, events.NodeRegistered) for e in evs) >= nodes, "node registrations"
            )
        yield c
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
        producer.close()
        # the lease must not outlive the test: the next test's dispatcher would wait for it
        redis_lib.Redis.from_url(db_url, **redis_auth()).flushdb()
