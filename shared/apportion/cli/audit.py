"""``apportion audit ...`` and ``apportion log export``: replay the event log.

Every audit command reads the log from Kafka (all apportion topics, from
offset 0) or, with ``--from-file``, from an export made by ``apportion log
export``; both give the same answers. Nothing here writes to live topics.
"""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from apportion.cli.common import (
    _print_json,
    _ratio,
    _tree_from_file,
    check_budget_filter,
    err,
    fail,
    is_kafka_error,
    json_option,
    kafka_failure,
    out,
)
from apportion.settings import Connection

audit_app = typer.Typer(
    help="Replay the event log: occupancy at T, explain a job, verify live state, preemptions.", no_args_is_help=True
)
log_app = typer.Typer(help="Export the event log for offline audits.", no_args_is_help=True)

Bootstrap = Annotated[
    str | None, typer.Option("--bootstrap", help="Kafka bootstrap (host:port).", envvar="APPORTION_KAFKA_BOOTSTRAP")
]
FromFile = Annotated[
    Path | None, typer.Option("--from-file", help="Read an export file instead of Kafka.", exists=True, dir_okay=False)
]
JsonOut = Annotated[bool, json_option("Print JSON for scripts.")]


def parse_time(text: str) -> datetime:
    """ISO 8601 time; a value without zone is UTC. ``now`` is the wall clock.

    Raises:
        typer.BadParameter: not a time.
    """
    if text == "now":
        return datetime.now(UTC)
    try:
        dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not an ISO time such as 2017-11-01T12:00:00Z") from None
    return dt if dt.tzinfo else dt.replace(tzinfo=UTC)


def _dur(text: str, option: str) -> float:
    """A duration option in seconds; a bad or negative one is a usage error (exit 2), not a traceback."""
    from apportion.durations import parse_duration

    try:
        value = parse_duration(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint=option) from None
    if value < 0:
        raise typer.BadParameter("must not be negative", param_hint=option)
    return value


def _load(
    bootstrap: str | None, from_file: Path | None, since: datetime | None = None, *, dead_letters: bool = False
) -> list[Any]:
    """The log from Kafka or an export, in log order: the audit's topics, and the dead letters when asked."""
    from apportion.audit.source import load_log, verify_topics

    # an export is read offline: no stack is resolved (one that was stopped must not stop the audit)
    conn = Connection.resolve(bootstrap=bootstrap) if from_file is None else None
    source = str(from_file) if conn is None else conn.bootstrap
    if from_file is not None:
        from apportion.audit.source import export_prefix
        from apportion.settings import topic_prefix

        try:
            prefix = export_prefix(from_file)
        except (OSError, ValueError, EOFError) as exc:
            fail(f"{from_file}: not a readable apportion export ({exc})")
        if prefix != topic_prefix():
            # the file's namespace, not the environment's: an export of another stack must not read as empty
            os.environ["APPORTION_TOPIC_PREFIX"] = prefix
    since_ms = int(since.timestamp() * 1000) if since else None
    names = verify_topics() if dead_letters else None  # after the export's namespace is in force
    t0 = time.perf_counter()
    console = _err()
    with Progress(  # a spinner for a terminal; piped, a transient display would leave an empty line
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        transient=True,
        console=console,
        disable=not console.is_terminal,
    ) as prog:
        task = prog.add_task("reading log", total=None)

        def progress(n: int) -> None:
            prog.update(task, description=f"reading log: {n:,} records")

        try:
            recs = load_log(
                bootstrap=conn.bootstrap if conn is not None else None,
                from_file=from_file,
                topic_names=names,
                since_ms=since_ms,
                progress=progress,
            )
        except Exception as exc:
            if is_kafka_error(exc):  # the ACLs' refusal exit 1, anything else the stack unreachable, exit 3
                kafka_failure(exc, source, "read from", names or ())
            if from_file is not None and isinstance(exc, (OSError, ValueError, EOFError)):
                fail(f"{from_file}: not a readable apportion export ({exc})")
            raise
    dt = time.perf_counter() - t0
    if from_file is not None and not recs:
        # nothing to check is not a pass: say so and exit 1 (an audit of 0 records once said OK)
        fail(f"{from_file}: no apportion records to read (an empty export, or none since --since)", 1)
    _err().print(
        f"read {len(recs):,} records in {dt:.2f} s ({len(recs) / dt if dt else 0:,.0f} records/s) from {source}",
        highlight=False,
    )
    return recs


