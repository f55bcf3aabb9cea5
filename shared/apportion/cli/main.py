"""``apportion``: the command line for researchers and ops.

Human tables by default, ``--json`` for scripts. Every command that talks
to the cluster resolves Kafka and Redis as :mod:`apportion.settings` says
(flags, then ``APPORTION_KAFKA_BOOTSTRAP``/``APPORTION_REDIS_URL``, then the
``stack.env`` written by ``make up`` / ``apportion stack up``). Errors print one
clear line on stderr and exit non-zero: 1 when a change is refused or names
nothing that exists, 2 for bad input, 3 when Kafka or Redis cannot be reached,
the namespace is not provisioned, or the owning service gives no verdict in
time. Change commands check, publish, then wait for the verdict
(:mod:`apportion.cli.verdicts`; ``docs/operations.md``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from apportion import events
from apportion.cli.common import (
    _checked,
    _print_json,
    _publish,
    _published,
    _ratio,
    _require_topics,
    _tree_from_file,
    check_budget_filter,
    err,
    fail,
    out,
    refuse,
)
from apportion.durations import format_duration, parse_duration
from apportion.settings import Connection, topic_name, topic_prefix

if TYPE_CHECKING:
    from apportion.domain.nodes import NodeEvent
    from apportion.identity.keys import Identity

app = typer.Typer(
    name="apportion",
    help=(
        "Budgeted, hierarchical fair-share GPU scheduling.\n\n"
        "Researchers: `keys init`, `submit`, `cancel`, `hold`, `release`, `queue`, `history`, `share` (requests are "
        "signed with your key). Ops: `nodes`, `drain`, `cordon`, `undrain`, `budget`, `audit`, `keys register`. "
        "Everyone: "
        "`simulate`, `whatif`, `stack` (a local stack in one command).\n\n"
        "Change commands wait for the owning service's verdict. Exit codes: 0 done, 1 refused or not found, "
        "2 bad input, 3 stack unreachable or no verdict in time (docs/operations.md).\n\n"
        "Jobs with --min-runtime > 0 are charged to their budget and protected from preemption "
        "for that long; --min-runtime 0 runs unallocated: free, on idle GPUs, preempted first."
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
budget_app = typer.Typer(help="Show and change the budget tree (ops).", no_args_is_help=True)
app.add_typer(budget_app, name="budget")

Bootstrap = Annotated[
    str | None, typer.Option("--bootstrap", help="Kafka bootstrap (host:port).", envvar="APPORTION_KAFKA_BOOTSTRAP")
]
RedisUrl = Annotated[str | None, typer.Option("--redis", help="Redis URL.", envvar="APPORTION_REDIS_URL")]
JsonOut = Annotated[bool, typer.Option("--json", help="Print JSON for scripts instead of a table.")]
NoWait = Annotated[bool, typer.Option("--no-wait", help="Publish and exit 0 without waiting for the verdict.")]
Timeout = Annotated[
    float, typer.Option("--timeout", min=0.1, help="Wall seconds to wait for the owning service's verdict.")
]
DEFAULT_WAIT_S = 15.0
RequestReason = Annotated[str, typer.Option("--reason", help="Why (kept in the log; a hold's is its pending reason).")]
RequestUser = Annotated[
    str | None,
    typer.Option("--user", "-u", help="Requesting user (default: your identity's; the request is signed)."),
]


def _now() -> datetime:
    return datetime.now(UTC)


def _identity(user: str | None, bootstrap: str | None, *, ops: bool = False) -> Identity:
    """The identity that signs ``user``'s requests (:func:`apportion.client.identity_for`); exit 2 without one.

    ``ops``: the operator's instead, for requests on nodes (:func:`apportion.client.ops_identity`).
    """
    from apportion import client

    try:
        return client.ops_identity(bootstrap=bootstrap) if ops else client.identity_for(user, bootstrap=bootstrap)
    except (LookupError, ValueError) as exc:
        fail(str(exc))
    except Exception as exc:  # the enrolment of a development keyring publishes
        if type(exc).__module__.startswith("kafka"):
            fail(f"cannot register {user or 'your'} key at Kafka: {exc}", 3)
        raise


def _redis(redis_url: str | None) -> Any:
    import redis

    conn = Connection.resolve(redis_url=redis_url)
    from apportion.bus.security import redis_auth

    r = redis.Redis.from_url(conn.redis_url, socket_connect_timeout=3, **redis_auth(conn.redis_url))
    try:
        r.ping()
    except redis.RedisError as exc:
        fail(f"cannot reach Redis at {conn.redis_url}: {exc} (is the stack up? `apportion stack up`)", 3)
    return r


# --------------------------------------------------------------------------- researchers


@app.command()
def submit(
    budget: Annotated[str, typer.Option("--budget", "-b", help="Budget path to charge, e.g. lab/prior/robotics.")],
    gpus: Annotated[int, typer.Option("--gpus", "-g", min=1, help="GPUs per replica.")],
    min_runtime: Annotated[
        str,
        typer.Option(
            "--min-runtime",
            "-m",
            help="Minimum runtime (90s, 30m, 2h): at most the budget's max min runtime, or the window W (7d) where "
            "no budget sets one. 0 = unallocated: free, preemptible any time.",
        ),
    ],
    command: Annotated[list[str] | None, typer.Argument(help="Command to run (after --).")] = None,
    replicas: Annotated[
        int, typer.Option("--replicas", "-k", min=1, help="Gang size: replicas start together on distinct nodes.")
    ] = 1,
    duration: Annotated[
        str | None, typer.Option("--duration", help="Simulated run time instead of a command (demo clusters).")
    ] = None,
    gpu_model: Annotated[str | None, typer.Option("--gpu-model", help="Required GPU model.")] = None,
    checkpoint_interval: Annotated[
        str | None,
        typer.Option(
            "--checkpoint-interval",
            help="How often the workload saves a checkpoint (90s, 30m, 2h; > 0). Default: once per minimum runtime.",
        ),
    ] = None,
    user: Annotated[
        str | None,
        typer.Option("--user", "-u", help="Submitting user (default: your identity's; the request is signed)."),
    ] = None,
    job_id: Annotated[str | None, typer.Option("--job-id", help="Job id (default: generated).")] = None,
    hold: Annotated[
        bool, typer.Option("--hold", help="Submit it held: queued, never placed until `apportion release JOB`.")
    ] = False,
    env: Annotated[
        list[str] | None,
        typer.Option("--env", "-e", help="KEY=VALUE for the workload's environment (repeatable; wins over the file)."),
    ] = None,
    env_file: Annotated[
        Path | None,
        typer.Option("--env-file", help="File of KEY=VALUE lines (# comments) for the workload's environment."),
    ] = None,
    time_limit: Annotated[
        str | None,
        typer.Option(
            "--time",
            "-t",
            help="Time limit of each run (90m, 4h, 2d): the node agent stops it then (JobFailed time_limit). "
            "Default: the budget's default_time_limit, if any; at most its max_time_limit.",
        ),
    ] = None,
    array: Annotated[
        str | None,
        typer.Option(
            "--array",
            "-a",
            help="A job array, Slurm's syntax: 0-99 (range), 1,3,5 (list), 0-99:2 (step), %N (at most N running): "
            "one job per index, JOB_ID_INDEX, each with APPORTION_ARRAY_INDEX set.",
        ),
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Validate and print the event; publish nothing.")] = False,
    wait: Annotated[
        float,
        typer.Option(
            "--wait",
            help="Seconds to wait for the dispatcher's verdict (queued or rejected with the reason); 0 = do not wait.",
        ),
    ] = 10.0,
    bootstrap: Bootstrap = None,
    as_json: JsonOut = False,
) -> None:
    """Submit a job.

    Examples:

      apportion submit -b lab/vision -g 2 -m 2h -- python train.py --lr 3e-4

      apportion submit -b lab/vision -g 8 -k 4 -m 4h --duration 6h   (simulated gang)

      apportion submit -b lab/vision -g 1 -m 0 -- python sweep.py     (unallocated)

      apportion submit -b lab/vision -g 1 -m 30m --array 0-99%8 -- python sweep.py   (100 jobs, 8 at a time)

    Unallocated work (-m 0) charges nothing: any user may run it under any leaf budget, member or not.

    Its GPU-hours show as the budget's U, never in its r (docs/security.md).
    """

    from apportion import client

    check_budget_filter(budget)  # a malformed path is refused here (exit 2), as queue --budget refuses it
    try:
        text = env_file.read_text(encoding="utf-8") if env_file is not None else None
        job_env = client.parse_env(env or (), text, file_name=str(env_file))
    except OSError as exc:
        fail(f"--env-file: cannot read {env_file}: {exc.strerror or exc}")
    except ValueError as exc:
        fail(f"invalid submission: {exc}")

    def build(who: str) -> Any:
        try:
            return client.build_submission(
                budget=budget,
                user=who,
                gpus=gpus,
                replicas=replicas,
                min_runtime=min_runtime,
                command=command or None,
                duration=duration,
                gpu_model=gpu_model,
                job_id=job_id,
                checkpoint_interval_s=parse_duration(checkpoint_interval) if checkpoint_interval is not None else None,
                hold=hold,
                env=job_env,
                time_limit_s=parse_duration(time_limit) if time_limit is not None else None,
                producer="cli",
                array=array,
            )
        except client.InvalidSubmission as exc:
            fail(exc.message if exc.field == "job_id" else str(exc))
        except ValueError as exc:
            fail(str(exc))

    build(user or "validation")  # the request's own errors first (exit 2), before the stack is asked anything
    if not dry_run:
        from apportion.topics import JOBS, SUBMISSIONS

        _require_topics(bootstrap, topic_name(SUBMISSIONS), topic_name(JOBS))
    ident: Identity | None = None
    if dry_run and user is not None:
        try:
            who = client.check_user(user)  # --dry-run --user: validate, sign nothing
        except ValueError as exc:
            fail(str(exc))
    else:
        ident = _identity(user, bootstrap)
        who = ident.user
    ev = build(who)
    if ident is not None:
        ev = ident.sign(ev)
    verdict = None
    if not dry_run:
        watcher = None
        if wait > 0:
            try:
                watcher = client.VerdictWatcher.for_submissions([ev], bootstrap=bootstrap)
            except Exception as exc:  # cannot read: publishing will say why
                if not type(exc).__module__.startswith("kafka"):
                    raise
        _publish([ev], bootstrap)
        if watcher is not None:
            verdict = watcher.wait(wait)
    if as_json:
        doc = events.to_dict(ev)
        if verdict is not None:
            doc = {"submission": doc, "verdict": events.to_dict(verdict)}
        _print_json(doc)
    elif not isinstance(verdict, events.JobRejected):  # a rejected job was not submitted: say only that
        kind = "allocated" if ev.allocated else "unallocated"
        spec = ev.array_spec
        if spec is not None:
            most = f", at most {spec.throttle} running" if spec.throttle is not None else ""
            kind += f"; array of {len(spec.indices)}: {ev.job_ids[0]} .. {ev.job_ids[-1]}{most}"
        out.print(
            f"{'validated' if dry_run else 'submitted'} [bold]{ev.job_id}[/] "
            f"({ev.replicas}x{ev.gpus_per_replica} GPUs, {kind}, budget {ev.budget})"
        )
        if isinstance(verdict, events.JobQueued):
            held = " held (`apportion release " + ev.job_id + "` lets it run)" if ev.hold else ""
            out.print(f"queued by the dispatcher{held} (see `apportion queue`)")
    if isinstance(verdict, events.JobRejected):
        err.print(f"[bold red]rejected:[/] {verdict.reason.value}: {verdict.message}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    if verdict is None and not dry_run and wait > 0:
        fail(f"no verdict from the dispatcher within {wait:g} s (is it running?); the submission is in the log", 3)


@app.command()
def cancel(
    job_id: Annotated[str, typer.Argument(help="Job to cancel.")],
    reason: RequestReason = "",
    user: RequestUser = None,
    no_wait: NoWait = False,
    timeout: Timeout = DEFAULT_WAIT_S,
    bootstrap: Bootstrap = None,
    as_json: JsonOut = False,
) -> None:
    """Cancel a pending or running job and wait for the dispatcher's JobCancelled.

    Exit 1 when the log has no such job or it already finished; 3 when Kafka
    cannot be reached or the dispatcher gives no verdict within --timeout.
    """
    _job_request(events.JobCancelRequested, job_id, reason, user, no_wait, timeout, bootstrap, as_json)


@app.command()
def hold(
    job_id: Annotated[str, typer.Argument(help="Pending job to hold.")],
    reason: RequestReason = "",
    user: RequestUser = None,
    no_wait: NoWait = False,
    timeout: Timeout = DEFAULT_WAIT_S,
    bootstrap: Bootstrap = None,
    as_json: JsonOut = False,
) -> None:
    """Hold a pending job: it stays queued in its place (its submission time kept) and is never placed
    until `apportion release`. Waits for the dispatcher's JobHeld.

    Only the job's user or ops may hold it. Exit 1 when refused (not pending, already held, not yours) or the
    log has no such job; 3 when Kafka cannot be reached or no verdict comes within --timeout.
    """
    _job_request(events.JobHoldRequested, job_id, reason, user, no_wait, timeout, bootstrap, as_json)


@app.command()
def release(
    job_id: Annotated[str, typer.Argument(help="Held job to release.")],
    reason: RequestReason = "",
    user: RequestUser = None,
    no_wait: NoWait = False,
    timeout: Timeout = DEFAULT_WAIT_S,
    bootstrap: Bootstrap = None,
    as_json: JsonOut = False,
) -> None:
    """Release a held job back into its budget's fair-share order. Waits for the dispatcher's JobReleased.

    Only the job's user or ops may release it. Exit 1 when refused (not held, not yours) or the log has no
    such job; 3 when Kafka cannot be reached or no verdict comes within --timeout.
    """
    _job_request(events.JobReleaseRequested, job_id, reason, user, no_wait, timeout, bootstrap, as_json)


#: A request on a job -> (its verb, the dispatcher's answer, the verdict word once carried out).
JOB_REQUESTS: dict[str, tuple[str, str, str]] = {
    "JobCancelRequested": ("cancel", "JobCancelled", "cancelled"),
    "JobHoldRequested": ("hold", "JobHeld", "held"),
    "JobReleaseRequested": ("release", "JobReleased", "released"),
}


def _job_request(
    cls: type[events.JobCancelRequested] | type[events.JobHoldRequested] | type[events.JobReleaseRequested],
    job_id: str,
    reason: str,
    user: str | None,
    no_wait: bool,
    timeout: float,
    bootstrap: str | None,
    as_json: bool,
) -> None:
    """``cancel``, ``hold`` and ``release``: check the job is live in the log, sign and publish the request,
    wait for the dispatcher's answer (:data:`JOB_REQUESTS`) or its refusal of the request."""
    from apportion.cli import verdicts
    from apportion.topics import JOBS, SUBMISSIONS

    verb, answer, done_word = JOB_REQUESTS[cls.model_fields["type"].default]
    conn = _require_topics(bootstrap, topic_name(SUBMISSIONS), topic_name(JOBS))
    status = _checked(lambda: verdicts.job_status(conn.bootstrap, job_id))
    if status.state == "unknown":
        refuse(f"no job {job_id} in the log", as_json=as_json, verdict="not_found", reason="no_job", job_id=job_id)
    if status.state != "live":
        done = status.state
        refuse(
            f"job {job_id} already {done}{f' ({status.detail})' if status.detail else ''}: nothing to {verb}",
            as_json=as_json,
            reason="finished",
            job_id=job_id,
            state=done,
        )
    ident = _identity(user, bootstrap)
    ev = ident.sign(cls(job_id=job_id, user=ident.user, reason=reason, ts=_now(), producer="cli"))
    watcher = None if no_wait else _checked(lambda: verdicts.JobWatcher(conn.bootstrap, job_id, [answer]))
    _publish([ev], bootstrap)
    if watcher is None:
        _published([ev], as_json, f"{verb} requested for [bold]{job_id}[/] (not waiting for the dispatcher)")
        return
    verdict = watcher.wait(timeout, request_id=ev.event_id)
    refused = isinstance(verdict, events.JobRejected)
    if as_json:
        _print_json(
            {
                "ok": verdict is not None and not refused,
                "published": [events.to_dict(ev)],
                "verdict": "refused" if refused else done_word if verdict is not None else "no_verdict",
                "reason": verdict.reason.value if isinstance(verdict, events.JobRejected) else "",
                "event": events.to_dict(verdict) if verdict is not None else None,
            }
        )
    if verdict is None:
        fail(f"no verdict from the dispatcher within {timeout:g} s (is it running?); the request is in the log", 3)
    if isinstance(verdict, events.JobRejected):
        fail(f"refused: {verdict.reason.value}: {verdict.message}", 1)
    if not as_json:
        out.print(f"{done_word} [bold]{job_id}[/]")


