"""Node agent on real Kafka, run in-process: register, run a simulated workload, refuse bad commands.

Fresh ``APPORTION_TOPIC_PREFIX`` per test; every wait bounded.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from apportion.bus.producer import EventProducer
from apportion.settings import topic_name
from tests.kit.checkpoint_workload import WORKLOAD
from tests.kit.node_boundary import ALICE, KAFKA_PROBE, job_accounts, machine_stack_hidden, shared_dir, write_script

__all__ = ["job_accounts", "machine_stack_hidden", "shared_dir"]  # fixtures used by name

#: an agent reads no stack of the machine (a running `make up`, or the marker `make down` left)
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("machine_stack_hidden")]

DEADLINE_S = 60.0

#: The Kafka probe's bound: each of its refused sign-ins is a TLS handshake and a SCRAM exchange the broker answers
#: after its failed-authentication delay (100 ms); a few seconds on an idle machine, half a minute seen on a
#: loaded one.
PROBE_DEADLINE_S = 180.0


async def test_node_agent_runs_commands_from_kafka(kafka_bootstrap, monkeypatch):
    from apportion import events
    from apportion.bus.producer import EventProducer
    from apportion.bus.provision import provision
    from apportion.bus.reader import read_log
    from apportion.clock import make_clock
    from apportion.topics import JOBS, NODES
    from services.node_agent.app import run
    from services.node_agent.config import NodeAgentSettings

    monkeypatch.setenv("APPORTION_TOPIC_PREFIX", f"t{uuid.uuid4().hex[:8]}.")
    await asyncio.to_thread(provision, kafka_bootstrap)
    clock = make_clock(1000.0)  # 1000 event seconds per wall second
    settings = NodeAgentSettings(
        kafka_bootstrap=kafka_bootstrap,
        sim_nodes=2,
        gpus_per_node=4,
        node_prefix="itest-",
        heartbeat_interval_s=60,
        heartbeat_min_wall_s=0.2,
    )
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(run(settings, stop, clock=clock, ready=ready))
    producer = EventProducer(kafka_bootstrap, client_id="test")
    try:
        await asyncio.wait_for(ready.wait(), DEADLINE_S)
        now = clock.now()
        producer.publish(
            events.StartWorkload(
                ts=now, node_id="itest-1", job_id="j1", attempt=1, gpus=(0, 1), duration_s=500.0, fencing_token=1
            )
        )  # 0.5 s wall
        producer.publish(
            events.StartWorkload(
                ts=now, node_id="itest-7", job_id="j2", attempt=1, gpus=(0,), duration_s=5.0, fencing_token=1
            )
        )  # unknown node
        producer.publish(
            events.StartWorkload(
                ts=now, node_id="itest-0", job_id="j3", attempt=1, gpus=(4,), duration_s=5.0, fencing_token=1
            )
        )  # no GPU 4

        def job_events():
            return [r.event for r in read_log(kafka_bootstrap, [topic_name(JOBS)]) if r.event is not None]

        loop = asyncio.get_running_loop()
        end = loop.time() + DEADLINE_S
        while True:
            evs = await asyncio.to_thread(job_events)
            if any(isinstance(e, events.JobCompleted) for e in evs):
                break
            assert loop.time() < end, f"no JobCompleted; saw {[e.type for e in evs]}"
            await asyncio.sleep(0.1)
        started = [e for e in evs if isinstance(e, events.JobStarted)]
        assert [(e.job_id, e.node_id, e.gpus) for e in started] == [("j1", "itest-1", (0, 1))]
        refused = sorted((e.job_id, e.reason.split(":")[0]) for e in evs if isinstance(e, events.WorkloadRefused))
        assert refused == [("j2", "unknown_node"), ("j3", "unknown_gpus")]
        nodes = [r.event for r in read_log(kafka_bootstrap, [topic_name(NODES)]) if r.event is not None]
        assert sorted(e.node_id for e in nodes if isinstance(e, events.NodeRegistered)) == ["itest-0", "itest-1"]
    finally:
        stop.set()
        await asyncio.wait_for(task, DEADLINE_S)
        producer.close()


async def test_live_checkpoint_preempt_and_resume(kafka_bootstrap, monkeypatch, job_accounts, shared_dir):
    """A real process checkpoints, is stopped, checkpoints on SIGTERM, and attempt 2 resumes from it, running
    as its user (``apportion-u-alice``) in its cgroup, in a directory that is hers.

    Every step waits for the events it needs in the log (bounded); the
    expected progress values are exactly what the script writes.
    """
    import json
    import os

    from apportion import events
    from apportion.bus.producer import EventProducer
    from apportion.bus.provision import provision
    from apportion.bus.reader import read_log
    from apportion.clock import make_clock
    from apportion.topics import JOBS
    from services.node_agent.app import run
    from services.node_agent.config import NodeAgentSettings

    monkeypatch.setenv("APPORTION_TOPIC_PREFIX", f"t{uuid.uuid4().hex[:8]}.")
    await asyncio.to_thread(provision, kafka_bootstrap)
    tmp_path = shared_dir  # the job's account must reach its script and its directories
    script = write_script(shared_dir, "workload.py", WORKLOAD)
    settings = NodeAgentSettings(
        kafka_bootstrap=kafka_bootstrap,
        sim_nodes=1,
        gpus_per_node=2,
        node_prefix="ckpt-",
        heartbeat_interval_s=60,
        checkpoint_root=tmp_path / "ckpt",
        job_log_dir=tmp_path / "logs",
        progress_poll_wall_s=0.05,
    )
    clock = make_clock(1.0)
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(run(settings, stop, clock=clock, ready=ready))
    job, node = "ckpt-job", "ckpt-0"
    ckpt = tmp_path / "ckpt" / job
    loop = asyncio.get_running_loop()

    def job_log() -> list:
        recs = [r for r in read_log(kafka_bootstrap, [topic_name(JOBS)]) if r.event is not None and r.key == job]
        return [r.event for r in sorted(recs, key=lambda r: (r.partition, r.offset))]

    async def wait_for(pred, what: str) -> list:
        end = loop.time() + DEADLINE_S
        while True:
            evs = await asyncio.to_thread(job_log)
            if pred(evs):
                return evs
            assert loop.time() < end, f"timed out waiting for {what}; saw {[(e.type, e.attempt) for e in evs]}"
            await asyncio.sleep(0.05)

    def checkpoints(evs: list, attempt: int) -> list[float]:
        return [e.progress_s for e in evs if isinstance(e, events.JobCheckpointed) and e.attempt == attempt]

    def start(attempt: int) -> events.StartWorkload:
        return events.StartWorkload(
            ts=clock.now(),
            node_id=node,
            job_id=job,
            attempt=attempt,
            gpus=(0, 1),
            command=("python3", str(script)),
            fencing_token=1,
            user=ALICE,
        )

    producer = EventProducer(kafka_bootstrap, client_id="test")
    try:
        await asyncio.wait_for(ready.wait(), DEADLINE_S)
        producer.publish(start(1))
        await wait_for(lambda evs: checkpoints(evs, 1) == [10.0], "attempt 1's first checkpoint")
        (ckpt / "go").touch()
        await wait_for(lambda evs: checkpoints(evs, 1) == [10.0, 20.0], "attempt 1's second checkpoint")
        producer.publish(
            events.StopWorkload(ts=clock.now(), node_id=node, job_id=job, attempt=1, grace_s=30.0, reason="preempted")
        )
        await wait_for(lambda evs: any(isinstance(e, events.JobFailed) for e in evs), "attempt 1 to exit")
        producer.publish(start(2))
        evs = await wait_for(lambda evs: any(isinstance(e, events.JobCompleted) for e in evs), "attempt 2 to end")

        kinds = [(e.type, e.attempt, getattr(e, "progress_s", None)) for e in evs]
        assert kinds == [
            ("JobStarted", 1, None),
            ("JobCheckpointed", 1, 10.0),
            ("JobCheckpointed", 1, 20.0),
            ("JobCheckpointed", 1, 25.0),  # written on SIGTERM; in the log before the exit
            ("JobFailed", 1, None),
            ("JobStarted", 2, None),
            ("JobCheckpointed", 2, 35.0),  # 25 resumed + 10
            ("JobCompleted", 2, None),
        ]
        assert all((e.node_id, e.replica) == (node, 0) for e in evs if isinstance(e, events.JobCheckpointed))
        assert len({e.event_id for e in evs}) == len(evs)
        assert evs[4].reason == "stopped"
        seen = [json.loads((ckpt / f"seen-{a}.json").read_text()) for a in (1, 2)]
        assert seen == [
            {"attempt": 1, "resumed_s": 0.0, "cwd": str(ckpt), "job": job},
            {"attempt": 2, "resumed_s": 25.0, "cwd": str(ckpt), "job": job},
        ]
        out = tmp_path / "logs" / job / "attempt-2.replica-0.out"
        assert out.read_text() == "attempt 2 resumed from 25.0\n"
        alice = job_accounts[ALICE]
        assert [(os.stat(d).st_uid, os.stat(d).st_mode & 0o777) for d in (ckpt, out.parent)] == [
            (alice.pw_uid, 0o700)
        ] * 2
    finally:
        stop.set()
        await asyncio.wait_for(task, DEADLINE_S)
        producer.close()


#: The names a job can guess from the docs that would let it write what matters: the node agents' (the
#: undeclared one, the one ``stack up`` runs, one named after this node), the dispatcher, ops, the dashboard and
#: the broker's super user.
GUESSED_PRINCIPALS = ("node-agent", "node-agent.local", "node-agent.kafka-0", "dispatcher", "ops", "web", "admin")


async def test_a_job_cannot_publish_to_kafka_with_anything_it_finds_on_the_node(
    kafka_bootstrap, monkeypatch, job_accounts, shared_dir
):
    """Alice's command job collects its environment and every file it can read where the agent and the stack
    keep theirs, then tries to publish to ``apportion.jobs``: in clear, over TLS without signing in, and over
    TLS with SCRAM as every principal it can guess with every value it found as the password. The agent leaves
    the broker's port open to its jobs here, so that the credentials are what is tried (by default a job's
    connect to it is refused first: ``tests/service/test_node_agent_boundary.py``). Every attempt is refused
    and nothing of it reaches the topic. The same probe run as root with the agent's password file
    in reach does publish (the probe and the read-back can tell)."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    from apportion import events
    from apportion.bus.provision import provision
    from apportion.bus.reader import read_log
    from apportion.client import enrol
    from apportion.clock import make_clock
    from apportion.topics import JOBS
    from services.node_agent.app import run
    from services.node_agent.config import NodeAgentSettings

    monkeypatch.setenv("APPORTION_TOPIC_PREFIX", f"t{uuid.uuid4().hex[:8]}.")
    await asyncio.to_thread(provision, kafka_bootstrap)
    secrets = Path(os.environ["APPORTION_KAFKA_SECRETS_DIR"])  # the session stack's: <datadir>/kafka/secrets
    stack_dir = secrets.parents[1]
    # the agent's own files, carelessly readable before it starts (its start must close them): its Kafka
    # password, a copy of the development keyring (node keys, ops and dispatcher keys), the stack.env in force
    agent = shared_dir / "agent"
    agent.mkdir(mode=0o755)
    password = agent / "kafka.password"
    password.write_text((secrets / "node-agent.password").read_text())
    password.chmod(0o644)
    keyring = agent / "keyring"
    shutil.copytree(os.environ["APPORTION_KEYRING"], keyring)
    await asyncio.to_thread(enrol, ["node:kafka-0"], bootstrap=kafka_bootstrap, ring=keyring)  # as admin
    for p in (keyring, *keyring.rglob("*")):
        p.chmod(0o755 if p.is_dir() else 0o644)
    run_dir = shared_dir / "run"
    run_dir.mkdir(mode=0o755)
    (run_dir / "stack.env").write_text((stack_dir / "stack.env").read_text())
    (run_dir / "stack.env").chmod(0o644)
    producer = EventProducer(kafka_bootstrap, client_id="test")  # admin: the dispatcher's command
    as_agent = pytest.MonkeyPatch()  # the agent connects as its own principal; the test reads as admin
    as_agent.setenv("APPORTION_KAFKA_USER", "node-agent")
    as_agent.setenv("APPORTION_KAFKA_PASSWORD_FILE", str(password))
    as_agent.setenv("APPORTION_KEYRING", str(keyring))
    as_agent.setenv("APPORTION_STACK_DIR", str(run_dir))
    probe = write_script(shared_dir, "kafka_probe.py", KAFKA_PROBE)
    topic = topic_name(JOBS)
    settings = NodeAgentSettings(
        kafka_bootstrap=kafka_bootstrap,
        sim_nodes=1,
        gpus_per_node=1,
        node_prefix="kafka-",
        heartbeat_interval_s=60,
        state_dir=agent / "state",
        sandbox_closed_ports=[],  # the credentials alone: by default the broker's port is closed to jobs as well
    )
    roots = [
        probe,
        shared_dir,
        agent,
        run_dir,
        str(stack_dir),
        os.environ.get("APPORTION_TLS_CA", ""),
        "/etc/apportion",
        "/root",
    ]
    probe_env = {
        "PROBE_ROOTS": ":".join(str(r) for r in roots if r),
        "PROBE_BOOTSTRAP": kafka_bootstrap.split(",")[0],
        "PROBE_TOPIC": topic,
        "PROBE_KEY": "forged-by-a-job",
        "PROBE_PRINCIPALS": ":".join(GUESSED_PRINCIPALS),
    }
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(run(settings, stop, clock=make_clock(1.0), ready=ready))
    loop = asyncio.get_running_loop()

    def records() -> list:
        return [r for r in read_log(kafka_bootstrap, [topic]) if r.key in ("probe", "forged-by-a-job")]

    try:
        await asyncio.wait_for(ready.wait(), DEADLINE_S)
        as_agent.undo()
        assert password.stat().st_mode & 0o777 == 0o600 and keyring.stat().st_mode & 0o777 == 0o700
        await asyncio.to_thread(
            producer.publish,
            events.StartWorkload(
                ts=make_clock(1.0).now(),
                node_id="kafka-0",
                job_id="probe",
                attempt=1,
                gpus=(0,),
                command=("python3", str(probe)),
                env=probe_env,
                fencing_token=1,
                user=ALICE,
            ),
        )
        end = loop.time() + PROBE_DEADLINE_S
        while not any(
            isinstance(r.event, (events.JobCompleted, events.JobFailed)) for r in await asyncio.to_thread(records)
        ):
            assert loop.time() < end, "the probe job did not end"
            await asyncio.sleep(0.1)
    finally:
        as_agent.undo()
        stop.set()
        await asyncio.wait_for(task, DEADLINE_S)
        producer.close()

    report = json.loads((settings.checkpoint_root_path() / "probe" / "kafka.json").read_text())
    read = sorted(p for p, v in report["found"].items() if v == "read")
    assert read == [str(probe)], report["found"]  # its own script: nothing of the agent's or the stack's
    for secret in (password, keyring, run_dir / "stack.env"):
        assert report["found"].get(str(secret)) == "EACCES", (secret, report["found"])
    # the session stack's directory, its CA inside: under the node's /tmp, which the job does not see at all
    assert report["found"].get(str(stack_dir)) in ("ENOENT", "EACCES"), report["found"]
    # every value of its environment and its script, as the password of every guessed principal
    scram = [a for a in report["attempts"] if a["kind"] == "scram"]
    assert {"PATH", "HOME", "USER", "CUDA_VISIBLE_DEVICES", "APPORTION_CHECKPOINT_DIR", str(probe)} <= set(
        report["sources"]
    )
    assert len(scram) == report["passwords"] * len(GUESSED_PRINCIPALS)
    assert [a["verdict"] for a in report["attempts"][:2]] == ["no_kafka_answer", "closed_unauthenticated"]
    assert {a["verdict"] for a in scram} == {"SASL_AUTHENTICATION_FAILED"}
    ran = [type(r.event).__name__ for r in await asyncio.to_thread(records)]
    assert ran == ["JobStarted", "JobCompleted"], ran  # the agent's reports of the run; no record of the job's

    # the control: the same probe, as root, with the agent's password file in reach, publishes one record
    control = shared_dir / "control"
    control.mkdir()
    env = {**probe_env, "PROBE_ROOTS": str(password), "PROBE_PRINCIPALS": "node-agent", "PATH": "/usr/bin:/bin"}
    await asyncio.to_thread(subprocess.run, [sys.executable, str(probe)], cwd=control, env=env, check=True)
    verdicts = {a["verdict"] for a in json.loads((control / "kafka.json").read_text())["attempts"]}
    assert "produced" in verdicts
    forged = [r for r in await asyncio.to_thread(records) if r.key == "forged-by-a-job"]
    assert len(forged) == 1