def _err() -> Any:
    return err


def _out() -> Any:
    return out


@log_app.command("export")
def export(
    output: Annotated[Path, typer.Option("-o", "--output", help="File to write (gzip JSON Lines).")],
    since: Annotated[str | None, typer.Option(help="Only records with Kafka timestamp >= this ISO time.")] = None,
    until: Annotated[str | None, typer.Option(help="Only records with Kafka timestamp <= this ISO time.")] = None,
    bootstrap: Bootstrap = None,
    as_json: JsonOut = False,
) -> None:
    """Export every apportion topic, the dead letters included (with topic, partition, offset, key), to a
    compressed file.

    Example: apportion log export -o week44.jsonl.gz --since 2026-11-01T00:00:00Z
    """
    from apportion.audit.source import verify_topics, write_export

    since_dt = parse_time(since) if since else None
    recs = _load(bootstrap, None, since_dt, dead_letters=True)
    if until:
        limit = parse_time(until).timestamp() * 1000
        recs = [r for r in recs if r.timestamp_ms <= limit]
    try:
        n = write_export(recs, output, topic_names=verify_topics(), exported_at=datetime.now(UTC).isoformat())
    except OSError as exc:
        fail(f"cannot write {output}: {exc.strerror or exc}")
    if as_json:
        _print_json({"records": n, "output": str(output)})
    else:
        _out().print(f"wrote {n:,} records to {output}")


@audit_app.command("occupancy")
def occupancy(
    at: Annotated[str, typer.Option("--at", help="Event time to evaluate at (ISO, UTC), or 'now'.")] = "now",
    budget: Annotated[str | None, typer.Option("--budget", "-b", help="Only this budget and below.")] = None,
    window: Annotated[str, typer.Option(help="Window length (7d default).")] = "7d",
    bootstrap: Bootstrap = None,
    from_file: FromFile = None,
    as_json: JsonOut = False,
) -> None:
    """Rebuilt occupancy windows at event time T: share, O, U, E, r and rank per budget.

    A T in the future is answered as of the log's last event time, with a note on stderr (``--json``:
    ``requested_at`` is the T asked for, ``at`` the time answered for).
    """
    from apportion.audit.replay import occupancy_at
    from apportion.timeutil import to_us

    check_budget_filter(budget)
    t = parse_time(at)
    recs = _load(bootstrap, from_file)
    asked: datetime | None = None
    if at != "now" and t > datetime.now(UTC):  # the log says nothing of the future: answer as of its end
        ends = max((r.event.ts for r in recs if r.event is not None), default=None)
        if ends is not None and t > ends:
            asked, t = t, ends
            _err().print(
                f"note: --at {asked.isoformat()} is in the future; the log ends at {ends.isoformat()}: "
                "occupancy as of then",
                highlight=False,
                soft_wrap=True,
            )
    t0 = time.perf_counter()
    snap, ranks = occupancy_at(recs, to_us(t), window_s=_dur(window, "--window"))
    dt = time.perf_counter() - t0
    rows = [
        u.model_dump(mode="json") | {"rank": ranks.get(u.path)}
        for u in snap.budgets
        if budget is None or u.path == budget or u.path.startswith(budget + "/")
    ]
    if as_json:
        _print_json(
            {
                "at": snap.at.isoformat(),
                "requested_at": asked.isoformat() if asked is not None else None,
                "window_s": snap.window_s,
                "capacity_gpus": snap.capacity_gpus,
                "capacity_gpu_s": snap.capacity_gpu_s,
                "budgets": rows,
            }
        )
        return
    _err().print(f"replayed {len(recs):,} records in {dt:.2f} s ({len(recs) / dt if dt else 0:,.0f} events/s)")
    table = Table(
        title=f"occupancy at {snap.at.isoformat()} (capacity {snap.capacity_gpus} GPUs, "
        f"K = {snap.capacity_gpu_s / 3600:.1f} GPU-h)"
    )
    for col in ("budget", "abs share", "O GPU-h", "U GPU-h", "E GPU-h", "r", "rank"):
        table.add_column(col, justify="left" if col == "budget" else "right")
    for row in rows:
        table.add_row(
            row["path"],
            f"{row['abs_share']:.4f}",
            f"{row['occupancy_gpu_s'] / 3600:.2f}",
            f"{row['unallocated_gpu_s'] / 3600:.2f}",
            f"{row['entitlement_gpu_s'] / 3600:.2f}",
            _ratio(row["ratio"]),
            "" if row["rank"] is None else str(row["rank"]),
        )
    _out().print(table)