LIVE_STATES = ("pending", "placed", "running", "stopping", "preempting", "cancelling", "lost")


def check_states(state: str | None, all_states: bool) -> set[str] | None:
    """``--state a,b`` as a set; exit 2 naming the allowed values for an unknown state, or for a finished
    one (``history.FINISHED``, only in the log) without ``--all``. ``None`` when no ``--state`` was given."""
    from apportion.cli.history import FINISHED

    if state is None:
        return None
    wanted = {x.strip() for x in state.split(",") if x.strip()}
    allowed = LIVE_STATES + FINISHED
    bad = sorted(wanted - set(allowed))
    if bad or not wanted:
        fail(f"--state: {', '.join(map(repr, bad)) or 'no state given'}: use one or more of {', '.join(allowed)}")
    done = sorted(wanted & set(FINISHED))
    if done and not all_states:
        fail(f"--state {', '.join(done)}: finished jobs come from the log: add --all (or use `apportion history`)")
    return wanted


def queue_rows(
    rc: Any,
    *,
    budget: str | None = None,
    user: str | None = None,
    state: str | None = None,
    all_states: bool = False,
    bootstrap: str | None = None,
) -> list[dict[str, Any]]:
    """The rows `apportion queue --json` prints: the dispatcher's ``apportion:rm:jobs`` rows, filtered and sorted.

    Running jobs first, then pending ones by ``position`` (their place in the fair-share order), then by
    submission time and id. Live states only unless ``state`` names others or ``all_states`` adds the finished
    jobs from the log (which needs Kafka at ``bootstrap``). Used by the CLI and the web dashboard.

    Args:
        rc: a ``redis.Redis`` client.
        budget: only this budget and those below it.
        user: only this user's jobs.
        state: comma-separated states to keep.
    """
    from apportion import readmodel

    rows = list(readmodel.read_hash(rc, readmodel.jobs_key()).values())
    if all_states:
        from apportion import topics
        from apportion.bus.reader import read_log
        from apportion.cli.history import FINISHED, fold_jobs

        conn = _require_topics(bootstrap, topic_name(topics.SUBMISSIONS), topic_name(topics.JOBS))
        recs = _checked(lambda: read_log(conn.bootstrap, [topic_name(topics.SUBMISSIONS), topic_name(topics.JOBS)]))
        live = {r.get("job_id") for r in rows}
        for j in fold_jobs(rec.event for rec in recs if rec.event is not None).values():
            if j.state in FINISHED and j.job_id not in live:
                d = j.to_dict()
                d.update(position=None, nodes=[], started_at=d["first_start"], attempt=j.attempts)
                rows.append(d)
    wanted = {x.strip() for x in state.split(",") if x.strip()} if state else None
    rows = [
        r
        for r in rows
        if (wanted is not None or all_states or r.get("state") in LIVE_STATES)
        and (wanted is None or r.get("state") in wanted)
        and (user is None or r.get("user") == user)
        and (budget is None or r.get("budget") == budget or str(r.get("budget", "")).startswith(budget + "/"))
    ]
    rows.sort(
        key=lambda r: (
            r.get("state") != "running",
            r.get("position") if r.get("position") is not None else 1 << 30,
            r.get("submitted_at", ""),
            r.get("job_id", ""),
        )
    )
    return rows


#: Terminal width (columns) below which `apportion queue` leaves out its least read columns (min rt, attempt).
QUEUE_WIDE = 120


