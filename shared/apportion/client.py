"""Python client for programs that submit work to apportion.

Example::

    from apportion import client

    verdict = client.submit(budget="lab/vision", gpus=2, min_runtime="2h",
                            command=["python", "train.py"], time_limit="4h",
                            env={"WANDB_PROJECT": "vision"}, wait=10)
    if isinstance(verdict, client.events.JobRejected):
        print("rejected:", verdict.reason.value, verdict.message)
    else:
        print("queued", verdict.job_id)

Without ``wait`` it publishes and returns the signed ``JobSubmitted`` (``.job_id``). A submission
the schema refuses raises :class:`InvalidSubmission` (``field``, ``message``) before anything is
published; no verdict within ``wait`` seconds raises :class:`NoVerdict`. All errors of this module's
own are :class:`ApportionError`.

Submissions are ``JobSubmitted`` events on ``apportion.submissions``; any
Kafka producer in any language may publish the same JSON (schemas in
``schemas/JobSubmitted.json``). The client validates locally before it
publishes, so a bad submission fails here with a clear error instead of
landing in the dead-letter topic.

Every submission and cancel request is signed with the user's key, and
every cordon, drain and uncordon with an operator's (:func:`ops_identity`),
(:mod:`apportion.identity`, rule D10.proven-user): the identity file
(``~/.config/apportion/identity.json`` or ``APPORTION_IDENTITY``; made by
``apportion keys init``, its public key registered by ops with ``apportion
keys register``), or, on a development stack, the keyring that
``apportion stack up`` and the test fixtures keep (:func:`identity_for`).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, TypeVar, cast, overload

from apportion import events
from apportion.durations import parse_duration
from apportion.identity.keys import Identity, identity_file, keyring_dir
from apportion.settings import Connection, topic_name

#: Job ids the client accepts: they appear in shell commands, log lines, file names and metric labels.
#: (Any JobSubmitted from another producer is still accepted by the schema: 1-200 characters.)
JOB_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]{0,199}")


class ApportionError(Exception):
    """An error of the apportion client (catch this for all of them)."""


class InvalidSubmission(ApportionError, ValueError):
    """A submission the schema refuses, found before anything is published.

    Attributes:
        field: the offending field (``"gpus_per_replica"``, ``"env"``, ...), or ``"job"`` for the whole.
        message: why, in words.
    """

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"invalid submission: {field}: {message}")


class NoVerdict(ApportionError, TimeoutError):
    """The dispatcher gave no verdict within the wait; the submission is in the log (it may still be queued).

    Attributes:
        job_id: the submission's job id.
    """

    def __init__(self, job_id: str, wait_s: float) -> None:
        self.job_id = job_id
        super().__init__(
            f"no verdict from the dispatcher within {wait_s:g} s for {job_id}; the submission is in the log"
        )


_ROLES: dict[str, Literal["user", "ops"]] = {"user": "user", "ops": "ops"}  # a key's role, as the model types it


class KafkaFailure(ApportionError, ConnectionError):
    """Kafka could not be reached, or refused the request (its ACLs do not let the principal write the topic);
    nothing is known to be published. ``error`` is kafka-python's exception (also the ``__cause__``)."""

    def __init__(self, bootstrap: str, error: BaseException) -> None:
        self.bootstrap, self.error = bootstrap, error
        said, kind = str(error), type(error).__name__
        super().__init__(f"Kafka at {bootstrap}: {said if said.startswith(kind) else f'{kind}: {said}'}")


def kafka_address(bootstrap: str | None) -> str:
    """The Kafka to talk to: ``bootstrap`` when given, else as :meth:`Connection.resolve` finds it. A Kafka given
    needs no Redis, so the marker of a stopped stack (which names neither) does not refuse it."""
    return bootstrap or Connection.resolve().bootstrap


@contextmanager
def _kafka_failures(bootstrap: str | None) -> Iterator[None]:
    """Turn kafka-python's exceptions (of many types) raised inside into :class:`KafkaFailure`."""
    try:
        yield
    except Exception as exc:
        if type(exc).__module__.startswith("kafka"):
            raise KafkaFailure(kafka_address(bootstrap), exc) from exc
        raise