def counts_text(counts: dict[str, int]) -> str:
    """``{name: count}`` as a readable line, names sorted: ``drain 1, unallocated 2``; ``none`` when empty."""
    return ", ".join(f"{k} {n}" for k, n in sorted(counts.items())) or "none"


@audit_app.command("preemptions")
def preemptions(
    since: Annotated[str | None, typer.Option(help="From this event time (ISO).")] = None,
    until: Annotated[str | None, typer.Option(help="Up to this event time (ISO).")] = None,
    thrash_over: Annotated[int, typer.Option(help="Flag jobs preempted more than N times.")] = 3,
    jobs: Annotated[
        bool, typer.Option("--jobs", help="List each preempted job: attempt, budget, by whom, rule, work lost.")
    ] = False,
    bootstrap: Bootstrap = None,
    from_file: FromFile = None,
    as_json: JsonOut = False,
) -> None:
    """Preemptions by victim and preemptor budget; protection violations (must be 0) and thrash.

    With --jobs, one row per preemption: the victim job and attempt, its budget, the job and budget that
    took its GPUs, the rule, the victim's work lost (GPU-h since its last checkpoint) and the event time.
    Exit code 1 when any protection violation is found.
    """
    from apportion.audit.replay import preemption_report
    from apportion.timeutil import to_us

    recs = _load(bootstrap, from_file)
    rep = preemption_report(
        recs,
        since=to_us(parse_time(since)) if since else None,
        until=to_us(parse_time(until)) if until else None,
        thrash_over=thrash_over,
    )
    if as_json:
        _print_json(rep.to_dict(jobs=jobs))
    else:
        table = Table(title=f"{rep.total} preemptions")
        for col in ("victim budget", "preempting budget", "count"):
            table.add_column(col)
        for (v, p), n in sorted(rep.pairs.items()):
            table.add_row(v, p, str(n))
        _out().print(table)
        if jobs:
            _out().print(_jobs_table(rep.jobs))
        _out().print(f"by rule: {counts_text(rep.rules)}", highlight=False)
        _out().print(f"protection violations: {len(rep.violations)}")
        _out().print(f"thrash (> {thrash_over} preemptions): {counts_text(rep.thrash)}", highlight=False)
    if rep.violations:
        raise typer.Exit(1)