def queue_table(rows: list[dict[str, Any]], width: int) -> Any:
    """The `apportion queue` output of :func:`queue_rows`' rows for a terminal ``width`` columns wide.

    The job id, budget, user, shape and state are never cut (they are what a user copies into the next
    command). At :data:`QUEUE_WIDE` columns and more, one table with every column, the last one (nodes, or
    the pending reason) wrapping in the width left. Narrower (an 80-column terminal), the table leaves out
    the minimum runtime, the attempt, the idle column and the last column and shows the start time as
    ``MM-DD HH:MM`` (UTC); each job's nodes or pending reason follow the table on a line of their own
    (``job: reason``), wrapped, uncut, a running job's with how long its GPUs have been idle when its node
    agents report it. A run whose GPUs stay idle past its nodes' ``idle_after_s`` (the row's ``idle``) shows
    ``IDLE`` in place of ``running`` in the narrow table and in the idle column of the wide one. A running
    job's protection notice (the row's ``protection``) follows its nodes. Rows with a forecast (``queue
    --start``: ``est_start``, ``est_basis``) show a pending job's estimated start in the start column, marked
    ``~``, and its basis in a column of its own.
    ``--json`` has every field.
    """
    from rich import box
    from rich.console import Group
    from rich.text import Text

    wide = width >= QUEUE_WIDE

    def text(r: dict[str, Any], key: str) -> str:
        return str(r.get(key) or "")

    def widest(key: str, title: str) -> int:
        return max([len(title), *(len(text(r, key)) for r in rows)])

    def detail(r: dict[str, Any]) -> str:  # the nodes of a run and its protection, the reason of a pending job
        nodes = ",".join(r.get("nodes") or [])
        if r.get("state") == "running" and r.get("protection"):
            nodes = f"{nodes} ({r['protection']})" if nodes else str(r["protection"])
        return str((r.get("reason") if r.get("state") == "pending" else nodes or r.get("reason")) or "")

    def idle(r: dict[str, Any]) -> str:  # what the node agents report of a running job's GPU use
        if r.get("state") != "running" or r.get("idle_s") is None:
            return ""
        return ("IDLE " if r.get("idle") else "") + format_duration(float(r["idle_s"]))

    def state(r: dict[str, Any]) -> str:
        return "IDLE" if not wide and r.get("state") == "running" and r.get("idle") else text(r, "state")

    def where(r: dict[str, Any]) -> str:  # the line after the narrow table
        d, i = detail(r), idle(r)
        return f"{d} (GPUs idle {i.removeprefix('IDLE ')})" if i and i != "0s" else d

    def started(r: dict[str, Any]) -> str:  # a pending job's estimated start with --start, marked ~
        at = r.get("started_at") or r.get("est_start")
        mark = "~" if r.get("state") == "pending" and at else ""
        return mark + (at[:19] if wide else at[5:16]).replace("T", " ") if at else "-"

    starts = any("est_basis" in r for r in rows)

    # (title, rich column options, cell, in the narrow table too): one list for the header and the cells
    columns: list[tuple[str, dict[str, Any], Callable[[dict[str, Any]], str], bool]] = [
        (
            "pos",
            {"justify": "right", "min_width": 3},
            lambda r: "-" if r.get("position") is None else str(r["position"]),
            True,
        ),
        ("job", {"min_width": widest("job_id", "job")}, lambda r: text(r, "job_id"), True),
        ("budget", {"min_width": widest("budget", "budget")}, lambda r: text(r, "budget"), True),
        ("user", {"min_width": widest("user", "user")}, lambda r: text(r, "user"), True),
        ("GPUs", {"min_width": 4}, lambda r: f"{r.get('replicas', 1)}x{r.get('gpus_per_replica', '?')}", True),
        ("min rt", {}, lambda r: format_duration(float(r.get("min_runtime_s", 0))), False),
        ("state", {"min_width": widest("state", "state")}, state, True),
        ("att", {"justify": "right"}, lambda r: str(r.get("attempt", "")), False),
        ("started (UTC)" if wide else "started", {"min_width": 19 if wide else 11}, started, True),
        *([("basis", {}, lambda r: text(r, "est_basis"), True)] if starts else []),
        ("idle", {}, idle, False),
        ("nodes / reason", {"overflow": "fold", "ratio": 1, "no_wrap": False}, detail, False),
    ]
    shown = [c for c in columns if wide or c[3]]
    t = Table(
        title=f"queue ({len(rows)} jobs)", box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, collapse_padding=True
    )
    for title, opts, _, _ in shown:
        t.add_column(title, **({"no_wrap": True} | opts))
    lines: list[Text] = []
    for r in rows:
        t.add_row(*(cell(r) for _, _, cell, _ in shown))
        if not wide and (d := where(r)):
            lines.append(Text.assemble((text(r, "job_id"), "bold"), ": ", d))
    return Group(t, *((Text("nodes (running) / reason (pending), UTC times:"), *lines) if lines else ()))


@app.command()
def queue(
    budget: Annotated[str | None, typer.Option("--budget", "-b", help="Only this budget (and below).")] = None,
    user: Annotated[str | None, typer.Option("--user", "-u", help="Only this user's jobs.")] = None,
    state: Annotated[
        str | None,
        typer.Option(
            "--state", help="Only these states, comma-separated (pending, running, ...; completed etc. with --all)."
        ),
    ] = None,
    all_states: Annotated[
        bool, typer.Option("--all", help="Include finished jobs (from the log, as `apportion history`).")
    ] = False,
    start: Annotated[
        bool,
        typer.Option(
            "--start",
            help="Each pending job's estimated start and its basis (like squeue --start), from the log as "
            "`apportion forecast` finds them.",
        ),
    ] = False,
    redis_url: RedisUrl = None,
    bootstrap: Bootstrap = None,
    as_json: JsonOut = False,
) -> None:
    """Jobs in the queue (like squeue): position, budget, user, GPUs, state, start time, nodes or pending reason.

    The position is the place in the fair-share order a scheduling cycle walks now (pending jobs only;
    `-` for running ones). The pending reason comes from the engine's own cycle (`kind: facts`; kinds
    budget_ahead, reserved_by, protected_until, no_node_shape, no_free_gpus, budget_unknown, patience,
    checkpoint_soon, placeable; from the dispatcher: refused_backoff, for a job whose start a node refused, and
    held, for a job held until `apportion release`);
    `--json` rows also carry `reason_detail`, the reason's fields.

    A running job shows what its protection promises: protected until T (preemptible after), or preemptible since.

    With --start, each pending job gets its estimated start (est_start, est_basis in --json): the log read and the
    engine run forward as `apportion forecast` does (basis: now, rules, simulated, time_limit, history, unknown).
    """
    from apportion.forecast import protection_notice
    from apportion.timeutil import to_us

    check_states(state, all_states)
    check_budget_filter(budget)
    rows = queue_rows(
        _redis(redis_url), budget=budget, user=user, state=state, all_states=all_states, bootstrap=bootstrap
    )
    now_us = to_us(_now())
    for r in rows:
        notice = protection_notice(r, now_us)
        if notice:
            r["protection"] = notice
    if start:
        rows = _with_forecast_starts(rows, bootstrap)
    if as_json:
        _print_json(rows)
        return
    out.print(queue_table(rows, out.width))


def _with_forecast_starts(rows: list[dict[str, Any]], bootstrap: str | None) -> list[dict[str, Any]]:
    """``queue --start``: the rows with each pending job's forecast start (:func:`apportion.forecast.with_starts`)."""
    from apportion.audit.replay import decoded
    from apportion.forecast import forecast as run_forecast
    from apportion.forecast import user_history, with_starts

    recs, cfg, state, now = _forecast_input(bootstrap, None, None)
    wanted = [str(r["job_id"]) for r in rows if r.get("state") == "pending" and r.get("job_id") in state.jobs]
    fc = run_forecast(state, now, cfg, job_ids=wanted, history=user_history(decoded(recs)))
    return with_starts(rows, fc)


#: The `apportion forecast` basis column, for its footer and help (the values of :mod:`apportion.forecast`).
FORECAST_BASES = (
    "now: starts at once; rules: only protection and grace ends delay it (exact); simulated: runs end at their "
    "declared work; time_limit: at their time limit; history: at their user's median run time; unknown: "
    "assumed to run W/4"
)


@app.command()
def forecast(
    job_id: Annotated[str | None, typer.Argument(help="One pending job (default: every pending job).")] = None,
    budget: Annotated[str | None, typer.Option("--budget", "-b", help="Only this budget (and below).")] = None,
    user: Annotated[str | None, typer.Option("--user", "-u", help="Only this user's jobs.")] = None,
    at: Annotated[
        str | None, typer.Option("--at", help="Event time of the forecast (ISO). Default: the log's latest event.")
    ] = None,
    horizon: Annotated[str, typer.Option("--horizon", help="How far ahead to look (e.g. 14d, 36h).")] = "14d",
    submit_: Annotated[
        bool,
        typer.Option(
            "--submit",
            help="Forecast a job not yet submitted, as if submitted now: -b, -u, -g, -m, -k, -t, --duration, "
            "--gpu-model, --checkpoint-interval, --array as for `submit` (-u defaults to your login name).",
        ),
    ] = False,
    gpus: Annotated[int | None, typer.Option("--gpus", "-g", min=1, help="With --submit: GPUs per replica.")] = None,
    min_runtime: Annotated[
        str | None, typer.Option("--min-runtime", "-m", help="With --submit: minimum runtime (0 = unallocated).")
    ] = None,
    replicas: Annotated[int, typer.Option("--replicas", "-k", min=1, help="With --submit: gang size.")] = 1,
    duration: Annotated[
        str | None, typer.Option("--duration", help="With --submit: simulated run time (demo clusters).")
    ] = None,
    gpu_model: Annotated[str | None, typer.Option("--gpu-model", help="With --submit: required GPU model.")] = None,
    checkpoint_interval: Annotated[
        str | None, typer.Option("--checkpoint-interval", help="With --submit: checkpoint interval.")
    ] = None,
    time_limit: Annotated[
        str | None, typer.Option("--time", "-t", help="With --submit: time limit (default: the budget's).")
    ] = None,
    array: Annotated[
        str | None, typer.Option("--array", "-a", help="With --submit: a job array (as for `submit`).")
    ] = None,
    with_arrivals: Annotated[
        bool,
        typer.Option(
            "--with-arrivals",
            help="Assume the last day's submissions come again, a day later and every day after (the recent "
            "arrival rate): later work of budgets ahead goes first, as it will.",
        ),
    ] = False,
    bootstrap: Bootstrap = None,
    from_file: Annotated[
        Path | None,
        typer.Option("--from-file", help="Read an export file instead of Kafka.", exists=True, dir_okay=False),
    ] = None,
    as_json: JsonOut = False,
) -> None:
    """When pending jobs will start: the scheduling engine run forward from the log (like squeue --start).

    Reads the log (Kafka, or an export with --from-file) and runs the dispatcher's engine forward in event time.

    Running work ends at its declared duration, its time limit, or its user's median run time in the log.

    Without any of these a run is assumed to last W/4; future submissions are left out (--with-arrivals: the
    last day's come again).

    Columns: est. start (UTC), in (from the forecast's time), basis (what it rests on), reason (why it waits now).

    One job also gets its chain: the runs that must end or be preempted for it.

    Exit 1 when the job is not pending (running, ended, or not in the log); 2 for bad input; 3 Kafka unreachable.

    Examples:

    apportion forecast  (every pending job)

    apportion forecast j-42  (one job, with its chain)

    apportion forecast sweep-7  (a job array: each pending element)

    apportion forecast -b lab/vision -u alice --json

    apportion forecast --from-file log.jsonl.gz --at 2024-05-01T12:00:00Z --horizon 3d

    apportion forecast --submit -b lab/vision -g 8 -k 2 -m 2h  (if I submit this now; exit 1 if it would be rejected)
    """
    from apportion.audit.replay import decoded
    from apportion.cli.audit import _dur
    from apportion.forecast import forecast as run_forecast
    from apportion.forecast import recent_arrivals, user_history

    check_budget_filter(budget)
    if submit_ and (job_id is not None or budget is None or gpus is None or min_runtime is None):
        fail("--submit needs -b BUDGET, -g GPUS and -m MIN_RUNTIME, and no JOB_ID")
    horizon_s = _dur(horizon, "--horizon")
    recs, cfg, state, now = _forecast_input(bootstrap, from_file, at)
    if submit_:
        import getpass

        assert budget is not None and gpus is not None and min_runtime is not None  # checked above
        sub = dict(budget=budget, user=user or getpass.getuser(), gpus=gpus, replicas=replicas, min_runtime=min_runtime)
        if time_limit is not None:
            sub["time_limit_s"] = _dur(time_limit, "--time")
        if array is not None:
            sub["array"] = array
        state, wanted = _forecast_submission(state, now, cfg, sub, duration, gpu_model, checkpoint_interval)
    elif job_id is not None and job_id in state.arrays:  # a job array: its pending elements
        members = state.arrays[job_id].members
        wanted = [j for j in sorted(members, key=members.__getitem__) if state.jobs[j].status == "pending"]
        if not wanted:
            fail(f"no element of array {job_id!r} is pending: nothing to forecast", 1)
    elif job_id is not None:
        _forecastable(state, job_id)
        wanted = [job_id]
    else:
        wanted = [
            j.job_id
            for leaf in sorted(state.pending)
            for j in state.pending[leaf]
            if (user is None or j.user == user) and (budget is None or leaf == budget or leaf.startswith(budget + "/"))
        ]
    evs = decoded(recs)
    arrivals = recent_arrivals(evs, now) if with_arrivals else ()
    fc = run_forecast(
        state, now, cfg, job_ids=wanted, history=user_history(evs), horizon_s=horizon_s, arrivals=arrivals
    )
    fc.jobs.sort(key=lambda j: (j.start_us is None, j.start_us or 0, j.job_id))
    if as_json:
        _print_json(fc.to_dict())
        return
    out.print(forecast_table(fc, out.width, detail=len(wanted) == 1 and (job_id is not None or submit_)))


