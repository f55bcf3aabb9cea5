"""Job commands: ``submit``, ``cancel``, ``hold``, ``release``, ``queue``, ``forecast`` (researchers)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from apportion.cli.common import (
    DEFAULT_WAIT_S,
    Bootstrap,
    Column,
    JsonOut,
    NoWait,
    RedisUrl,
    RequestReason,
    RequestUser,
    Timeout,
    _checked,
    _identity,
    _now,
    _print_json,
    _publish,
    _published,
    _redis,
    _require_topics,
    check_budget_filter,
    fail,
    fitted_table,
    left_out,
    out,
    printable,
    refuse,
    report_verdict,
)
from apportion.cli.lazyimport import lazy_module
from apportion.durations import format_duration, parse_duration
from apportion.settings import topic_name

if TYPE_CHECKING:
    from apportion import events
    from apportion.identity.keys import Identity
else:
    events = lazy_module("apportion.events")  # imported by the commands that use it, not by their --help


# --------------------------------------------------------------------------- researchers


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
    topology: Annotated[
        str | None,
        typer.Option(
            "--topology",
            help="block or rack: every replica within one block (rack) of the network; a gang that no "
            "registered block (rack) can hold is rejected (unsatisfiable_topology).",
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

    A simulated gang of 4 replicas of 8 GPUs; unallocated work; an array of 100 jobs, 8 at a time:

      apportion submit -b lab/vision -g 8 -k 4 -m 4h --duration 6h
      apportion submit -b lab/vision -g 1 -m 0 -- python sweep.py
      apportion submit -b lab/vision -g 1 -m 30m --array 0-99%8 -- python sweep.py

    Unallocated work (-m 0) charges nothing: any user may run it under any leaf budget, member or not.

    Its GPU-hours show as the budget's U, never in its r (docs/security.md).
    """

    from rich.markup import escape

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
                topology_bound=topology,
            )
        except client.InvalidSubmission as exc:
            fail(exc.message if exc.field == "job_id" else submission_error(exc.field, exc.message))
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
    if as_json and (dry_run or wait <= 0):
        _print_json(events.to_dict(ev))
    elif not as_json and not isinstance(verdict, events.JobRejected):  # a rejected job was not submitted: say only that
        kind = "allocated" if ev.allocated else "unallocated"
        spec = ev.array_spec
        if spec is not None:
            most = f", at most {spec.throttle} running" if spec.throttle is not None else ""
            kind += f"; array of {len(spec.indices)}: {ev.job_ids[0]} .. {ev.job_ids[-1]}{most}"
        out.print(
            f"{'validated' if dry_run else 'submitted'} [bold]{escape(ev.job_id)}[/] "
            f"({ev.replicas}x{ev.gpus_per_replica} GPUs, {kind}, budget {ev.budget})"
        )
        if isinstance(verdict, events.JobQueued):
            out.print(queued_message(ev.job_id, ev.hold), soft_wrap=True)
    if not dry_run and wait > 0:
        report_verdict(*dispatcher_verdict(ev, verdict, "queued", "rejected", wait, "submission"), as_json=as_json)


#: A submission's field -> the ``submit`` option that sets it, for errors in the user's own words.
SUBMIT_OPTIONS = {
    "budget": "--budget",
    "gpus_per_replica": "--gpus",
    "replicas": "--replicas",
    "min_runtime_s": "--min-runtime",
    "duration_s": "--duration",
    "gpu_model": "--gpu-model",
    "checkpoint_interval_s": "--checkpoint-interval",
    "time_limit_s": "--time",
    "array": "--array",
    "topology_bound": "--topology",
    "env": "--env",
    "command": "the command (after --)",
}


def submission_error(field: str, message: str) -> str:
    """``invalid submission: <option>: <message>`` with the submission's field names said as ``submit``'s options
    (``time_limit_s`` -> ``--time``), in the field and, for the names with an underscore, in the message
    (``... or duration_s`` -> ``or --duration``)."""
    for name, option in SUBMIT_OPTIONS.items():
        if "_" not in name:  # a plain word (command, budget) reads as itself in a message
            continue
        message = re.sub(rf"\b{name}\b", option, message)
    where = SUBMIT_OPTIONS.get(field, field)
    return f"invalid submission: {message}" if field == "job" else f"invalid submission: {where}: {message}"