def _jobs_table(rows: list[dict[str, Any]]) -> Table:
    lost = [r["lost_gpu_h"] for r in rows if r["lost_gpu_h"] is not None]
    table = Table(title=f"preempted jobs ({len(rows)}; work lost {sum(lost):.2f} GPU-h)")
    for col in ("job", "attempt", "budget", "by job", "by budget", "rule", "lost GPU-h", "at"):
        table.add_column(col, justify="right" if col in ("attempt", "lost GPU-h") else "left")
    for r in rows:
        table.add_row(
            r["job_id"],
            str(r["attempt"]),
            r["budget"],
            r["by_job_id"] or "-",
            r["by_budget"],
            r["rule"],
            "-" if r["lost_gpu_h"] is None else f"{r['lost_gpu_h']:.2f}",
            r["at"][:19].replace("T", " "),
        )
    return table


@audit_app.command("squatting")
def squatting(
    threshold: Annotated[str, typer.Option(help="Idle stretch that counts as squatting (e.g. 30m).")] = "30m",
    util_below: Annotated[float, typer.Option(help="GPU utilisation % below which a GPU is idle.")] = 5.0,
    bootstrap: Bootstrap = None,
    from_file: FromFile = None,
    as_json: JsonOut = False,
) -> None:
    """Jobs whose GPUs showed near-zero utilisation in heartbeats for longer than a threshold.

    Where a heartbeat carries the node agent's own idle count of a run (``idle_s``; agents that sample
    utilisation), the stretch is that report (source ``agent``; ``IDLE`` when the agent reported the run
    past its node's idle_after_s); otherwise it is computed here from the utilisation samples with
    --util-below (source ``samples``).
    Simulated nodes report a seeded utilisation per job (about 5% of jobs idle: node agent --sim-util-seed).
    When no heartbeat in the log carries GPU utilisation (no NVML, or an agent reporting none),
    nothing can be found: a note on stderr says so, and --json has ``utilisation_reported: false``.
    --json: ``{runs: [...], heartbeats, heartbeats_with_utilisation, heartbeats_with_idle_report,
    utilisation_reported}``; each run has ``idle`` and ``source``.
    """
    from apportion.audit.replay import squatting_report
    from apportion.durations import format_duration

    threshold_s = _dur(threshold, "--threshold")  # bad input is exit 2 before the log is read
    rep = squatting_report(_load(bootstrap, from_file), threshold_s=threshold_s, util_below_pct=util_below)
    if rep.blind:
        _err().print(
            f"note: none of the {rep.heartbeats:,} heartbeats in the log carries GPU utilisation "
            "(no NVML, or an agent that reports none): squatting cannot be seen",
            highlight=False,
            soft_wrap=True,
        )
    if as_json:
        _print_json(
            {
                "runs": rep.rows,
                "heartbeats": rep.heartbeats,
                "heartbeats_with_utilisation": rep.heartbeats_with_utilisation,
                "heartbeats_with_idle_report": rep.heartbeats_with_idle_report,
                "utilisation_reported": not rep.blind,
            }
        )
        return
    table = Table(title=f"squatting ({len(rep.rows)} runs idle > {threshold})")
    for col in ("job", "attempt", "budget", "node", "idle", "since", "source"):
        table.add_column(col)
    for r in rep.rows:
        idle = ("IDLE " if r["idle"] else "") + format_duration(r["idle_s"])
        table.add_row(r["job_id"], str(r["attempt"]), r["budget"], r["node_id"], idle, r["since"], r["source"])
    _out().print(table)


# ------------------------------------------------------------------ explain / verify / whatif


def _dispatch_config(
    records: Any,
    delta: float | None,
    grace: float | None,
    reservation_after: str | None,
    heartbeat_timeout: str | None,
    window: str | None,
) -> Any:
    """The dispatcher knobs the re-run uses: the log's ``DispatcherConfigured`` record, flags overriding fields.

    Without a record (a log older than it) the built-in defaults are used, and a note says so.
    """
    from apportion.audit.config import config_from_log, with_overrides
    from apportion.domain.dispatch import DispatchConfig

    try:
        logged = config_from_log(records)
    except ValueError as exc:
        fail(str(exc), 1)
    if logged is None:
        _err().print("note: the log records no DispatcherConfigured; re-running with the default dispatcher settings")
    return with_overrides(
        logged or DispatchConfig(),
        delta=delta,
        grace_s=grace,
        reservation_after_s=_dur(reservation_after, "--reservation-after") if reservation_after else None,
        window_s=_dur(window, "--window") if window else None,
        heartbeat_timeout_s=_dur(heartbeat_timeout, "--heartbeat-timeout") if heartbeat_timeout else None,
    )