def check_job_id(job_id: str) -> str:
    """Return ``job_id`` if it is a client-acceptable id (:data:`JOB_ID_RE`).

    Raises:
        ValueError: the id is empty, too long, or has a space, slash or other character outside
            letters, digits and ``. _ : @ + -`` (saying which).
    """
    if JOB_ID_RE.fullmatch(job_id):
        return job_id
    bad = sorted({c for c in job_id if not (c.isascii() and (c.isalnum() or c in "._:@+-"))})
    why = (
        f"characters {''.join(bad)!r} are not allowed"
        if bad
        else "it must start with a letter or digit"
        if job_id
        else "it is empty"
    )
    if len(job_id) > 200:
        why = "it is longer than 200 characters"
    raise ValueError(f"invalid job id {job_id!r}: {why} (use letters, digits and . _ : @ + -)")


def new_job_id(user: str) -> str:
    """A fresh job id, ``<user>-<12 hex>``."""
    return f"{user}-{uuid.uuid4().hex[:12]}"


def build_submission(
    *,
    budget: str,
    user: str,
    gpus: int,
    replicas: int = 1,
    min_runtime: str | float = 0,
    command: Sequence[str] | None = None,
    duration: str | float | None = None,
    gpu_model: str | None = None,
    job_id: str | None = None,
    checkpoint_interval_s: float | None = None,
    hold: bool = False,
    env: dict[str, str] | None = None,
    time_limit_s: float | None = None,
    now: datetime | None = None,
    producer: str | None = None,
    array: str | None = None,
    topology_bound: str | None = None,
) -> events.JobSubmitted:
    """Build and validate a ``JobSubmitted`` without publishing it.

    Args:
        budget: budget path to charge, e.g. ``"lab/prior/robotics"``.
        user: submitting user.
        gpus: GPUs per replica.
        replicas: gang size (replicas on distinct nodes).
        min_runtime: seconds or a duration string (``"2h"``); 0 = unallocated.
        command: argv of a real workload.
        duration: seconds or duration string of a simulated workload.
        gpu_model: required GPU model, or None.
        job_id: defaults to :func:`new_job_id`.
        checkpoint_interval_s: seconds (> 0) between the workload's checkpoints, or None for the default
            (:func:`apportion.events.checkpoint_interval_of`: once per minimum runtime).
        hold: submit it held: queued, never placed until released (:func:`release`).
        env: environment variables of the workload (:func:`apportion.events.check_env`; :func:`parse_env`).
        time_limit_s: seconds (> 0) a run may last before the node agent stops it, or None for the
            budget's default (if any).
        now: submission time (UTC); defaults to the wall clock (this is an
            edge adapter, not domain code).
        array: a job array, Slurm's index expression (``"0-99%8"``: elements 0 to 99, at most 8 running;
            :func:`apportion.arrays.parse_array`): one record for one job per index, each with the id
            ``<job_id>_<index>``.
        topology_bound: ``"block"`` or ``"rack"``: every replica within one block (rack) of the network
            (rule D1.topology); a gang no registered block (rack) can hold is rejected ``unsatisfiable_topology``.

    Raises:
        InvalidSubmission: the submission breaks the schema (``field`` and ``message`` say where and why),
            a duration string cannot be parsed, or ``job_id`` fails :func:`check_job_id`.
    """
    from pydantic import ValidationError

    ts = now or datetime.now(UTC)
    try:
        return _submission(
            ts, budget, user, gpus, replicas, min_runtime, command, duration, gpu_model, job_id,
            checkpoint_interval_s, hold, env, time_limit_s, producer, array, topology_bound,
        )  # fmt: skip
    except ValidationError as exc:
        e = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in e["loc"]) or "job"
        raise InvalidSubmission(where, str(e["msg"]).removeprefix("Value error, ")) from None