def _forecast_input(bootstrap: str | None, from_file: Path | None, at: str | None) -> tuple[list[Any], Any, Any, int]:
    """The log (Kafka, or an export), the dispatcher's configuration and state folded from it, and the forecast's
    time (``--at``, default the log's latest event): what ``forecast``, ``queue --start`` and ``share --forecast``
    run forward. Exit 1 for an empty log, 2 for an ``--at`` before its latest event."""
    from apportion.audit.verify import dispatcher_fold
    from apportion.cli.audit import _dispatch_config, _load, parse_time
    from apportion.timeutil import from_us, to_us

    when = parse_time(at) if at is not None else None
    recs = _load(bootstrap, from_file)
    cfg = _dispatch_config(recs, None, None, None, None, None)
    state = dispatcher_fold(recs, cfg, producer=cfg.producer)
    if state.clock_us is None:
        fail("the log holds no events: nothing to forecast", 1)
    now = to_us(when) if when is not None else state.clock_us
    if now < state.clock_us:
        fail(f"--at {at} is before the log's latest event ({from_us(state.clock_us).isoformat()})")
    return recs, cfg, state, now


def _forecast_submission(
    state: Any,
    now: int,
    cfg: Any,
    sub: dict[str, Any],
    duration: str | None,
    gpu_model: str | None,
    checkpoint_interval: str | None,
) -> tuple[Any, list[str]]:
    """``forecast --submit``: the state with the job submitted at ``now`` and its ids (an array's elements);
    exit 2 for an invalid submission, 1 when the dispatcher's admission would reject it (the reason said)."""
    from pydantic import ValidationError

    from apportion import client
    from apportion.forecast import with_submission
    from apportion.timeutil import from_us

    try:
        every = parse_duration(checkpoint_interval) if checkpoint_interval is not None else None
        job = client.build_submission(
            **sub,
            duration=duration,
            command=None if duration is not None else ["<command>"],  # a real command: its end is not needed
            gpu_model=gpu_model,
            checkpoint_interval_s=every,
            now=from_us(now),
            producer="cli",
        )
    except ValidationError as exc:
        e = exc.errors(include_url=False)[0]
        msg = str(e["msg"]).removeprefix("Value error, ")
        fail(f"invalid submission: {'.'.join(str(p) for p in e['loc']) or 'job'}: {msg}")
    except ValueError as exc:
        fail(str(exc))
    state, rejected = with_submission(state, job, now, cfg)
    if rejected is not None:
        fail(f"it would be rejected: {rejected.reason.value}: {rejected.message}", 1)
    return state, list(job.job_ids)


def _forecastable(state: Any, job_id: str) -> None:
    """Exit 1 unless ``job_id`` is pending in ``state``, saying what it is instead (running since when...)."""
    from apportion.timeutil import from_us

    rec = state.jobs.get(job_id)
    if rec is not None and rec.status == "pending":
        return
    if rec is not None:
        run = state.cluster.runs.get((job_id, rec.attempt))
        since = run.started_at_us if run is not None else None
        when = f"since {from_us(since).isoformat()}" if since is not None else "placed, not yet started"
        fail(f"job {job_id!r} is {rec.status} (attempt {rec.attempt}, {when}): only pending jobs have a forecast", 1)
    if job_id in state.finished:
        fail(f"job {job_id!r} ended at {from_us(state.finished[job_id]).isoformat()}: nothing to forecast", 1)
    fail(f"job {job_id!r} is not in the log (or ended more than a window ago)", 1)


def forecast_table(fc: Any, width: int, *, detail: bool = False) -> Any:
    """The `apportion forecast` output of a :class:`apportion.forecast.Forecast`, for a terminal ``width`` wide.

    One row a job: job, budget, est. start (``MM-DD HH:MM`` UTC; the full time from :data:`QUEUE_WIDE`
    columns), in (from the forecast's time), basis, and the kind of the reason it waits now. ``detail``
    (one job): the reason's text and the chain follow the table, wrapped, uncut.
    """
    from rich import box
    from rich.console import Group
    from rich.text import Text

    from apportion.timeutil import from_us

    wide = width >= QUEUE_WIDE

    def start(j: Any) -> str:
        if j.start_us is None:
            return "-"
        iso = from_us(j.start_us).isoformat()
        return (iso[:19] if wide else iso[5:16]).replace("T", " ")

    def kind(j: Any) -> str:
        return str(j.reason_detail["kind"]) if j.reason_detail else ("placeable" if j.reason == "" else "")

    t = Table(
        title=f"forecast at {from_us(fc.now_us).isoformat()} ({len(fc.jobs)} pending job(s))",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        show_edge=False,
        collapse_padding=True,
    )
    t.add_column("job", no_wrap=True)
    t.add_column("budget", no_wrap=True)
    t.add_column("est. start (UTC)" if wide else "est. start", no_wrap=True)
    t.add_column("in", justify="right", no_wrap=True)
    t.add_column("basis", no_wrap=True)
    t.add_column("reason now", overflow="fold")
    for j in fc.jobs:
        wait = "-" if j.wait_s is None else format_duration(j.wait_s)
        t.add_row(j.job_id, j.budget, start(j), wait, j.basis, kind(j))
    lines: list[Text] = [Text(f"basis: {FORECAST_BASES}.")]
    if detail:
        for j in fc.jobs:
            if j.reason:
                lines.append(Text.assemble(("waits now: ", "bold"), j.reason))
            if j.note:
                lines.append(Text.assemble(("no start: ", "bold"), j.note))
            for c in j.chain:
                lines.append(Text(f"{from_us(c.at_us).isoformat()[:19].replace('T', ' ')}  {c.text}"))
    return Group(t, *lines)


def share_data(rc: Any) -> dict[str, Any]:
    """What `apportion share --json` prints: ``{"meta": usage meta, "budgets": [row, ...]}`` by path.

    The rows are accounting's ``apportion:rm:budgets`` (share, abs_share, occupancy_gpu_s, unallocated_gpu_s,
    entitlement_gpu_s, ratio, rank; GPU-seconds over the trailing window). Used by the CLI and the web dashboard.
    """
    from apportion import readmodel

    rows = readmodel.read_hash(rc, readmodel.budgets_key())
    meta = readmodel.read_hash(rc, readmodel.usage_key()).get("meta", {})
    return {"meta": meta, "budgets": list(rows.values())}


@app.command()
def share(
    redis_url: RedisUrl = None,
    forecast_: Annotated[
        str | None,
        typer.Option(
            "--forecast",
            help="Each budget's r and rank over the next days (e.g. 7d) as its window slides: running work ends as "
            "`apportion forecast` takes it, queued jobs start as the engine would start them, nothing new arrives.",
        ),
    ] = None,
    step: Annotated[str, typer.Option("--step", help="With --forecast: time between samples.")] = "1d",
    at: Annotated[str | None, typer.Option("--at", help="With --forecast: its start (default: the log's end).")] = None,
    bootstrap: Bootstrap = None,
    from_file: Annotated[
        Path | None,
        typer.Option("--from-file", help="With --forecast: read an export file.", exists=True, dir_okay=False),
    ] = None,
    as_json: JsonOut = False,
) -> None:
    """The budget tree with share, occupancy, unallocated use, entitlement, r and rank (like sshare).

    O, U and E are GPU-hours over the trailing window; r = O / E, lower is served first.

    With --forecast 7d: r/rank of every budget each --step from now (read from the log), and from when each leaf
    is behind enough to preempt another budget's runs once their protection ends (r lower by at least delta at
    their common ancestor, the other holding allocated GPUs).
    """
    if forecast_ is not None:
        _share_forecast(forecast_, step, at, bootstrap, from_file, as_json)
        return
    data = share_data(_redis(redis_url))
    meta, rows = data["meta"], {row["path"]: row for row in data["budgets"]}
    if as_json:
        _print_json(data)
        return
    if not rows:
        out.print("no occupancy snapshot yet (is the accounting service running?)")
        return
    t = Table(
        title=f"fair share at {meta.get('at', '?')} (window {format_duration(float(meta.get('window_s', 0)))}, "
        f"capacity {meta.get('capacity_gpus', '?')} GPUs)"
    )
    for col in ("budget", "share", "abs", "O GPU-h", "U GPU-h", "E GPU-h", "r", "rank"):
        t.add_column(col, justify="left" if col == "budget" else "right")
    for path, row in rows.items():
        depth = path.count("/")
        t.add_row(
            "  " * depth + path.rsplit("/", 1)[-1],
            f"{row.get('share', 0):.3f}",
            f"{row.get('abs_share', 0):.3f}",
            f"{row.get('occupancy_gpu_s', 0) / 3600:.1f}",
            f"{row.get('unallocated_gpu_s', 0) / 3600:.1f}",
            f"{row.get('entitlement_gpu_s', 0) / 3600:.1f}",
            _ratio(row.get("ratio")),
            "" if row.get("rank") is None else str(row["rank"]),
        )
    out.print(t)