_FROM_LOG = "Default: as the log's DispatcherConfigured record says."
Delta = Annotated[float | None, typer.Option(help=f"Override the preemption hysteresis. {_FROM_LOG}")]
Grace = Annotated[float | None, typer.Option(help=f"Override the grace seconds of preempted runs. {_FROM_LOG}")]
Reservation = Annotated[
    str | None, typer.Option("--reservation-after", help=f"Override reservation_after (e.g. 1h). {_FROM_LOG}")
]
HbTimeout = Annotated[
    str | None, typer.Option("--heartbeat-timeout", help=f"Override the heartbeat timeout; 0 disables. {_FROM_LOG}")
]
Window = Annotated[str | None, typer.Option(help=f"Override the occupancy window (e.g. 7d). {_FROM_LOG}")]
Producer = Annotated[
    str | None, typer.Option("--dispatcher-producer", help=f"Override the dispatcher's producer name. {_FROM_LOG}")
]


@audit_app.command("explain")
def explain_cmd(
    job_id: Annotated[str, typer.Argument(help="The job to explain.")],
    delta: Delta = None,
    grace: Grace = None,
    reservation_after: Reservation = None,
    heartbeat_timeout: HbTimeout = None,
    window: Window = None,
    producer: Producer = None,
    bootstrap: Bootstrap = None,
    from_file: FromFile = None,
    as_json: JsonOut = False,
) -> None:
    """A job's whole timeline from the log, each placement and preemption re-run on the rebuilt state.

    Exit code 1 when the job is not in the log or a re-run decision differs from the recorded one.
    """
    from apportion.audit.explain import explain

    recs = _load(bootstrap, from_file)
    cfg = _dispatch_config(recs, delta, grace, reservation_after, heartbeat_timeout, window)
    ex = explain(recs, job_id, cfg, producer=producer or cfg.producer)
    if not ex.found:
        fail(f"job {job_id!r} is not in the log", 1)
    from apportion.audit.verify import dispatcher_fold
    from apportion.forecast import protection_of

    state = dispatcher_fold(recs, cfg, producer=producer or cfg.producer)
    ex.protection = protection_of(state, job_id, state.clock_us or 0)
    if as_json:
        _print_json(ex.to_dict())
    else:
        _out().print(explain_table(ex, _out().width))
        for e in ex.timeline:
            if e.check is not None and not e.check["match"]:
                _out().print(f"[red]{e.kind} at {e.offset}:[/] " + "; ".join(e.check["diffs"]))
        n = sum(1 for e in ex.timeline if e.check is not None)
        _out().print(f"{n} decisions re-run: " + ("all identical" if ex.decisions_match else "[red]mismatch[/]"))
        if ex.protection:
            _out().print(f"at the log's end: {ex.protection}")
    if not ex.decisions_match:
        raise typer.Exit(1)