def queued_message(job_id: str, hold: bool) -> str:
    """What ``submit`` says once the dispatcher queued ``job_id``: held or not, and what places a held job (one line
    within 80 columns for a generated id, printed unwrapped so that the command stays whole to copy)."""
    if hold:
        return f"queued, held until `apportion release {job_id}`"
    return "queued by the dispatcher (see `apportion queue`)"


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

    Examples:

      apportion cancel j-42
      apportion cancel sweep             (every element of job array sweep)
      apportion cancel j-42 -u ops --reason "wrong data"   (ops: any user's job)
    """
    _job_request(events.JobCancelRequested, job_id, reason, user, no_wait, timeout, bootstrap, as_json)


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

    Examples:

      apportion hold j-42 --reason "waiting for data"
      apportion hold sweep               (every pending element of an array)
    """
    _job_request(events.JobHoldRequested, job_id, reason, user, no_wait, timeout, bootstrap, as_json)


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

    Examples:

      apportion release j-42
      apportion release sweep            (every held element of an array)
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
    from rich.markup import escape

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
        _published([ev], as_json, f"{verb} requested for [bold]{escape(job_id)}[/] (not waiting for the dispatcher)")
        return
    verdict = watcher.wait(timeout, request_id=ev.event_id)
    doc, error, code = dispatcher_verdict(ev, verdict, done_word, "refused", timeout, "request")
    n = events.array_elements_of(verdict, reason)  # the count of an array's elements it applied to; None: a job
    report_verdict({**doc, "array_elements": n}, error, code, as_json=as_json)
    if not as_json:
        out.print(f"{done_word} [bold]{escape(job_id)}[/]{array_phrase(n)}")


def array_phrase(n: int | None) -> str:
    """`` (array: N elements)`` (``element`` for one) after the job id of a request's answer that applied to ``n``
    elements of a job array; nothing for a job's answer (``None``)."""
    return "" if n is None else f" (array: {n} element{'s' if n != 1 else ''})"


def dispatcher_verdict(
    published: events.Event, verdict: events.Event | None, done_word: str, refused_word: str, timeout: float, what: str
) -> tuple[dict[str, Any], str | None, int]:
    """The dispatcher's answer to a submission or a request on a job, as :func:`~apportion.cli.common.report_verdict`
    takes it: the ``--json`` object (``ok``, ``published``, ``verdict``: ``done_word``, ``refused_word`` for a
    ``JobRejected``, or ``no_verdict``; ``reason``, ``event``, ``job_id``), the error line (``None`` when done) and
    the exit code (1 refused, 3 no verdict within ``timeout`` seconds)."""
    rejected = verdict if isinstance(verdict, events.JobRejected) else None
    doc: dict[str, Any] = {
        "ok": verdict is not None and rejected is None,
        "published": [events.to_dict(published)],
        "verdict": refused_word if rejected else done_word if verdict is not None else "no_verdict",
        "reason": rejected.reason.value if rejected else "",
        "event": events.to_dict(verdict) if verdict is not None else None,
        "job_id": getattr(published, "job_id", None),
    }
    if rejected is not None:
        return doc, f"{refused_word}: {rejected.reason.value}: {rejected.message}", 1
    if verdict is None:
        return doc, f"no verdict from the dispatcher within {timeout:g} s (is it running?); the {what} is in the log", 3
    return doc, None, 0


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

    Running jobs first, then pending ones by ``position`` (their place in the order a cycle walks: allocated
    jobs in fair-share order, then unallocated ones), then by
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
    ``MM-DD HH:MM`` (UTC); when a row still does not fit, the budget, then the user, then the start and the basis
    leave the table too (no cell is ever cut); each job's columns left out and its nodes or pending reason follow
    the table on a line of their own (``job: budget B; reason``), wrapped at word boundaries, uncut, a running job's with how long its GPUs have been idle when its node
    agents report it. A run whose GPUs stay idle past its nodes' ``idle_after_s`` (the row's ``idle``) shows
    ``IDLE`` in place of ``running`` in the narrow table and in the idle column of the wide one. A running
    job's protection notice (the row's ``protection``) follows its nodes. Rows with a forecast (``queue
    --start``: ``est_start``, ``est_basis``) show a pending job's estimated start in the start column, marked
    ``~``, and its basis in a column of its own.
    ``--json`` has every field.
    """
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
        if not at and r.get("est_after"):  # not started within the forecast's horizon: after it
            at, mark = r["est_after"], ">"
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
    shown = [(title, opts, cell) for title, opts, cell, narrow in columns if wide or narrow]
    t, moved = fitted_table(
        f"queue ({len(rows)} jobs)",
        shown,
        rows,
        width,
        () if wide else ("budget", "user", "started", "basis"),
    )
    lines: list[Text] = []
    for r in rows:
        d = "" if wide else printable(where(r))
        parts = [x for x in (", ".join(left_out(shown, moved, r)), d) if x]
        if parts:
            lines.append(Text.assemble((printable(text(r, "job_id")), "bold"), ": ", "; ".join(parts)))
    head = ", ".join([*moved, "nodes (running) / reason (pending)"])
    return Group(t, *((Text(f"{head}, UTC times:"), *lines) if lines else ()))


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

    The position is the place in the order a scheduling cycle walks now (pending jobs only; `-` for running
    ones): every allocated job in fair-share order, then the unallocated ones, which go only on GPUs left free. The pending reason comes from the engine's own cycle (`kind: facts`; kinds
    budget_ahead, reserved_by, protected_until, no_node_shape, no_free_gpus, budget_unknown, patience,
    checkpoint_soon, placeable; from the dispatcher: refused_backoff, for a job whose start a node refused, and
    held, for a job held until `apportion release`, and array_limit, for an element of a job array beyond
    its `%N`);
    `--json` rows also carry `reason_detail`, the reason's fields.

    A running job shows what its protection promises: protected until T (preemptible after), or preemptible since.

    With --start, each pending job gets its estimated start (est_start, est_basis in --json): the log read and the
    engine run forward as `apportion forecast` does (basis: now, rules, simulated, time_limit, history, unknown).

    Examples:

      apportion queue -u alice
      apportion queue -b lab/vision --state pending
      apportion queue --all --json
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
    fc = run_forecast(state, now, cfg, job_ids=wanted, history=user_history(decoded(recs)), chains_out=False)
    return with_starts(rows, fc)


#: The `apportion forecast` basis column's values and what each means, for its footer (one a line), as
#: :mod:`apportion.forecast` takes them.
FORECAST_BASES = (
    ("now", "starts at once"),
    ("rules", "only protection and grace ends delay it (exact)"),
    ("simulated", "runs end at their declared work"),
    ("time_limit", "at their time limit"),
    ("history", "at their user's median run time"),
    ("unknown", "assumed to run W/4"),
    ("recent_waits", "unallocated: later of it and recent waits of its size"),
)


def forecast(
    job_id: Annotated[str | None, typer.Argument(help="One pending job (default: every pending job).")] = None,
    budget: Annotated[str | None, typer.Option("--budget", "-b", help="Only this budget (and below).")] = None,
    user: Annotated[str | None, typer.Option("--user", "-u", help="Only this user's jobs.")] = None,
    at: Annotated[
        str | None, typer.Option("--at", help="Event time of the forecast (ISO). Default: the log's latest event.")
    ] = None,
    horizon: Annotated[
        str,
        typer.Option("--horizon", help="How far ahead to look (e.g. 7d, 36h); a job not started by then: after it."),
    ] = "7d",
    spacing: Annotated[
        float,
        typer.Option(
            "--spacing",
            help="Space the forward run's cycles by this fraction of how far ahead they are (0 to 1; 0: a cycle at "
            "every run end, the exact run). A start moves by at most this fraction of its wait per cycle.",
        ),
    ] = 0.02,
    min_gap: Annotated[
        float,
        typer.Option(
            "--min-gap",
            help="The forward run's resolution: no two cycles closer than this many seconds of event time (0: no "
            "least gap). Run ends inside a gap wait for its end, so a start moves by up to a gap per cycle.",
        ),
    ] = 30.0,
    with_recent_waits: Annotated[
        bool,
        typer.Option(
            "--recent-waits",
            help="An unallocated job the forward run does not start at once gets the later of that start and the "
            "recent median wait of unallocated jobs of its size (basis recent_waits).",
        ),
    ] = False,
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
            help="Assume the next day's submissions are those of the same hours a week before (the last day's "
            "when the log is shorter than a week), nothing after it: later work of budgets ahead goes first, as "
            "it will.",
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

    --recent-waits: an unallocated job (min runtime 0) that the forward run does not start at once gets the later
    of that start and the recent median wait of unallocated jobs of its size (basis recent_waits).

    A job not started within --horizon (default 7d) starts after it (">" before the time).

    Resolution: cycles no closer than --min-gap seconds (default 30) nor --spacing of how far ahead (0.02), so a
    start may come up to a gap late per cycle it waits for; --json gives both (min_gap_s, spacing).

    Without any of these a run is assumed to last W/4; future submissions are left out (--with-arrivals: the
    same hours a week before come again).

    Columns: est. start (UTC), in (from the forecast's time), basis (what it rests on), reason (why it waits now).

    One job also gets its chain: the runs that must end or be preempted for it.

    Exit 1 when the job is not pending (running: since when and its time limit, `--json` reason running; ended;
    or not in the log); 2 for bad input; 3 Kafka unreachable. Text times are at seconds, --json keeps microseconds.

    Examples:

    apportion forecast  (every pending job)

    apportion forecast j-42  (one job, with its chain)

    apportion forecast sweep-7  (a job array: each pending element)

    apportion forecast -b lab/vision -u alice --json

    apportion forecast --from-file log.jsonl.gz --at 2024-05-01T12:00:00Z --horizon 3d

    apportion forecast --spacing 0 --min-gap 0  (the exact forward run: a cycle at every run end)

    apportion forecast --submit -b lab/vision -g 8 -k 2 -m 2h  (if I submit this now; exit 1 if it would be rejected)
    """
    from apportion.audit.replay import decoded
    from apportion.cli.audit import _dur
    from apportion.forecast import forecast as run_forecast
    from apportion.forecast import recent_waits, user_history, week_before_arrivals

    check_budget_filter(budget)
    if not 0.0 <= spacing <= 1.0:
        fail(f"--spacing {spacing:g}: a fraction from 0 to 1")
    if min_gap < 0:
        fail(f"--min-gap {min_gap:g}: seconds, not negative")
    if submit_ and (job_id is not None or budget is None or gpus is None or min_runtime is None):
        fail("--submit needs -b BUDGET, -g GPUS and -m MIN_RUNTIME, and no JOB_ID")
    horizon_s = _dur(horizon, "--horizon")
    if horizon_s <= 0:
        fail(f"--horizon {horizon}: a duration above 0")
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
        _forecastable(state, job_id, as_json)
        wanted = [job_id]
    else:
        wanted = [
            j.job_id
            for leaf in sorted(state.pending)
            for j in state.pending[leaf]
            if (user is None or j.user == user) and (budget is None or leaf == budget or leaf.startswith(budget + "/"))
        ]
    evs = decoded(recs)
    arrivals = week_before_arrivals(evs, now) if with_arrivals else ()
    fc = run_forecast(
        state,
        now,
        cfg,
        job_ids=wanted,
        history=user_history(evs),
        horizon_s=horizon_s,
        arrivals=arrivals,
        spacing=spacing,
        min_gap_s=min_gap,
        waits=recent_waits(evs, now) if with_recent_waits else None,
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
    from apportion.heap import settle_heap
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
    settle_heap()  # the folded log lives as long as this command: the forward run's collections skip it (D9.scale)
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


def _forecastable(state: Any, job_id: str, as_json: bool) -> None:
    """Exit 1 unless ``job_id`` is pending in ``state``, saying what it is instead: running or stopping (since when,
    until its time limit when it has one; ``--json`` reason ``running`` or ``stopping``), ended (when; reason
    ``finished``), or not in the log (verdict ``not_found``, reason ``no_job``)."""
    from apportion.forecast import iso_seconds
    from apportion.timeutil import s_to_us

    rec = state.jobs.get(job_id)
    if rec is not None and rec.status == "pending":
        return
    if rec is not None:
        run = state.cluster.runs.get((job_id, rec.attempt))
        since = run.started_at_us if run is not None else None
        limit = rec.spec.time_limit_s
        until = None if since is None or limit is None else since + s_to_us(limit)
        when = f"since {iso_seconds(since)}" if since is not None else "placed, not yet started"
        if until is not None:
            when += f", time limit at {iso_seconds(until)}"
        refuse(
            f"job {job_id!r} is {rec.status} (attempt {rec.attempt}, {when}): only pending jobs have a forecast",
            as_json=as_json,
            reason=rec.status,
            job_id=job_id,
            state=rec.status,
            attempt=rec.attempt,
            since=None if since is None else iso_seconds(since),
            time_limit_at=None if until is None else iso_seconds(until),
        )
    if job_id in state.finished:
        ended = iso_seconds(state.finished[job_id])
        refuse(
            f"job {job_id!r} ended at {ended}: nothing to forecast",
            as_json=as_json,
            reason="finished",
            job_id=job_id,
            ended=ended,
        )
    refuse(
        f"job {job_id!r} is not in the log (or ended more than a window ago)",
        as_json=as_json,
        verdict="not_found",
        reason="no_job",
        job_id=job_id,
    )


def forecast_table(fc: Any, width: int, *, detail: bool = False) -> Any:
    """The `apportion forecast` output of a :class:`apportion.forecast.Forecast`, for a terminal ``width`` wide.

    One row a job: job, budget, est. start (``MM-DD HH:MM`` UTC; the full time from :data:`QUEUE_WIDE`
    columns), in (from the forecast's time), basis, and the kind of the reason it waits now; no cell is cut: when
    the row does not fit ``width``, the reason's kind, then the basis, then the budget leave the table for a line
    per job after it. Then what each basis means, one a line. ``detail`` (one job): the reason's text and the
    chain follow, wrapped at word boundaries, uncut.
    """
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from apportion.forecast import iso_seconds
    from apportion.timeutil import from_us, us_to_s

    wide = width >= QUEUE_WIDE

    def start(j: Any) -> str:
        at = j.start_us if j.start_us is not None else j.after_us
        if at is None:
            return "-"
        iso = from_us(at).isoformat()
        return ("" if j.start_us is not None else ">") + (iso[:19] if wide else iso[5:16]).replace("T", " ")

    def wait(j: Any) -> str:
        if j.wait_s is not None:
            return format_duration(j.wait_s)
        return "-" if j.after_us is None else ">" + format_duration(us_to_s(j.after_us - fc.now_us))

    def kind(j: Any) -> str:
        return str(j.reason_detail["kind"]) if j.reason_detail else ("placeable" if j.reason == "" else "")

    columns: list[Column] = [
        ("job", {}, lambda j: j.job_id),
        ("budget", {}, lambda j: j.budget),
        ("est. start (UTC)" if wide else "est. start", {}, start),
        ("in", {"justify": "right"}, wait),
        ("basis", {}, lambda j: j.basis),
        ("reason now", {}, kind),
    ]
    t, moved = fitted_table(
        f"forecast at {iso_seconds(fc.now_us)} ({len(fc.jobs)} pending job(s))",
        columns,
        fc.jobs,
        width,
        ("reason now", "basis", "budget"),
    )
    lines: list[Any] = []
    for j in fc.jobs if moved else ():
        lines.append(Text.assemble((j.job_id, "bold"), ": ", ", ".join(left_out(columns, moved, j))))
    bases = Table.grid(padding=(0, 2, 0, 0))
    bases.add_column(no_wrap=True, min_width=len("basis:"))
    bases.add_column(no_wrap=True, min_width=max(len(name) for name, _ in FORECAST_BASES))
    bases.add_column()  # the meaning wraps at word boundaries when the terminal is narrow; nothing is cut
    for i, (name, meaning) in enumerate(FORECAST_BASES):
        bases.add_row("basis:" if i == 0 else "", name, meaning)
    lines.append(bases)
    if detail:
        for j in fc.jobs:
            if j.reason:
                lines.append(Text.assemble(("waits now: ", "bold"), j.reason))
            if j.note:
                lines.append(Text.assemble(("no start: " if j.start_us is None else "estimate: ", "bold"), j.note))
            for c in j.chain:
                lines.append(Text(f"{from_us(c.at_us).isoformat()[:19].replace('T', ' ')}  {c.text}"))
    return Group(t, *lines)