def _share_forecast(
    span: str, step: str, at: str | None, bootstrap: str | None, from_file: Path | None, as_json: bool
) -> None:
    """``share --forecast``: :func:`apportion.forecast.budget_forecast` of the log, as a table or ``--json``."""
    from apportion.audit.replay import decoded
    from apportion.cli.audit import _dur
    from apportion.forecast import budget_forecast, user_history
    from apportion.timeutil import from_us

    days, step_s = _dur(span, "--forecast") / 86_400, _dur(step, "--step")
    if days <= 0 or step_s <= 0:
        fail("--forecast and --step must be longer than 0")
    recs, cfg, state, now = _forecast_input(bootstrap, from_file, at)
    fc = budget_forecast(state, now, cfg, days=days, step_s=step_s, history=user_history(decoded(recs)))
    if as_json:
        _print_json(fc.to_dict())
        return
    t = Table(
        title=f"r/rank from {from_us(now).isoformat()[:16]} UTC, every {format_duration(step_s)}",
        box=None,
        pad_edge=False,
    )
    t.add_column("budget")
    for i in range(len(fc.times)):
        t.add_column(f"+{format_duration(i * step_s)}" if i else "now", justify="right")
    t.add_column("can preempt from")
    for path, pts in fc.points.items():
        cells = [f"{_ratio(p.ratio)}" + ("" if p.rank is None else f"/{p.rank}") for p in pts]
        first = fc.first_preempting(path)
        when = "-" if first is None else f"{from_us(first.at_us).isoformat()[5:16].replace('T', ' ')}"
        t.add_row("  " * path.count("/") + path.rsplit("/", 1)[-1], *cells, when)
    out.print(t)


def _top_data(r: Any, head: int) -> dict[str, Any]:
    """One frame of `top`: usage meta, budget rows with job counts, the queue head, idle runs, nodes.

    ``idle_runs``: running jobs whose node agents report their GPUs idle past the nodes' ``idle_after_s``
    (the row's ``idle``), longest idle first."""
    from collections import Counter

    from apportion import readmodel

    budgets = readmodel.read_hash(r, readmodel.budgets_key())
    meta = readmodel.read_hash(r, readmodel.usage_key()).get("meta", {})
    jobs = list(readmodel.read_hash(r, readmodel.jobs_key()).values())
    nodes = list(readmodel.read_hash(r, readmodel.nodes_key()).values())
    counts: dict[str, Counter[str]] = {}
    for j in jobs:
        for p in _ancestors(str(j.get("budget", "?"))):
            counts.setdefault(p, Counter())[str(j.get("state", "?"))] += 1
    for path, row in budgets.items():
        c = counts.get(path, Counter())
        row["pending"], row["running"] = c.get("pending", 0), c.get("running", 0)
    pending = sorted(
        (j for j in jobs if j.get("state") == "pending"),
        key=lambda j: (j.get("position") if j.get("position") is not None else 1 << 30, j.get("job_id", "")),
    )
    idle = sorted(
        (j for j in jobs if j.get("state") == "running" and j.get("idle")),
        key=lambda j: (-float(j.get("idle_s") or 0.0), j.get("job_id", "")),
    )
    return {
        "meta": meta,
        "budgets": list(budgets.values()),
        "queue_head": pending[:head],
        "idle_runs": idle,
        "nodes": nodes,
    }


def _ancestors(path: str) -> list[str]:
    parts = path.split("/")
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


@app.command()
def top(
    interval: Annotated[float, typer.Option(help="Refresh period, wall seconds.")] = 1.0,
    iterations: Annotated[int, typer.Option(min=0, help="Stop after N refreshes (0 = until Ctrl-C).")] = 0,
    head: Annotated[int, typer.Option("--head", min=0, help="Pending jobs shown at the head of the queue.")] = 10,
    redis_url: RedisUrl = None,
    as_json: JsonOut = False,
) -> None:
    """Live view: the budget tree (share, occupancy, r, rank, jobs), the head of the queue with its pending
    reasons, the idle runs (GPUs idle past their nodes' idle_after_s, as the node agents report) and the
    nodes (those not ready with their state), refreshed until Ctrl-C. `--json`: one frame.

    When stdout is not a terminal (piped, redirected) it prints one frame and exits, or, with --iterations N,
    N frames one after the other."""
    import time as _time
    from collections import Counter

    from rich.console import Group
    from rich.live import Live

    r = _redis(redis_url)
    if as_json:
        _print_json(_top_data(r, head))
        return

    def frame() -> Group:
        d = _top_data(r, head)
        meta = d["meta"]
        bt = Table(title=f"budgets at {meta.get('at', '?')}  capacity {meta.get('capacity_gpus', '?')} GPUs")
        for col in ("budget", "share", "abs", "O GPU-h", "U GPU-h", "r", "rank", "pending", "running"):
            bt.add_column(col, justify="left" if col == "budget" else "right")
        for row in d["budgets"]:
            path = str(row.get("path", ""))
            bt.add_row(
                "  " * path.count("/") + path.rsplit("/", 1)[-1],
                f"{row.get('share', 0):.3f}",
                f"{row.get('abs_share', 0):.3f}",
                f"{row.get('occupancy_gpu_s', 0) / 3600:.1f}",
                f"{row.get('unallocated_gpu_s', 0) / 3600:.1f}",
                _ratio(row.get("ratio")),
                "" if row.get("rank") is None else str(row["rank"]),
                str(row["pending"] or ""),
                str(row["running"] or ""),
            )
        qt = Table(title=f"queue head ({len(d['queue_head'])} shown)")
        for col in ("pos", "job", "budget", "user", "GPUs", "reason"):
            qt.add_column(col)
        for j in d["queue_head"]:
            qt.add_row(
                "-" if j.get("position") is None else str(j["position"]),
                j.get("job_id", ""),
                j.get("budget", ""),
                j.get("user", ""),
                f"{j.get('replicas', 1)}x{j.get('gpus_per_replica', '?')}",
                j.get("reason", ""),
            )
        it = Table(title=f"idle runs ({len(d['idle_runs'])})")
        for col in ("job", "budget", "user", "GPUs", "idle", "nodes"):
            it.add_column(col)
        for j in d["idle_runs"]:
            it.add_row(
                j.get("job_id", ""),
                j.get("budget", ""),
                j.get("user", ""),
                f"{j.get('replicas', 1)}x{j.get('gpus_per_replica', '?')}",
                format_duration(float(j.get("idle_s") or 0.0)),
                ",".join(j.get("nodes") or []),
            )
        ns = d["nodes"]
        states = Counter(str(n.get("state", "?")) for n in ns)
        free = sum(int(n.get("free_gpus", 0)) for n in ns)
        total = sum(int(n.get("gpu_count", 0)) for n in ns)
        nt = Table(title=f"nodes: {', '.join(f'{k} {v}' for k, v in sorted(states.items()))}; GPUs free {free}/{total}")
        for col in ("node", "state", "free/GPUs", "running"):
            nt.add_column(col)
        for n in ns:
            if n.get("state") != "ready":
                nt.add_row(
                    n.get("node_id", ""),
                    n.get("state", ""),
                    f"{n.get('free_gpus', '?')}/{n.get('gpu_count', '?')}",
                    str(len(n.get("running") or [])),
                )
        return Group(bt, qt, *((it,) if d["idle_runs"] else ()), nt)

    if not out.is_terminal:  # a pipe: a live display would print nothing until Ctrl-C
        for i in range(max(iterations, 1)):
            if i:
                _time.sleep(interval)
            out.print(frame())
        return
    n = 0
    with Live(frame(), console=out, refresh_per_second=4, transient=False) as live:
        try:
            while iterations <= 0 or n < iterations:
                n += 1
                live.update(frame())
                if iterations <= 0 or n < iterations:
                    _time.sleep(interval)
        except KeyboardInterrupt:
            pass


@app.command()
def deadletter(
    topic: Annotated[str | None, typer.Option("--topic", help="Only letters from this source topic.")] = None,
    limit: Annotated[int, typer.Option("--limit", min=0, help="Show the newest N (0 = all).")] = 50,
    bootstrap: Bootstrap = None,
    as_json: JsonOut = False,
) -> None:
    """Dead letters: input a service could not decode or handle, with its topic, offset, key and reason."""
    from apportion import topics
    from apportion.bus.reader import read_log

    if topic is not None and topics.by_name(topic, topic_prefix()) is None:
        fail(f"--topic: no topic {topic!r}: use one of {', '.join(sorted(topics.BY_BASE))}")
    conn = _require_topics(bootstrap, topic_name(topics.DEADLETTER))
    recs = _checked(lambda: read_log(conn.bootstrap, [topic_name(topics.DEADLETTER)]))
    seen: set[Any] = set()
    rows: list[dict[str, Any]] = []
    for rec in recs:
        ev = rec.event
        if not isinstance(ev, events.DeadLetter) or ev.event_id in seen:
            continue
        seen.add(ev.event_id)
        if topic is not None and ev.source_topic not in (topic, topic_prefix() + topic):
            continue
        rows.append(
            {
                "ts": ev.ts.isoformat(),
                "producer": ev.producer,
                "topic": ev.source_topic,
                "partition": ev.source_partition,
                "offset": ev.source_offset,
                "key": ev.source_key,
                "error": ev.error,
            }
        )
    if limit:
        rows = rows[-limit:]
    if as_json:
        _print_json(rows)
        return
    t = Table(title=f"dead letters ({len(rows)})")
    for col in ("time", "by", "topic[partition]@offset", "key", "reason"):
        t.add_column(col)
    for r in rows:
        where = f"{r['topic']}[{r['partition'] if r['partition'] is not None else '?'}]@{r['offset']}"
        t.add_row(r["ts"][:19].replace("T", " "), r["producer"], where, str(r["key"] or "-"), r["error"])
    out.print(t)