def explain_table(ex: Any, width: int) -> Any:
    """``audit explain``'s timeline, fitted to ``width`` columns with no cell cut
    (:func:`apportion.cli.common.fitted_table`): step, event time (UTC), offset, event, re-run (``same`` or
    ``DIFFERS``; empty for what is no decision) and what happened; what happened, then the offset leave the table
    for a line per step after it (``#3: replica 0 started on n0 GPUs [0]``)."""
    from rich.console import Group
    from rich.text import Text

    from apportion.cli.common import Column, fitted_table, left_out

    steps = list(enumerate(ex.timeline, 1))
    columns: list[Column] = [
        ("#", {"justify": "right"}, lambda s: str(s[0])),
        ("event time (UTC)", {}, lambda s: s[1].at[:19].replace("T", " ")),
        ("offset", {}, lambda s: s[1].offset),
        ("event", {}, lambda s: s[1].kind),
        ("re-run", {}, lambda s: "" if s[1].check is None else ("same" if s[1].check["match"] else "DIFFERS")),
        ("what happened", {}, lambda s: s[1].summary),
    ]
    t, moved = fitted_table(f"job {ex.job_id}", columns, steps, width, ("what happened", "offset"))
    lines = [
        Text.assemble((f"#{s[0]}", "bold"), ": ", "; ".join(left_out(columns, moved, s, bare=("what happened",))))
        for s in (steps if moved else ())
    ]
    return Group(t, *lines)


def mismatch_table(mismatches: list[Any], first: str, width: int) -> Any:
    """``audit verify``'s mismatches, fitted to ``width`` columns with no cell cut
    (:func:`apportion.cli.common.fitted_table`): check, first offset, event time, subject, difference; the
    difference, then the subject and the event time leave the table for a line per mismatch after it
    (``offset: difference``)."""
    from rich.console import Group
    from rich.text import Text

    from apportion.cli.common import Column, fitted_table, left_out

    columns: list[Column] = [
        ("check", {}, lambda m: m.check),
        ("first offset", {}, lambda m: m.offset or "-"),
        ("event time", {}, lambda m: (m.at or "-")[:19].replace("T", " ")),
        ("subject", {}, lambda m: m.subject),
        ("difference", {}, lambda m: m.detail),
    ]
    t, moved = fitted_table(
        f"{len(mismatches)} mismatches (first at {first})",
        columns,
        mismatches,
        width,
        ("difference", "subject", "event time"),
    )
    lines = [
        Text.assemble((m.offset or m.check, "bold"), ": ", "; ".join(left_out(columns, moved, m, bare=("difference",))))
        for m in (mismatches if moved else ())
    ]
    return Group(t, *lines)


@audit_app.command("verify")
def verify_cmd(
    redis_url: Annotated[
        str | None, typer.Option("--redis", help="Redis URL of the live read models.", envvar="APPORTION_REDIS_URL")
    ] = None,
    no_redis: Annotated[bool, typer.Option("--no-redis", help="Skip the read-model check (offline).")] = False,
    delta: Delta = None,
    grace: Grace = None,
    reservation_after: Reservation = None,
    heartbeat_timeout: HbTimeout = None,
    window: Window = None,
    producer: Producer = None,
    bootstrap: Bootstrap = None,
    from_file: FromFile = None,
    as_json: JsonOut = False,
) -> None:
    """Rebuild from the log; compare with Redis read models, every snapshot and every decision.

    Exit code 1 on any mismatch; each is reported with the first offset where it appears.
    The read-model check is skipped with --no-redis (default with --from-file).
    Records the services refused (dead-lettered, or requests the dispatcher rejected for who sent them) are
    listed by what the refusal makes of them (a forgery, a refused request such as another user's job to
    cancel, invalid input) and by reason: the stack working, not a mismatch (--json: ``refused_attacks``).
    """
    from apportion.audit.verify import read_models_from_redis, verify

    recs = _load(bootstrap, from_file, dead_letters=True)
    cfg = _dispatch_config(recs, delta, grace, reservation_after, heartbeat_timeout, window)
    rows = None
    if not no_redis and (from_file is None or redis_url is not None):
        import redis as redis_lib

        from apportion.bus.security import redis_auth

        url = Connection.resolve(redis_url=redis_url).redis_url
        r = redis_lib.Redis.from_url(url, **redis_auth(url))
        try:
            rows = read_models_from_redis(r)
        finally:
            r.close()
    t0 = time.perf_counter()
    rep = verify(recs, read_models=rows, config=cfg, producer=producer or cfg.producer)
    dt = time.perf_counter() - t0
    if as_json:
        _print_json(rep.to_dict())
    else:
        _err().print(f"verified {len(recs):,} records in {dt:.2f} s ({len(recs) / dt if dt else 0:,.0f} events/s)")
        _out().print(
            f"snapshots checked: {rep.snapshots}; decision ticks re-run: {rep.decisions}"
            f"{basis_words(rep.decision_basis)}; read models: {'checked' if rep.read_models else 'skipped'}; "
            f"signed requests re-checked: {rep.signed_requests}"
        )
        _print_refused(rep)
        if rep.ok:
            _out().print("[green]OK[/]: the live state is what the log says")
        else:
            first = rep.first.offset if rep.first and rep.first.offset else "-"
            _out().print(mismatch_table(rep.mismatches, first, _out().width))
    if not rep.ok:
        raise typer.Exit(1)