async def test_a_job_cannot_connect_to_the_kafka_controllers_port_of_a_broker_on_the_node(
    kafka_bootstrap, redis_url, monkeypatch, job_accounts, shared_dir
):
    """ATTACK (node boundary, the control plane's connection slots): the real agent given the stack's Kafka,
    Redis and closed ports as `apportion stack up` gives them (``cli.stack.closed_ports``) runs alice's job, which
    connects to the session broker's port and to its KRaft controller's port (``CONTROLLER://`` of the broker's
    ``server.properties``) on each loopback form: every connect is refused ``EPERM``. One connection is
    harmless; what it stands for is not: the same job holding connections to the controller's port until the
    broker's descriptors ran out (20,000) stopped the broker of a `make up` stack while the agent closed only the
    bootstrap and Redis ports."""
    import json
    import os
    import re

    from apportion.cli.stack import StackInfo, closed_ports
    from apportion.events import JobCompleted
    from tests.service.test_node_agent_boundary import CONNECT_JOB, LOOPBACK_FORMS, Node

    secrets = Path(os.environ["APPORTION_KAFKA_SECRETS_DIR"])  # the session stack's: <datadir>/kafka/secrets
    props = (secrets.parents[1] / "kafka" / "server.properties").read_text()
    found = re.search(r"CONTROLLER://127\.0\.0\.1:(\d+)", props)
    assert found is not None, "the session broker's controller listener"
    broker, controller = int(kafka_bootstrap.rsplit(":", 1)[1]), int(found.group(1))
    closed = closed_ports(StackInfo(secrets.parents[1], kafka_bootstrap, redis_url))
    assert {broker, controller} <= set(closed)
    node = Node(
        shared_dir, monkeypatch, kafka_bootstrap=kafka_bootstrap, redis_url=redis_url, sandbox_closed_ports=closed
    )
    await node.agent.start(heartbeats=False, poll_progress=False)
    try:
        script = write_script(shared_dir, "connect_job.py", CONNECT_JOB)
        command = ("python3", str(script), str(broker), str(controller))
        await node.agent.on_event(node.start("j-ctl", ALICE, command))
        assert isinstance(await node.ended("j-ctl"), JobCompleted)
        got = json.loads((node.ckpt / "j-ctl" / "connect.json").read_text())
    finally:
        await node.close()
    assert got == {f"{h} {p}": "EPERM" for h in LOOPBACK_FORMS for p in (broker, controller)}