# --------------------------------------------------------------------------- ops


def _node_notes(bootstrap: str) -> dict[str, dict[str, Any]]:
    """:func:`node_notes` of ``apportion.nodes`` at ``bootstrap`` (read once, heartbeats not decoded)."""
    from apportion import topics
    from apportion.bus.reader import iter_topic_records

    return node_notes(iter_topic_records(bootstrap, [topic_name(topics.NODES)], decode=False))


def node_notes(records: Iterable[Any]) -> dict[str, dict[str, Any]]:
    """Per node, from the records of ``apportion.nodes`` (``key``, ``raw``) in offset order: the last heartbeat's
    time and the reason of the last cordon/drain request (``reason``, ``by``); one pass, decoding only the events
    that are not heartbeats. A request the dispatcher refused (``NodeRequestRefused``: not signed by ops) changed
    nothing, so its reason is not shown."""
    from apportion.domain.admission import NODE_REQUEST_TYPES

    notes: dict[str, dict[str, Any]] = {}
    last_beat: dict[str, bytes] = {}
    changes: dict[str, list[Any]] = {}
    refused: set[Any] = set()
    for rec in records:
        if rec.key is None or rec.raw is None:
            continue  # a tombstone says nothing about a node
        if b'"NodeHeartbeat"' in rec.raw:
            last_beat[rec.key] = rec.raw
            continue
        try:
            ev = events.decode(rec.raw)
        except events.DecodeError:
            continue
        notes.setdefault(rec.key, {})
        if isinstance(ev, events.NodeRequestRefused):
            refused.add(ev.refused_event_id)
        elif isinstance(ev, (*NODE_REQUEST_TYPES, events.NodeLost)):
            changes.setdefault(rec.key, []).append(ev)
    for node, evs in changes.items():  # after the pass: a refusal follows the request it refuses
        n = notes[node]
        for ev in evs:
            if ev.event_id in refused:
                continue
            if isinstance(ev, (events.NodeCordoned, events.NodeDrainRequested)):
                n.update(reason=ev.reason, reason_by=ev.by, reason_at=ev.ts.isoformat())
            elif isinstance(ev, events.NodeUncordoned):
                n.update(reason="", reason_by=ev.by, reason_at=ev.ts.isoformat())
            else:
                n.update(reason=f"no heartbeat since {ev.last_heartbeat.isoformat()}")
    for node, raw in last_beat.items():
        try:
            notes.setdefault(node, {})["heartbeat_at"] = events.decode(raw).ts
        except events.DecodeError:
            continue
    return notes


def node_rows(rc: Any, bootstrap: str | None) -> list[dict[str, Any]]:
    """The rows `apportion nodes --json` prints: the dispatcher's ``apportion:rm:nodes`` rows with, from the log,
    the last heartbeat, its age in seconds on the stack's event clock (``heartbeat_age_s``) and the cordon/drain
    ``reason`` and ``reason_by`` of nodes not ready. Used by the CLI and the web dashboard.

    Exits (``typer.Exit`` 3) when Kafka at ``bootstrap`` cannot be reached or the namespace is not provisioned.
    """
    from apportion import readmodel, topics
    from apportion.settings import event_clock
    from apportion.timeutil import to_us

    rows = list(readmodel.read_hash(rc, readmodel.nodes_key()).values())
    conn = _require_topics(bootstrap, topic_name(topics.NODES))
    notes = _checked(lambda: _node_notes(conn.bootstrap))
    now_us = event_clock().now_us()
    for r in rows:
        n = notes.get(r.get("node_id", ""), {})
        beat = n.get("heartbeat_at")
        if beat is not None:
            r["last_heartbeat"] = beat.isoformat()
        r["heartbeat_age_s"] = (
            round((now_us - to_us(datetime.fromisoformat(r["last_heartbeat"]))) / 1e6, 1)
            if r.get("last_heartbeat")
            else None
        )
        r["reason"] = n.get("reason", "") if r.get("state") != "ready" else ""
        r["reason_by"] = n.get("reason_by", "") if r.get("state") != "ready" else ""
    return rows


@app.command()
def nodes(
    redis_url: RedisUrl = None,
    bootstrap: Bootstrap = None,
    as_json: JsonOut = False,
) -> None:
    """Nodes with state, cordon/drain reason, GPUs free/total, model, running jobs and heartbeat age.

    State and free GPUs are the dispatcher's; the reason and the last heartbeat come from the log
    (apportion.nodes); the age is measured on the stack's event clock (APPORTION_TIME_SCALE and epochs).
    """
    rows = node_rows(_redis(redis_url), bootstrap)
    if as_json:
        _print_json(rows)
        return
    t = Table(title=f"nodes ({len(rows)})")
    for col in ("node", "state", "reason", "model", "free/GPUs", "running", "heartbeat"):
        t.add_column(col)
    for r in rows:
        age = r.get("heartbeat_age_s")
        t.add_row(
            r.get("node_id", ""),
            r.get("state", ""),
            r.get("reason") or "",
            str(r.get("gpu_model") or "-"),
            f"{r.get('free_gpus', '?')}/{r.get('gpu_count', '?')}",
            str(len(r.get("running") or [])),
            "-" if age is None else f"{format_duration(max(0.0, round(age)))} ago",
        )
    out.print(t)


def _node_row(r: Any, node_id: str, bootstrap: str | None) -> dict[str, Any] | None:
    """The dispatcher's read-model row of ``node_id``; a node only the log knows yet gives a bare row."""
    from apportion import readmodel
    from apportion.cli import verdicts
    from apportion.topics import NODES

    row = readmodel.read_hash(r, readmodel.nodes_key()).get(node_id)
    if row is not None:
        return row
    conn = _require_topics(bootstrap, topic_name(NODES))
    evs = _checked(lambda: verdicts.key_events(conn.bootstrap, topic_name(NODES), node_id))
    if any(isinstance(e, events.NodeRegistered) for e in evs):
        return {"node_id": node_id, "state": "unknown"}
    return None


def _node_change(
    ev: NodeEvent,
    node_id: str,
    want: set[str],
    done: str,
    *,
    refused: str,
    already: set[str],
    no_wait: bool,
    timeout: float,
    bootstrap: str | None,
    redis_url: str | None,
    as_json: bool,
) -> None:
    """Check the node exists and is in a state the change applies to, publish, wait for the dispatcher's view.

    A state the node state machine would leave unchanged (:func:`apportion.domain.nodes.node_transition`: a lost
    node ignores everything but a registration) is refused with ``refused``; one of ``already`` is a success
    with nothing to publish.
    """
    from apportion import readmodel
    from apportion.cli import verdicts
    from apportion.domain.nodes import is_node_state, node_transition
    from apportion.topics import NODES

    r = _redis(redis_url)
    conn = _require_topics(bootstrap, topic_name(NODES))
    row = _node_row(r, node_id, bootstrap)
    if row is None:
        known = sorted(readmodel.read_hash(r, readmodel.nodes_key()))
        hint = f" (known: {', '.join(known[:8])}{', ...' if len(known) > 8 else ''})" if known else " (none known)"
        refuse(f"no node {node_id}{hint}", as_json=as_json, verdict="not_found", reason="no_node", node_id=node_id)
    state = str(row.get("state"))
    if is_node_state(state) and state not in already and node_transition(state, ev) == state:
        refuse(f"node {node_id} is {state}: {refused}", as_json=as_json, reason=state, node_id=node_id)
    if state in already:
        if as_json:
            _print_json({"ok": True, "published": [], "verdict": "unchanged", "state": state})
        else:
            out.print(f"node [bold]{node_id}[/] is already {state}: nothing to do")
        return
    _publish([ev], bootstrap)
    if no_wait:
        _published([ev], as_json, f"{type(ev).__name__} published for [bold]{node_id}[/] (not waiting)")
        return

    def shows() -> str | None:
        got = readmodel.read_hash(r, readmodel.nodes_key()).get(node_id, {}).get("state")
        return got if got in want else None

    seen = verdicts.wait_for(shows, timeout)
    if seen is None:  # refused (not signed by ops)? Read once: the node's partition holds all its heartbeats
        for no in _checked(lambda: verdicts.key_events(conn.bootstrap, topic_name(NODES), node_id)):
            if isinstance(no, events.NodeRequestRefused) and no.refused_event_id == ev.event_id:
                refuse(
                    f"the dispatcher refused {type(ev).__name__} of {node_id}: {no.reason.value}: {no.message}",
                    as_json=as_json,
                    verdict="rejected",
                    reason=no.reason.value,
                    node_id=node_id,
                )
    if as_json:
        _print_json(
            {"ok": seen is not None, "published": [events.to_dict(ev)], "verdict": seen or "no_verdict", "state": seen}
        )
    if seen is None:
        fail(
            f"the dispatcher did not show {node_id} as {'/'.join(sorted(want))} within {timeout:g} s "
            "(is it running?); the request is in the log",
            3,
        )
    if not as_json:
        out.print(done.format(node=node_id, state=seen))


@app.command()
def drain(
    node_id: Annotated[str, typer.Argument(help="Node to drain.")],
    reason: Annotated[str, typer.Option(help="Why (kept in the log, shown by `nodes`).")] = "maintenance",
    no_wait: NoWait = False,
    timeout: Timeout = DEFAULT_WAIT_S,
    bootstrap: Bootstrap = None,
    redis_url: RedisUrl = None,
    as_json: JsonOut = False,
) -> None:
    """Drain a node: cordon it, preempt unallocated work now, allocated work as its minimum runtime expires.

    Waits until the dispatcher shows the node draining (or drained). Exit 1 for
    a node nobody registered or a lost node.
    """
    ident = _identity(None, bootstrap, ops=True)
    ev = ident.sign(events.NodeDrainRequested(node_id=node_id, reason=reason, by=ident.user, ts=_now(), producer="cli"))
    _node_change(
        ev,
        node_id,
        {"draining", "drained"},
        "[bold]{node}[/] is {state}; it reports NodeDrained when empty (`apportion nodes`)",
        refused="no heartbeat, nothing to drain",
        already={"draining", "drained"},
        no_wait=no_wait,
        timeout=timeout,
        bootstrap=bootstrap,
        redis_url=redis_url,
        as_json=as_json,
    )