#: How ``audit verify`` says on what a decision tick was re-run (:class:`apportion.audit.verify.DecisionCheck`'s basis).
_BASIS_WORDS = {"inputs": "on their recorded inputs", "log-order": "in log order"}


def basis_words(counts: dict[str, int]) -> str:
    """`` (6 on their recorded inputs, 2 in log order)``: the decision ticks by basis, for ``audit verify``'s
    summary line; empty when none was re-run."""
    parts = [f"{n} {_BASIS_WORDS.get(basis, basis)}" for basis, n in sorted(counts.items()) if n]
    return f" ({', '.join(parts)})" if parts else ""


#: How ``audit verify`` names the kinds of refusal (:func:`apportion.audit.verify.refusal_kind`): one, many.
_KIND_WORDS = {
    "forgery": ("forgery", "forgeries"),
    "refused request": ("refused request", "refused requests"),
    "invalid input": ("invalid record", "invalid records"),
}


def refused_line(summary: dict[str, Any]) -> str:
    """The count line of ``audit verify``'s refused records, by what the refusal makes of each (a forgery, a
    refused request, invalid input) with its reasons: ``refused by the services: 2 (1 forgery:
    unauthenticated_node 1; 1 refused request: not_owner 1)``."""
    from apportion.audit.verify import refusal_kind

    if not summary["count"]:
        return "refused by the services: none"
    parts = []
    for kind, n in summary["by_kind"].items():
        reasons = {r: c for r, c in summary["by_reason"].items() if refusal_kind(r) == kind}
        parts.append(f"{n} {_KIND_WORDS[kind][n != 1]}: {counts_text(reasons)}")
    return f"refused by the services: {summary['count']} ({'; '.join(parts)})"


def refused_table(summary: dict[str, Any], width: int) -> Any:
    """The first refused records of ``audit verify``, fitted to ``width`` columns with no cell cut
    (:func:`apportion.cli.common.fitted_table`): offset, event time, kind, what, claims to be, refused by,
    reason; the reason, then who refused it, whom it claims to be and the event time leave the table for a line
    per record after it (``offset: by dispatcher; <reason>``)."""
    from rich.console import Group
    from rich.text import Text

    from apportion.cli.common import Column, fitted_table, left_out

    columns: list[Column] = [
        ("offset", {}, lambda f: f["offset"]),
        ("event time", {}, lambda f: f["at"][:19].replace("T", " ") if f["at"] else "-"),
        ("kind", {}, lambda f: f["kind"]),
        ("what", {}, lambda f: f["what"]),
        ("claims to be", {}, lambda f: f["who"]),
        ("refused by", {}, lambda f: ", ".join(f["by"]) + ("" if f["in_log"] else " (record not read)")),
        ("reason", {}, lambda f: f["detail"]),
    ]
    rows = summary["first"]
    t, moved = fitted_table(
        f"refused records (not mismatches): the first {len(rows)} of {summary['count']}",
        columns,
        rows,
        width,
        ("reason", "refused by", "claims to be", "event time"),
    )
    lines = [
        Text.assemble((f["offset"], "bold"), ": ", "; ".join(left_out(columns, moved, f, bare=("reason",))))
        for f in (rows if moved else ())
    ]
    return Group(t, *lines)