def _submission(
    ts: datetime,
    budget: str,
    user: str,
    gpus: int,
    replicas: int,
    min_runtime: str | float,
    command: Sequence[str] | None,
    duration: str | float | None,
    gpu_model: str | None,
    job_id: str | None,
    checkpoint_interval_s: float | None,
    hold: bool,
    env: dict[str, str] | None,
    time_limit_s: float | None,
    producer: str | None,
    array: str | None = None,
    topology_bound: str | None = None,
) -> events.JobSubmitted:
    def seconds(name: str, value: str | float | None) -> float | None:
        try:
            return parse_duration(value) if value is not None else None
        except ValueError as exc:
            raise InvalidSubmission(name, str(exc)) from None

    try:
        jid = check_job_id(job_id) if job_id is not None else new_job_id(user)
    except ValueError as exc:
        raise InvalidSubmission("job_id", str(exc)) from None
    if isinstance(command, (str, bytes)):  # tuple() of a string is its characters, each run as an argument
        raise InvalidSubmission("command", f"give the command as a list of arguments, e.g. {command.split()!r}")
    return events.JobSubmitted(
        job_id=jid,
        budget=budget,
        user=user,
        gpus_per_replica=gpus,
        replicas=replicas,
        min_runtime_s=seconds("min_runtime_s", min_runtime) or 0.0,
        command=tuple(command) if command else None,
        duration_s=seconds("duration_s", duration),
        gpu_model=gpu_model,
        checkpoint_interval_s=checkpoint_interval_s,
        hold=hold,
        env=dict(env) if env else None,
        time_limit_s=time_limit_s,
        array=array,
        topology_bound=cast("events.TopologyBound | None", topology_bound),  # the model refuses any other value
        submitted_at=ts,
        ts=ts,
        producer=producer or f"client/{user}",
    )