@app.command()
def cordon(
    node_id: Annotated[str, typer.Argument(help="Node to cordon.")],
    reason: Annotated[str, typer.Option(help="Why (kept in the log, shown by `nodes`).")] = "",
    no_wait: NoWait = False,
    timeout: Timeout = DEFAULT_WAIT_S,
    bootstrap: Bootstrap = None,
    redis_url: RedisUrl = None,
    as_json: JsonOut = False,
) -> None:
    """Cordon a node: no new work lands on it; running work stays. Exit 1 for an unknown or lost node."""
    ident = _identity(None, bootstrap, ops=True)
    ev = ident.sign(events.NodeCordoned(node_id=node_id, reason=reason, by=ident.user, ts=_now(), producer="cli"))
    _node_change(
        ev,
        node_id,
        {"cordoned"},
        "cordoned [bold]{node}[/]",
        refused="no heartbeat, nothing to cordon",
        already={"cordoned"},
        no_wait=no_wait,
        timeout=timeout,
        bootstrap=bootstrap,
        redis_url=redis_url,
        as_json=as_json,
    )


@app.command()
def undrain(
    node_id: Annotated[str, typer.Argument(help="Node to return to service.")],
    no_wait: NoWait = False,
    timeout: Timeout = DEFAULT_WAIT_S,
    bootstrap: Bootstrap = None,
    redis_url: RedisUrl = None,
    as_json: JsonOut = False,
) -> None:
    """Uncordon a cordoned, draining or drained node. Exit 1 for an unknown or lost node; 0 if already ready."""
    ident = _identity(None, bootstrap, ops=True)
    ev = ident.sign(events.NodeUncordoned(node_id=node_id, by=ident.user, ts=_now(), producer="cli"))
    _node_change(
        ev,
        node_id,
        {"ready"},
        "[bold]{node}[/] is ready",
        refused="no heartbeat; it returns when its agent registers again",
        already={"ready"},
        no_wait=no_wait,
        timeout=timeout,
        bootstrap=bootstrap,
        redis_url=redis_url,
        as_json=as_json,
    )


@app.command("schemas")
def schemas_(
    type_name: Annotated[
        str | None, typer.Argument(metavar="[TYPE]", help="An event type, e.g. JobSubmitted; none: list them.")
    ] = None,
) -> None:
    """The JSON Schema a producer in another language validates against (the file ``schemas/TYPE.json``), or
    every event type with its topic and record key (docs/producing.md)."""
    from apportion.schemas_export import render

    files = render()
    if type_name is None:
        t = Table(title="event types (apportion schemas TYPE prints one)")
        for col in ("type", "topic", "record key"):
            t.add_column(col)
        for name in sorted(events.EVENT_TYPES):
            topic = events.TOPIC_OF[name]
            t.add_row(name, topic.base, topic.key)
        out.print(t)
        return
    text = files.get(f"{type_name}.json")
    if text is None:
        fail(f"no event type {type_name!r} (apportion schemas lists them)")
    sys.stdout.write(text)


# --------------------------------------------------------------------------- budgets


def parse_members(text: str) -> tuple[str, ...]:
    """``--members alice,bob`` as a tuple of user names; exit 2 for an empty list or a name with spaces.

    An empty list would let nobody charge the budget (``--inherit-members`` drops the budget's own list).
    """
    names = tuple(m.strip() for m in text.split(","))
    if not any(names):
        fail("--members: give at least one user (comma-separated), or --inherit-members to inherit the parent's")
    bad = [m for m in names if not m or any(c.isspace() for c in m)]
    if bad:
        fail(f"--members: {', '.join(repr(m) for m in bad)} is not a user name (comma-separated names, no spaces)")
    return names


def _tree_in_force(bootstrap: str | None) -> Any:
    """The budget tree the log defines (:func:`apportion.domain.budgets.fold_budget_log`, the rule every reader
    applies: accepted changes in log order, skipping those the policy rejected); exit 3 when Kafka is unreachable."""
    from apportion import topics
    from apportion.bus.reader import read_log
    from apportion.domain.budgets import fold_budget_log

    conn = _require_topics(bootstrap, topic_name(topics.BUDGETS))
    try:
        recs = read_log(conn.bootstrap, [topic_name(topics.BUDGETS)])
    except Exception as exc:
        if type(exc).__module__.startswith("kafka"):
            fail(f"cannot read Kafka at {conn.bootstrap}: {exc}", 3)
        raise
    return fold_budget_log(rec.event for rec in recs if rec.event is not None)


def _limit_option(text: str | None, current: float | None) -> float | None:
    """A budget duration from ``--default-time-limit``, ``--max-time-limit`` or ``--preempt-idle-after``: ``None``
    keeps ``current``, ``inherit`` drops the budget's own, else a duration (``ValueError`` when it is not one)."""
    if text is None:
        return current
    if text.strip().lower() == "inherit":
        return None
    return parse_duration(text)


@budget_app.command("set")
def budget_set(
    path: Annotated[str, typer.Argument(help="Budget path, e.g. lab/prior/robotics.")],
    share_: Annotated[
        float | None,
        typer.Option("--share", "-s", help="Fraction of the parent's capacity, in (0, 1]. Required for a new budget."),
    ] = None,
    members: Annotated[
        str | None,
        typer.Option(help="Comma-separated users allowed to charge it (default: keep the current list)."),
    ] = None,
    max_min_runtime: Annotated[
        str | None, typer.Option(help="Largest minimum runtime allowed, e.g. 8h (default: keep the current limit).")
    ] = None,
    inherit_members: Annotated[
        bool, typer.Option("--inherit-members", help="Drop this budget's own members list (inherit the parent's).")
    ] = False,
    inherit_max_min_runtime: Annotated[
        bool,
        typer.Option("--inherit-max-min-runtime", help="Drop this budget's own limit (inherit the parent's)."),
    ] = False,
    default_time_limit: Annotated[
        str | None,
        typer.Option(
            "--default-time-limit",
            help="Time limit of its jobs that give none, e.g. 24h; 'inherit' drops it (default: keep the current).",
        ),
    ] = None,
    max_time_limit: Annotated[
        str | None,
        typer.Option(
            "--max-time-limit",
            help="Largest time limit a job may have (its own or the default), e.g. 7d; 'inherit' drops it "
            "(default: keep the current).",
        ),
    ] = None,
    preempt_idle_after: Annotated[
        str | None,
        typer.Option(
            "--preempt-idle-after",
            help="Preempt its allocated runs whose protection has ended once their GPUs have been idle this long "
            "(as the node agents report), for any waiting job that fits, e.g. 2h; 'inherit' drops it "
            "(default: keep the current; none set: never).",
        ),
    ] = None,
    no_wait: NoWait = False,
    timeout: Timeout = DEFAULT_WAIT_S,
    bootstrap: Bootstrap = None,
    redis_url: RedisUrl = None,
    as_json: JsonOut = False,
) -> None:
    """Create a budget, or change only the fields given of an existing one.

    Fields not given keep their values in the tree in force; use
    ``--inherit-members`` / ``--inherit-max-min-runtime`` to drop a budget's own
    setting. The change is checked against the tree in force first (exit 1,
    e.g. siblings summing above 1), then published, then the policy's verdict
    is awaited (exit 1 when it rejects, 3 when it does not answer).
    """
    from pydantic import ValidationError

    from apportion.domain.budgets import BudgetError, parent_of, validate_path, validate_share

    if members is not None and inherit_members:
        fail("give --members or --inherit-members, not both")
    if max_min_runtime is not None and inherit_max_min_runtime:
        fail("give --max-min-runtime or --inherit-max-min-runtime, not both")
    member_list = parse_members(members) if members is not None else None
    try:
        validate_path(path)
        if share_ is not None:
            validate_share(path, share_)
    except BudgetError as exc:
        fail(f"--share: {exc.message}" if exc.reason == "bad_share" else exc.message)
    tree = _tree_in_force(bootstrap)
    current = tree.get(path)
    if current is None and share_ is None:
        refuse(
            f"budget {path} does not exist: give --share to create it",
            as_json=as_json,
            verdict="not_found",
            reason="no_budget",
            code=2,
            path=path,
        )
    try:
        ev = events.BudgetSet(
            path=path,
            share=share_ if share_ is not None else current.share,
            members=(
                None
                if inherit_members
                else member_list
                if member_list is not None
                else (tuple(sorted(current.members)) if current is not None and current.members is not None else None)
            ),
            max_min_runtime_s=(
                None
                if inherit_max_min_runtime
                else parse_duration(max_min_runtime)
                if max_min_runtime is not None
                else (current.max_min_runtime_s if current is not None else None)
            ),
            default_time_limit_s=_limit_option(
                default_time_limit, current.default_time_limit_s if current is not None else None
            ),
            max_time_limit_s=_limit_option(max_time_limit, current.max_time_limit_s if current is not None else None),
            preempt_idle_after_s=_limit_option(
                preempt_idle_after, current.preempt_idle_after_s if current is not None else None
            ),
            by="cli",
            ts=_now(),
            producer="cli",
        )
    except ValidationError as exc:
        e = exc.errors(include_url=False)[0]
        fail(f"invalid budget: {'.'.join(str(p) for p in e['loc'])}: {e['msg']}")
    except ValueError as exc:
        fail(str(exc))
    try:
        after = tree.apply(ev)
    except BudgetError as exc:
        refuse(f"refused: {exc.reason}: {exc.message}", as_json=as_json, reason=exc.reason, path=path)
    above = after.max_min_runtime_s(parent_of(path)) if parent_of(path) else None
    if ev.max_min_runtime_s is not None and above is not None and ev.max_min_runtime_s > above:
        err.print(  # a limit is inherited, not capped: say what the change means rather than hide it
            f"note: {path}'s max min runtime {format_duration(ev.max_min_runtime_s)} is above its parent "
            f"{parent_of(path)}'s effective {format_duration(above)}: it overrides the parent's for {path} and below",
            highlight=False,
            soft_wrap=True,
        )
    _budget_changes(
        [ev],
        no_wait,
        timeout,
        bootstrap,
        redis_url,
        as_json,
        f"budget [bold]{path}[/] set to share {ev.share}",
        read_model=after != tree,  # a change to the same values: the read model has nothing to fold
    )