def _print_refused(rep: Any) -> None:
    """The refused records of ``audit verify``: the count by kind and reason, then the first few, one a row."""
    summary = rep.refused_summary()
    _out().print(refused_line(summary), highlight=False)
    if summary["first"]:
        _out().print(refused_table(summary, _out().width))


def whatif_cmd(
    budgets: Annotated[
        Path,
        typer.Option(
            "--budgets", exists=True, dir_okay=False, help="New budget tree (YAML: a budget file or path: share)."
        ),
    ],
    seed: Annotated[int, typer.Option(help="Simulator seed (stop delays).")] = 0,
    cycle_s: Annotated[float, typer.Option("--cycle-s", help="Periodic cycle while jobs wait, seconds.")] = 300.0,
    delta: Delta = None,
    grace: Grace = None,
    reservation_after: Reservation = None,
    window: Window = None,
    bootstrap: Bootstrap = None,
    from_file: FromFile = None,
    as_json: JsonOut = False,
) -> None:
    """Re-run the log's submissions under another budget tree and the recorded one, side by side."""
    from apportion.audit.whatif import whatif

    tree = _tree_from_file(budgets)  # a bad file is bad input (exit 2), told before the log is read
    recs = _load(bootstrap, from_file)
    cfg = _dispatch_config(recs, delta, grace, reservation_after, "0", window)
    try:
        w = whatif(recs, tree, seed=seed, config=cfg, cycle_s=cycle_s)
    except ValueError as exc:
        fail(str(exc), 1)
    if as_json:
        _print_json(w.to_dict())
        return

    def f(v: Any, kind: str) -> str:
        if v is None:
            return "-"
        if kind == "share":
            return f"{v:+.3f}" if kind == "dshare" else f"{v:.3f}"
        if kind == "s":
            return f"{v:,.0f}"
        return str(v)

    def d(v: Any, kind: str) -> str:
        if v is None:
            return "-"
        return f"{v:+.3f}" if kind == "share" else f"{v:+,.0f}"

    _out().print(
        f"{w.jobs} jobs on {w.nodes} nodes ({w.gpus} GPUs)"
        + (f"; skipped {len(w.skipped)} without a known duration" if w.skipped else "")
    )
    table = Table(title="per budget: recorded tree -> new tree (diff)")
    for col in ("budget", "share", "alloc share", "wait p50 s", "wait p95 s", "preemptions", "never placed"):
        table.add_column(col, justify="left" if col == "budget" else "right")
    for row in w.rows:
        a, b, df = row["recorded"] or {}, row["new"] or {}, row["diff"] or {}

        def cell(k: str, kind: str) -> str:
            return f"{f(a.get(k), kind)} -> {f(b.get(k), kind)} ({d(df.get(k), kind)})"  # noqa: B023 - called in this iteration

        table.add_row(
            row["path"],
            f"{f(row['share_recorded'], 'share')} -> {f(row['share_new'], 'share')}",
            cell("alloc_share", "share"),
            cell("wait_p50_s", "s"),
            cell("wait_p95_s", "s"),
            cell("preemptions", "n"),
            cell("never", "n"),
        )
    _out().print(table)
    for name, rep in (("recorded", w.recorded), ("new", w.new)):
        _out().print(
            f"{name}: utilisation {rep.utilisation:.3f}, wait p50 {f(rep.wait_p50_s, 's')} s, "
            f"preemptions {rep.preemptions}, never placed {rep.never}, protection violations {rep.violations}"
        )


def register(app: typer.Typer) -> None:
    """Attach ``audit`` and ``log`` to the main CLI."""
    app.add_typer(audit_app, name="audit")
    app.add_typer(log_app, name="log")
    app.command("whatif")(whatif_cmd)