def parse_env(
    pairs: Sequence[str] = (), file_text: str | None = None, *, file_name: str = "env file"
) -> dict[str, str]:
    """The ``env`` of ``submit --env KEY=VALUE`` (repeatable) and ``--env-file``, checked
    (:func:`apportion.events.check_env`).

    The file has one ``KEY=VALUE`` a line; blank lines and lines starting with ``#`` are skipped, a leading
    ``export`` is allowed, and a value wholly inside one pair of matching quotes loses them (nothing else is
    interpreted: no ``$`` expansion). ``--env`` pairs come after the file's and win.

    Raises:
        ValueError: a line or pair without ``=``, or what :func:`~apportion.events.check_env` refuses; the
            message names the line or the pair.
    """
    env: dict[str, str] = {}
    for n, line in enumerate((file_text or "").splitlines(), 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        text = text.removeprefix("export ").lstrip()
        name, eq, value = text.partition("=")
        if not eq:
            raise ValueError(f"{file_name}, line {n}: {line.strip()!r} is not KEY=VALUE")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        try:
            events.check_env({name.strip(): value})  # here, to name the line; the whole env is checked below
        except ValueError as exc:
            raise ValueError(f"{file_name}, line {n}: {exc}") from None
        env[name.strip()] = value
    for pair in pairs:
        name, eq, value = pair.partition("=")
        if not eq:
            raise ValueError(f"--env {pair!r} is not KEY=VALUE")
        env[name] = value
    return events.check_env(env)


def client_linger_ms(n: int) -> int:
    """The client producer's linger for ``n`` events published together: 0 for one (sent the moment it is
    queued, no batch to wait for), 2 ms for several (they go out in few requests; the flush that follows sends
    what is left at once)."""
    return 0 if n <= 1 else 2


def publish(*evts: events.Event, bootstrap: str | None = None) -> list[int]:
    """Publish events in order and wait for the broker's acknowledgement; returns each record's offset."""
    from apportion.bus.producer import EventProducer

    producer = EventProducer(
        kafka_address(bootstrap),
        client_id="apportion-client",
        max_block_ms=8000,
        bootstrap_timeout_ms=5_000,
        linger_ms=client_linger_ms(len(evts)),
    )
    try:
        futures = [producer.send(ev) for ev in evts]
        producer.flush()
        return [int(f.get(timeout=10).offset) for f in futures]
    finally:
        producer.close()


def check_user(user: str) -> str:
    """``user`` as given, when it can name a user.

    Raises:
        ValueError: empty or only blanks (an empty ``--user`` must not fall back to the default user).
    """
    if not user.strip():
        raise ValueError("the user name is empty: give a user, or leave --user out to act as your identity's user")
    return user


def identity_for(user: str | None = None, *, bootstrap: str | None = None) -> Identity:
    """The identity that signs ``user``'s requests.

    With a development keyring (:func:`apportion.identity.keys.keyring_dir`),
    ``<keyring>/<user>.json``; a user without one is enrolled on first use: a
    key pair is made there, and its ``UserKeyRegistered`` is published once
    per topic namespace, in the name of the keyring's ops identity
    (``ops.json``; a development convenience: whoever can read the keyring is
    ops). Otherwise the identity file
    (:func:`apportion.identity.keys.identity_file`), which must be ``user``'s when
    ``user`` is given.

    Args:
        user: whose key; ``None`` = the identity file's user (with a keyring: ``$USER``).
        bootstrap: Kafka, for an enrolment.

    Raises:
        LookupError: no identity file (run ``apportion keys init``), or a keyring without ``ops.json``.
        ValueError: ``user`` is empty (it would have meant the default user), the identity file is another
            user's, or is not an identity.
    """
    if user is not None:
        check_user(user)
    if keyring_dir() is not None:
        import getpass

        return enrol([user or getpass.getuser()], bootstrap=bootstrap)[0]
    path = identity_file()
    if not path.is_file():
        raise LookupError(
            f"no identity file at {path}: run `apportion keys init` and ask ops to register the public key "
            "(`apportion keys register USER PUBKEY`)"
        )
    ident = Identity.load(path)
    if user is not None and user != ident.user:
        raise ValueError(f"the identity file {path} signs as {ident.user!r}, not {user!r}")
    return ident


def ops_identity(*, bootstrap: str | None = None) -> Identity:
    """The identity that signs ops' requests on nodes (``cordon``, ``drain``, ``undrain``; rule D10.authentication).

    ``APPORTION_IDENTITY`` when it is set (an operator's own file, whose key ops registered with
    ``--role ops``: it wins over a development keyring); else a development keyring's ``ops.json``
    (registered with role ``ops`` on first use, as :func:`enrol` does); else the default identity
    file. The dispatcher refuses a request signed by any key without role ``ops`` with
    ``NodeRequestRefused``.

    Raises:
        LookupError: no identity file (run ``apportion keys init``), or a keyring without ``ops.json``.
        ValueError: the identity file is not an identity.
    """
    import os

    if keyring_dir() is not None and not os.environ.get("APPORTION_IDENTITY"):
        return enrol(["ops"], bootstrap=bootstrap)[0]
    path = identity_file()
    if not path.is_file():
        raise LookupError(f"no identity file at {path}: an operator runs `apportion keys init` and has it registered")
    return Identity.load(path)


def enrol(
    names: list[str], *, bootstrap: str | None = None, now: datetime | None = None, ring: Path | None = None
) -> list[Identity]:
    """The development keyring's identities of ``names``, made and registered on first use.

    Each is ``<keyring>/<name>.json``; a missing one is made. Every key not
    yet registered in this Kafka and topic namespace (a marker file says so)
    gets its ``UserKeyRegistered`` (event time ``now``, default the wall
    clock), all published together in the name of the keyring's ops identity
    (``ops.json``) and acknowledged before this returns. Names ``node:<id>``
    are node agents' principals (:func:`apportion.signers.report_signer`).

    Args:
        names: user names (``node:<id>`` for nodes).
        bootstrap: Kafka.
        now: event time of the registrations (default the wall clock).
        ring: the keyring (default :func:`apportion.identity.keys.keyring_dir`).

    Raises:
        LookupError: no keyring, or a keyring without ``ops.json``.
        ValueError: a name that is not a valid user name.
    """
    import hashlib

    from apportion.settings import topic_prefix

    ring = ring or keyring_dir()
    if ring is None:
        raise LookupError("no development keyring (APPORTION_KEYRING)")
    where = f"{kafka_address(bootstrap)}|{topic_prefix()}"
    marks = ring / ".registered" / hashlib.sha256(where.encode()).hexdigest()[:16]
    out, todo = [], []
    for name in names:
        if not JOB_ID_RE.fullmatch(name):
            raise ValueError(f"invalid user name {name!r} (use letters, digits and . _ : @ + -)")
        path = ring / f"{name}.json"
        if not path.is_file():
            try:
                Identity.generate(name).save(path)
            except FileExistsError:  # made meanwhile by another process
                pass
        ident = Identity.load(path)
        out.append(ident)
        marker = marks / ident.public_key.replace("/", "_")
        if not marker.is_file():
            todo.append((ident, marker))
    if todo:
        ops_path = ring / "ops.json"
        if not ops_path.is_file():
            raise LookupError(f"keyring {ring} has no ops.json to register {todo[0][0].user!r} with")
        ops = Identity.load(ops_path)
        publish(
            *(key_registration(i.user, i.public_key, role=i.role, by=ops.user, now=now) for i, _ in todo),
            bootstrap=bootstrap,
        )
        for _, marker in todo:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
    return out


def key_registration(
    user: str, public_key: str, *, role: str = "user", by: str = "", now: datetime | None = None
) -> events.UserKeyRegistered:
    """The ``UserKeyRegistered`` that lets ``public_key`` sign for ``user`` (publish it as ops).

    Raises:
        ValueError: ``public_key`` is not the base64 of 32 bytes (an Ed25519 public key).
    """
    import base64
    import binascii

    try:
        raw = base64.b64decode(public_key, validate=True)
    except binascii.Error:
        raw = b""
    if len(raw) != 32:
        raise ValueError(f"{public_key!r} is not an Ed25519 public key (base64 of 32 bytes)")
    ts = now or datetime.now(UTC)
    checked = _ROLES.get(role)
    if checked is None:
        raise ValueError(f"role must be user or ops, not {role!r}")
    return events.UserKeyRegistered(
        user=user,
        public_key=public_key,
        role=checked,
        by=by,
        ts=ts,
        producer=f"client/{by or 'ops'}",
    )


@overload
def submit(
    *,
    budget: str,
    gpus: int,
    min_runtime: str | float = 0,
    command: Sequence[str] | None = None,
    duration: str | float | None = None,
    replicas: int = 1,
    gpu_model: str | None = None,
    user: str | None = None,
    job_id: str | None = None,
    checkpoint_interval_s: float | None = None,
    hold: bool = False,
    env: dict[str, str] | None = None,
    time_limit: str | float | None = None,
    time_limit_s: float | None = None,
    array: str | None = None,
    topology_bound: str | None = None,
    wait: None = None,
    bootstrap: str | None = None,
    identity: Identity | None = None,
    now: datetime | None = None,
    producer: str | None = None,
) -> events.JobSubmitted: ...


@overload
def submit(
    *,
    budget: str,
    gpus: int,
    min_runtime: str | float = 0,
    command: Sequence[str] | None = None,
    duration: str | float | None = None,
    replicas: int = 1,
    gpu_model: str | None = None,
    user: str | None = None,
    job_id: str | None = None,
    checkpoint_interval_s: float | None = None,
    hold: bool = False,
    env: dict[str, str] | None = None,
    time_limit: str | float | None = None,
    time_limit_s: float | None = None,
    array: str | None = None,
    topology_bound: str | None = None,
    wait: float,
    bootstrap: str | None = None,
    identity: Identity | None = None,
    now: datetime | None = None,
    producer: str | None = None,
) -> events.JobQueued | events.JobRejected: ...


def submit(
    *,
    budget: str,
    gpus: int,
    min_runtime: str | float = 0,
    command: Sequence[str] | None = None,
    duration: str | float | None = None,
    replicas: int = 1,
    gpu_model: str | None = None,
    user: str | None = None,
    job_id: str | None = None,
    checkpoint_interval_s: float | None = None,
    hold: bool = False,
    env: dict[str, str] | None = None,
    time_limit: str | float | None = None,
    time_limit_s: float | None = None,
    array: str | None = None,
    topology_bound: str | None = None,
    wait: float | None = None,
    bootstrap: str | None = None,
    identity: Identity | None = None,
    now: datetime | None = None,
    producer: str | None = None,
) -> events.JobSubmitted | events.JobQueued | events.JobRejected:
    """Validate, sign and publish a submission.

    The job's fields are those of :func:`build_submission`; ``time_limit`` also takes a duration string
    (``"4h"``; ``time_limit_s`` is the same in seconds). ``user`` defaults to the identity's; ``identity``
    to :func:`identity_for` of ``user``. With ``array`` it submits a job array (:func:`submit_array`).

    Args:
        wait: ``None`` (the default): publish and return the signed ``JobSubmitted``. Seconds: wait that
            long for the dispatcher's verdict and return it: ``JobQueued`` (accepted; of an array's first
            element) or ``JobRejected`` (``reason``, ``message``).

    Raises:
        InvalidSubmission: the submission is refused before publishing (``field``, ``message``).
        NoVerdict: ``wait`` seconds passed without a verdict (the submission is in the log).
        KafkaFailure: Kafka could not be reached or refused the request.
        LookupError, ValueError: no identity to sign with (:func:`identity_for`).
    """
    limit_s = _time_limit_s(time_limit, time_limit_s)
    fields: dict[str, Any] = {
        "budget": budget,
        "gpus": gpus,
        "min_runtime": min_runtime,
        "command": command,
        "duration": duration,
        "replicas": replicas,
        "gpu_model": gpu_model,
        "job_id": job_id,
        "checkpoint_interval_s": checkpoint_interval_s,
        "hold": hold,
        "env": env,
        "time_limit_s": limit_s,
        "now": now,
        "producer": producer,
        "array": array,
        "topology_bound": topology_bound,
    }
    build_submission(user=user or "validation", **fields)  # the request's own errors first, before any key or broker
    with _kafka_failures(bootstrap):
        ident = identity or identity_for(user, bootstrap=bootstrap)
        ev = ident.sign(build_submission(user=user or ident.user, **fields))
        got = _publish_submissions([ev], wait, bootstrap)
    return got[0]


def _time_limit_s(time_limit: str | float | None, time_limit_s: float | None) -> float | None:
    if time_limit is not None and time_limit_s is not None:
        raise InvalidSubmission("time_limit_s", "give time_limit or time_limit_s, not both")
    if time_limit is None:
        return time_limit_s
    try:
        return parse_duration(time_limit)
    except ValueError as exc:
        raise InvalidSubmission("time_limit_s", str(exc)) from None


def _publish_submissions(
    subs: Sequence[events.JobSubmitted], wait: float | None, bootstrap: str | None
) -> list[events.JobSubmitted | events.JobQueued | events.JobRejected]:
    """Publish signed submissions (one producer, one flush); with ``wait``, each one's verdict (one watcher).

    Raises:
        NoVerdict: ``wait`` seconds passed before every verdict came (naming the first submission without one).
    """
    watcher = VerdictWatcher.for_submissions(subs, bootstrap=bootstrap) if wait is not None else None
    try:
        publish(*subs, bootstrap=bootstrap)
    except BaseException:
        if watcher is not None:
            watcher.close()
        raise
    if watcher is None or wait is None:
        return list(subs)
    verdicts = watcher.wait_all(wait)
    out: list[events.JobSubmitted | events.JobQueued | events.JobRejected] = []
    for sub, v in zip(subs, verdicts, strict=True):
        if not isinstance(v, (events.JobQueued, events.JobRejected)):
            raise NoVerdict(sub.job_id, wait)
        out.append(v)
    return out


def submit_array(
    indices: str,
    *,
    budget: str,
    gpus: int,
    min_runtime: str | float = 0,
    command: Sequence[str] | None = None,
    duration: str | float | None = None,
    wait: float | None = None,
    **fields: Any,
) -> events.JobSubmitted | events.JobQueued | events.JobRejected:
    """Submit a job array: one signed record for one job per index (Slurm's ``sbatch --array``).

    ``indices`` is Slurm's expression: ``"0-99%8"`` (0 to 99, at most 8 running at once), ``"1,3,5"``,
    ``"0-98:2"`` (:func:`apportion.arrays.parse_array`). Each element is a job of its own, with
    the id ``<job_id>_<index>`` and ``APPORTION_ARRAY_ID``/``APPORTION_ARRAY_INDEX`` in its environment;
    :func:`cancel` of ``job_id`` cancels every element still pending or running. The other arguments are
    :func:`submit`'s; with ``wait`` the verdict is the first element's ``JobQueued`` or the array's
    ``JobRejected``.

    Example::

        client.submit_array("0-99%8", budget="lab/vision", gpus=1, min_runtime="30m",
                            command=["python", "sweep.py"], job_id="sweep-7", wait=10)
    """
    return submit(
        budget=budget, gpus=gpus, min_runtime=min_runtime, command=command, duration=duration, array=indices,
        wait=wait, **fields,
    )  # fmt: skip


def submit_many(
    jobs: Sequence[dict[str, Any]],
    *,
    user: str | None = None,
    wait: float | None = None,
    bootstrap: str | None = None,
    identity: Identity | None = None,
) -> list[events.JobSubmitted | events.JobQueued | events.JobRejected]:
    """Submit several jobs at once: each validated and signed, all published with one flush, and with
    ``wait`` all verdicts awaited together (one watcher), in the order given.

    Each dict holds :func:`build_submission`'s fields but ``user`` (``budget``, ``gpus``, ``min_runtime``,
    ``command`` or ``duration``, ...; ``time_limit`` takes a duration string as in :func:`submit`).

    Raises:
        InvalidSubmission: one of them is refused before anything is published (``field`` is prefixed
            with its position, ``jobs[3].gpus_per_replica``).
        NoVerdict: ``wait`` passed before every verdict came; every submission is in the log.
        KafkaFailure: Kafka could not be reached or refused the request.
    """
    built: list[dict[str, Any]] = []
    for i, job in enumerate(jobs):
        fields = dict(job)
        limit = fields.pop("time_limit", None)
        try:
            fields["time_limit_s"] = _time_limit_s(limit, fields.get("time_limit_s"))
            build_submission(user=user or "validation", **fields)
        except InvalidSubmission as exc:
            raise InvalidSubmission(f"jobs[{i}].{exc.field}", exc.message) from None
        built.append(fields)
    with _kafka_failures(bootstrap):
        ident = identity or identity_for(user, bootstrap=bootstrap)
        signed = [ident.sign(build_submission(user=user or ident.user, **f)) for f in built]
        return _publish_submissions(signed, wait, bootstrap)


_Request = TypeVar("_Request", events.JobCancelRequested, events.JobHoldRequested, events.JobReleaseRequested)


def _request(
    kind: type[_Request], job_id: str, user: str | None, reason: str, bootstrap: str | None, identity: Identity | None
) -> _Request:
    """Sign a request of ``kind`` on ``job_id`` as the user's identity, publish it, return it.

    Raises:
        KafkaFailure: Kafka could not be reached or refused the request.
    """
    with _kafka_failures(bootstrap):
        ident = identity or identity_for(user, bootstrap=bootstrap)
        ts = datetime.now(UTC)
        ev = ident.sign(kind(job_id=job_id, user=ident.user, reason=reason, ts=ts, producer=f"client/{ident.user}"))
        publish(ev, bootstrap=bootstrap)
    return ev


def cancel(
    job_id: str,
    *,
    user: str | None = None,
    reason: str = "",
    bootstrap: str | None = None,
    identity: Identity | None = None,
) -> events.JobCancelRequested:
    """Sign and publish a request to cancel ``job_id``; returns the published request.

    The dispatcher answers ``JobCancelled`` (of a job array's id: every element still active cancelled, their count
    in its ``array_elements``: :func:`array_elements`) or ``JobRejected`` of the request.
    """
    return _request(events.JobCancelRequested, job_id, user, reason, bootstrap, identity)


def hold(
    job_id: str,
    *,
    user: str | None = None,
    reason: str = "",
    bootstrap: str | None = None,
    identity: Identity | None = None,
) -> events.JobHoldRequested:
    """Sign and publish a request to hold pending job ``job_id``; returns the published request.

    The dispatcher answers ``JobHeld`` (the job stays queued in its place and is never placed until
    released) or ``JobRejected`` of the request (``request="JobHoldRequested"``: not pending, already
    held, not the user's own job). Of a job array's id: every pending element held, their count in the
    answer's ``array_elements`` (:func:`array_elements`).
    """
    return _request(events.JobHoldRequested, job_id, user, reason, bootstrap, identity)


def release(
    job_id: str,
    *,
    user: str | None = None,
    reason: str = "",
    bootstrap: str | None = None,
    identity: Identity | None = None,
) -> events.JobReleaseRequested:
    """Sign and publish a request to release held job ``job_id`` (answered ``JobReleased`` or ``JobRejected``; of a
    job array's id, every held element released, their count in ``array_elements``: :func:`array_elements`)."""
    return _request(events.JobReleaseRequested, job_id, user, reason, bootstrap, identity)


def array_elements(answer: events.Event | None, request: events.JobRequest) -> int | None:
    """How many elements of a job array the dispatcher's ``answer`` to ``request`` (published by :func:`cancel`,
    :func:`hold` or :func:`release`, its answer read with :class:`VerdictWatcher`) applied to: the answer's
    ``array_elements``, also read from an answer written before that field existed; ``None`` for a job's answer,
    a refusal, or no answer."""
    return events.array_elements_of(answer, request.reason)


#: Milliseconds a reader of :func:`log_reader` waits for a broker of its bootstrap to answer before it raises.
READER_BOOTSTRAP_MS = 5_000


def log_reader(bootstrap: str, **config: Any) -> Any:
    """A kafka-python consumer of ``bootstrap`` that reads committed records, joins no group and commits nothing
    (the verdict watchers, the CLI's reads of the log); ``config`` adds kafka-python settings or overrides these.
    Made by :func:`apportion.bus.clients.kafka_consumer`: when no broker answers within
    :data:`READER_BOOTSTRAP_MS` it raises and leaves no network thread running."""
    from apportion.bus.clients import kafka_consumer
    from apportion.bus.producer import READ_COMMITTED
    from apportion.bus.security import kafka_auth

    settings: dict[str, Any] = {
        "bootstrap_servers": bootstrap,
        "group_id": None,
        "enable_auto_commit": False,
        "request_timeout_ms": 10_000,
        "bootstrap_timeout_ms": READER_BOOTSTRAP_MS,
        **READ_COMMITTED,
        **kafka_auth(),
    }
    return kafka_consumer(**{**settings, **config})


class VerdictWatcher:
    """Waits for the dispatcher's answer to a submission: ``JobQueued`` or ``JobRejected``.

    Open it *before* publishing (it starts at the current end of
    ``apportion.jobs``), then call :meth:`wait`. Reads only, joins no
    consumer group, commits nothing.

    Args:
        job_id: the submission's job id (the record key on ``apportion.jobs``).
        bootstrap: Kafka bootstrap (resolved as :mod:`apportion.settings`).
        also: other job ids whose verdict answers too (a job array's first element: its ``JobQueued``).

    Raises:
        LookupError: ``apportion.jobs`` does not exist (the namespace was never provisioned).
    """

    def __init__(self, job_id: str, *, bootstrap: str | None = None, also: Sequence[str] = ()) -> None:
        self.job_id = job_id
        self._groups: list[tuple[str, ...]] = [(job_id, *also)]
        self._open(bootstrap)

    @classmethod
    def for_submissions(cls, subs: Sequence[events.JobSubmitted], *, bootstrap: str | None = None) -> VerdictWatcher:
        """A watcher of the verdicts of ``subs`` (:meth:`wait_all`): each one's ``JobQueued`` (an array's first
        element's) or ``JobRejected``."""
        self = cls.__new__(cls)
        self.job_id = subs[0].job_id
        self._groups = [(s.job_id, s.job_ids[0]) if s.array is not None else (s.job_id,) for s in subs]
        self._open(bootstrap)
        return self

    def _open(self, bootstrap: str | None) -> None:
        from kafka import TopicPartition

        from apportion.topics import JOBS

        self._keys = {j.encode("utf-8") for g in self._groups for j in g}
        kafka = kafka_address(bootstrap)
        self._kc = log_reader(kafka)
        try:
            self._kc.topics()  # loads the cluster metadata, so the partitions below are known
            parts = [
                TopicPartition(topic_name(JOBS), p)
                for p in sorted(self._kc.partitions_for_topic(topic_name(JOBS)) or ())
            ]
            if not parts:
                raise LookupError(
                    f"topic {topic_name(JOBS)} does not exist at {kafka}: the namespace is not provisioned "
                    "(python -m apportion.bus.provision, or apportion stack up)"
                )
            self._kc.assign(parts)
            self._kc.seek_to_end()
            for tp in parts:
                self._kc.position(tp)  # pin the end now, before the submission is published
        except BaseException:
            self._kc.close()
            raise

    def close(self) -> None:
        """Stop reading (what :meth:`wait` does when it returns)."""
        self._kc.close()

    def wait(self, timeout_s: float) -> events.Event | None:
        """The verdict, or ``None`` when none arrived within ``timeout_s`` wall seconds."""
        return self.wait_all(timeout_s)[0]

    def wait_all(self, timeout_s: float) -> list[events.Event | None]:
        """Each watched submission's verdict, in order (``None`` where none arrived within ``timeout_s``)."""
        import time

        group_of = {j: i for i, g in enumerate(self._groups) for j in g}
        got: list[events.Event | None] = [None] * len(self._groups)
        left_n = len(got)
        end = time.monotonic() + timeout_s
        try:
            while left_n and (left := end - time.monotonic()) > 0:
                batch = self._kc.poll(timeout_ms=int(min(left, 0.5) * 1000))
                for recs in batch.values():
                    for rec in recs:
                        if rec.key not in self._keys:
                            continue
                        try:
                            ev = events.decode(rec.value)
                        except events.DecodeError:
                            continue
                        if not isinstance(ev, (events.JobQueued, events.JobRejected)):
                            continue
                        i = group_of.get(ev.job_id)
                        if i is not None and got[i] is None:
                            got[i] = ev
                            left_n -= 1
            return got
        finally:
            self._kc.close()