def _budget_changes(
    evts: list[Any],
    no_wait: bool,
    timeout: float,
    bootstrap: str | None,
    redis_url: str | None,
    as_json: bool,
    message: str,
    *,
    read_model: bool = True,
) -> None:
    """Publish budget changes (in order) and report the policy's verdict on each; exit 1 if any was rejected.

    Once the policy accepted them, wait (within the same ``timeout``) until the accounting read model has
    folded them too, so a ``share`` right after shows the change (a removed budget is gone); when it does not
    in time, the change still happened: a note says so on stderr, exit 0. ``read_model=False`` skips that wait
    (the caller knows the tree does not change, so the read model has nothing to fold).
    """
    from apportion import client
    from apportion.cli import verdicts
    from apportion.topics import BUDGETS

    end = time.monotonic() + timeout
    conn = _require_topics(bootstrap, topic_name(BUDGETS))
    try:
        offsets = client.publish(*evts, bootstrap=conn.bootstrap)
    except Exception as exc:
        if verdicts.is_kafka_error(exc):
            fail(f"cannot publish to Kafka at {conn.bootstrap}: {exc} (is the stack up?)", 3)
        raise
    if no_wait:
        _published(evts, as_json, message + " (not waiting for the policy's verdict)")
        return
    got = _checked(lambda: verdicts.budget_verdicts(conn.bootstrap, list(zip(evts, offsets, strict=True)), timeout))
    rejected = [v for v in got if v.state == "rejected"]
    folded = None
    if read_model and not rejected and all(v.state == "accepted" for v in got):
        folded = _await_read_model(redis_url, max(offsets), end - time.monotonic())
    if as_json:
        silent = any(v.state == "no_verdict" for v in got)
        _print_json(
            {
                "ok": not rejected and not silent,
                "verdict": "rejected" if rejected else "no_verdict" if silent else "accepted",
                "reason": rejected[0].reason if rejected else "",
                "published": [events.to_dict(e) for e in evts],
                "verdicts": [v.to_dict() for v in got],
                "read_model": folded,
            }
        )
    if rejected:
        v = rejected[0]
        more = f" (and {len(rejected) - 1} more)" if len(rejected) > 1 else ""
        what = v.message if v.failures else f"{v.event.path}: {v.reason}: {v.message}"  # a batch's names each path
        fail(f"refused by the policy: {what}{more}", 1)
    if any(v.state == "no_verdict" for v in got):
        fail(f"no verdict from the policy within {timeout:g} s (is it running?); the change is in the log", 3)
    if not as_json:
        out.print(message, soft_wrap=True)
    if folded is False:
        err.print(
            "note: the accounting read model (`share`) has not folded the change yet (is accounting running?)",
            highlight=False,
        )


def _await_read_model(redis_url: str | None, offset: int, timeout_s: float) -> bool:
    """Poll (within ``timeout_s``, at least once) until the accounting read model has folded the budgets log
    past ``offset`` (:func:`apportion.cli.verdicts.read_model_folded`); False when it did not, or Redis does not
    answer."""
    import redis

    from apportion.bus.security import redis_auth
    from apportion.cli import verdicts

    try:
        url = Connection.resolve(redis_url=redis_url).redis_url
        r = redis.Redis.from_url(url, socket_connect_timeout=3, **redis_auth(url))
        return bool(verdicts.wait_for(lambda: verdicts.read_model_folded(r, offset), max(timeout_s, 0.0)))
    except redis.RedisError:
        return False


@budget_app.command("apply")
def budget_apply(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="YAML file of budgets.")],
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the diff against the tree in force; publish nothing.")
    ] = False,
    prune: Annotated[
        bool,
        typer.Option("--prune", help="The file is the whole tree: remove budgets in force that it does not name."),
    ] = False,
    no_wait: NoWait = False,
    timeout: Timeout = DEFAULT_WAIT_S,
    bootstrap: Bootstrap = None,
    redis_url: RedisUrl = None,
    as_json: JsonOut = False,
) -> None:
    """Set every budget in a YAML file, all or nothing, as one change (a ``BudgetBatch``).

    The policy validates the tree after the whole batch, so moving share from one sibling to another is one
    valid change, and an invalid file changes nothing (every failing path is named). Without ``--prune`` the
    file may be partial: budgets in force that it does not name are kept (and count in their siblings' sums),
    and a budget's parent may be one in force. With ``--prune`` the file is the whole tree: budgets in force
    that it does not name are removed in the same batch (refused while one has queued or running jobs).
    The batch is checked against the tree in force before publishing (exit 1).
    """
    from apportion import readmodel
    from apportion.budgetfile import BudgetFileError, load_budgets
    from apportion.cli import verdicts
    from apportion.domain.budgets import BudgetError

    try:
        wanted = load_budgets(file)
    except BudgetFileError as exc:
        fail(str(exc))
    current = _tree_in_force(bootstrap)
    diff = verdicts.budget_diff(current, wanted, prune)
    in_use: frozenset[str] = frozenset()
    if prune and any(c.kind == "pruned" for c in diff):  # a dry run too: it says what would be refused
        jobs = readmodel.read_hash(_redis(redis_url), readmodel.jobs_key()).values()
        in_use = frozenset(str(j.get("budget")) for j in jobs)
    try:
        batch = verdicts.batch_of(current, wanted, prune, _now())
        if batch is not None and in_use:
            current.apply(batch, in_use=in_use)
    except BudgetError as exc:
        if dry_run and not as_json:
            _print_diff(diff)
        dry: dict[str, Any] = {"diff": [c.to_dict() for c in diff], "published": []} if dry_run else {}
        refuse(
            f"refused: {file} against the tree in force: {exc.message}"
            + (" (dry run: nothing published)" if dry_run else ""),
            as_json=as_json,
            reason=exc.reason,
            file=str(file),
            **dry,
        )
    n = len(batch.paths) if batch is not None else 0
    if dry_run or batch is None:
        if as_json:
            _print_json({"ok": True, "diff": [c.to_dict() for c in diff], "changes": n, "published": []})
            return
        _print_diff(diff)
        out.print(f"{n} budget change(s){' (dry run: nothing published)' if dry_run else ': nothing to do'}")
        return
    _budget_changes(
        [batch], no_wait, timeout, bootstrap, redis_url, as_json, f"applied {file}: {n} budget change(s) in one batch"
    )


def _print_diff(diff: list[Any]) -> None:
    def show(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, list):
            return ",".join(v) or "(none)"
        return f"{v:g}" if isinstance(v, float) else str(v)

    if not [c for c in diff if c.kind != "kept"]:
        out.print("no differences from the tree in force")
    for c in diff:
        if c.kind == "kept":
            out.print(f"  = {c.path}: in force, not in the file (kept)", highlight=False)
        elif c.kind == "pruned":
            out.print(f"  - {c.path}: in force, not in the file (removed: --prune)", highlight=False)
        else:
            sign = {"added": "+", "changed": "~", "removed": "-"}[c.kind]
            out.print(f"  {sign} {c.path} {c.field}: {show(c.old)} -> {show(c.new)}", highlight=False)


@budget_app.command("rm")
def budget_rm(
    path: Annotated[str, typer.Argument(help="Budget path to remove (children first).")],
    no_wait: NoWait = False,
    timeout: Timeout = DEFAULT_WAIT_S,
    bootstrap: Bootstrap = None,
    redis_url: RedisUrl = None,
    as_json: JsonOut = False,
) -> None:
    """Remove a budget. Refused (exit 1) when it is not in the tree in force, has children, or has queued or
    running jobs (the dispatcher's jobs read model)."""
    from apportion import readmodel
    from apportion.domain.budgets import BudgetError

    tree = _tree_in_force(bootstrap)
    jobs = readmodel.read_hash(_redis(redis_url), readmodel.jobs_key()).values()
    in_use = [j for j in jobs if j.get("budget") == path]
    ev = events.BudgetRemoved(path=path, by="cli", ts=_now(), producer="cli")
    try:
        tree.apply(ev, in_use=frozenset({path}) if in_use else frozenset())
    except BudgetError as exc:
        msg = exc.message
        if exc.reason == "in_use":
            states: dict[str, int] = {}
            for j in in_use:
                states[str(j.get("state"))] = states.get(str(j.get("state")), 0) + 1
            msg = f"{path!r} has {', '.join(f'{n} {s}' for s, n in sorted(states.items()))} job(s)"
        refuse(f"refused: {exc.reason}: {msg}", as_json=as_json, reason=exc.reason, path=path)
    _budget_changes([ev], no_wait, timeout, bootstrap, redis_url, as_json, f"removed budget [bold]{path}[/]")


@budget_app.command("show")
def budget_show(
    bootstrap: Bootstrap = None,
    from_file: Annotated[
        Path | None, typer.Option("--from-file", help="Read a YAML budget file instead of the log.")
    ] = None,
    as_json: JsonOut = False,
) -> None:
    """The budget tree as the log defines it (fold of accepted BudgetSet/BudgetRemoved), with absolute shares."""
    tree = _tree_from_file(from_file) if from_file is not None else _tree_in_force(bootstrap)
    rows = [
        {
            "path": p,
            "share": tree.share(p),
            "abs_share": tree.abs_share(p),
            "members": sorted(tree.members(p)) if tree.members(p) is not None else None,
            "max_min_runtime_s": tree.max_min_runtime_s(p),
            "leaf": tree.is_leaf(p),
        }
        for p in tree.paths()
    ]
    if as_json:
        _print_json(rows)
        return
    t = Table(title=f"budget tree ({len(rows)} budgets)")
    for col in ("budget", "share", "abs", "members", "max min runtime"):
        t.add_column(col)
    for row in rows:
        t.add_row(
            "  " * row["path"].count("/") + row["path"].rsplit("/", 1)[-1],
            f"{row['share']:.3f}",
            f"{row['abs_share']:.4f}",
            ",".join(row["members"]) if row["members"] else "(any)",
            format_duration(row["max_min_runtime_s"]) if row["max_min_runtime_s"] is not None else "-",
        )
    out.print(t)


def _register_optional() -> None:
    """Attach sub-apps that live in their own modules."""
    import importlib

    for mod, name in (
        ("apportion.cli.simulate", "simulate"),
        ("apportion.cli.audit", "audit"),
        ("apportion.cli.stack", "stack"),
        ("apportion.cli.history", "history"),
        ("apportion.cli.keys", "keys"),
    ):
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            if exc.name != mod:
                raise
            continue
        register = getattr(m, "register", None)
        if register is not None:
            register(app)
        elif name == "simulate":  # one command, not a group: `apportion simulate --trace ...`
            app.command(name, help=m.app.info.help)(m.simulate)
        else:
            app.add_typer(m.app, name=name)


_register_optional()


@app.callback()
def _root(ctx: typer.Context) -> None:
    """Budgeted, hierarchical fair-share GPU scheduling."""
    import os

    from apportion.settings import apply_stack_prefix

    if apply_stack_prefix() is not None:  # the namespace of the stack found: for this command only
        ctx.call_on_close(lambda: os.environ.pop("APPORTION_TOPIC_PREFIX", None))


def main() -> None:
    """Console entry point."""
    app()


if __name__ == "__main__":
    main()
