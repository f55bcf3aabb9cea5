"""``apportion audit ...`` and ``apportion log export``: replay the event log.

Every audit command reads the log from Kafka (all apportion topics, from
offset 0) or, with ``--from-file``, from an export made by ``apportion log
export``; both give the same answers. Nothing here writes to live topics.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from apportion.settings import Connection

audit_app = typer.Typer(help="Replay the event log: occupancy at T, explain a job, verify live state, preemptions.",
                        no_args_is_help=True)
log_app = typer.Typer(help="Export the event log for offline audits.", no_args_is_help=True)

Bootstrap = Annotated[Optional[str], typer.Option("--bootstrap", help="Kafka bootstrap (host:port).", envvar="APPORTION_KAFKA_BOOTSTRAP")]
FromFile = Annotated[Optional[Path], typer.Option("--from-file", help="Read an export file instead of Kafka.", exists=True, dir_okay=False)]
JsonOut = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]


def parse_time(text: str) -> datetime:
    """ISO 8601 time; a value without zone is UTC. ``now`` is the wall clock.

    Raises:
        typer.BadParameter: not a time.
    """
    if text == "now":
        return datetime.now(timezone.utc)
    try:
        dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not an ISO time such as 2017-11-01T12:00:00Z") from None
    return dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)


def _load(bootstrap: str | None, from_file: Path | None, since: datetime | None = None) -> list[Any]:
    from apportion.audit.source import load_log
    from apportion.cli.main import fail

    conn = Connection.resolve(bootstrap=bootstrap)
    since_ms = int(since.timestamp() * 1000) if since else None
    t0 = time.perf_counter()
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  transient=True, console=_err()) as prog:
        task = prog.add_task("reading log", total=None)

        def progress(n: int) -> None:
            prog.update(task, description=f"reading log: {n:,} records")

        try:
            recs = load_log(bootstrap=None if from_file else conn.bootstrap, from_file=from_file,
                            since_ms=since_ms, progress=progress)
        except Exception as exc:
            if type(exc).__module__.startswith("kafka"):
                fail(f"cannot read Kafka at {conn.bootstrap}: {exc}", 3)
            raise
    dt = time.perf_counter() - t0
    _err().print(f"read {len(recs):,} records in {dt:.2f} s ({len(recs) / dt if dt else 0:,.0f} records/s) "
                 f"from {from_file or conn.bootstrap}", highlight=False)
    return recs


def _err() -> Any:
    from apportion.cli.main import err

    return err


def _out() -> Any:
    from apportion.cli.main import out

    return out


@log_app.command("export")
def export(
    output: Annotated[Path, typer.Option("-o", "--output", help="File to write (gzip JSON Lines).")],
    since: Annotated[Optional[str], typer.Option(help="Only records with Kafka timestamp >= this ISO time.")] = None,
    until: Annotated[Optional[str], typer.Option(help="Only records with Kafka timestamp <= this ISO time.")] = None,
    bootstrap: Bootstrap = None,
) -> None:
    """Export every apportion topic (with topic, partition, offset, key) to a compressed file."""
    from apportion.audit.source import audit_topics, write_export

    since_dt = parse_time(since) if since else None
    recs = _load(bootstrap, None, since_dt)
    if until:
        limit = parse_time(until).timestamp() * 1000
        recs = [r for r in recs if r.timestamp_ms <= limit]
    n = write_export(recs, output, topic_names=audit_topics(), exported_at=datetime.now(timezone.utc).isoformat())
    _out().print(f"wrote {n:,} records to {output}")


@audit_app.command("occupancy")
def occupancy(
    at: Annotated[str, typer.Option("--at", help="Event time to evaluate at (ISO, UTC), or 'now'.")] = "now",
    budget: Annotated[Optional[str], typer.Option("--budget", "-b", help="Only this budget and below.")] = None,
    window: Annotated[str, typer.Option(help="Window length (7d default).")] = "7d",
    bootstrap: Bootstrap = None,
    from_file: FromFile = None,
    as_json: JsonOut = False,
) -> None:
    """Rebuilt occupancy windows at event time T: share, O, U, E, r and rank per budget."""
    from apportion.audit.replay import occupancy_at
    from apportion.cli.main import _print_json, _ratio
    from apportion.durations import parse_duration
    from apportion.timeutil import to_us

    t = parse_time(at)
    recs = _load(bootstrap, from_file)
    t0 = time.perf_counter()
    snap, ranks = occupancy_at(recs, to_us(t), window_s=parse_duration(window))
    dt = time.perf_counter() - t0
    rows = [u.model_dump(mode="json") | {"rank": ranks.get(u.path)} for u in snap.budgets
            if budget is None or u.path == budget or u.path.startswith(budget + "/")]
    if as_json:
        _print_json({"at": snap.at.isoformat(), "window_s": snap.window_s, "capacity_gpus": snap.capacity_gpus,
                     "capacity_gpu_s": snap.capacity_gpu_s, "budgets": rows})
        return
    _err().print(f"replayed {len(recs):,} records in {dt:.2f} s ({len(recs) / dt if dt else 0:,.0f} events/s)")
    table = Table(title=f"occupancy at {snap.at.isoformat()} (capacity {snap.capacity_gpus} GPUs, "
                        f"K = {snap.capacity_gpu_s / 3600:.1f} GPU-h)")
    for col in ("budget", "abs share", "O GPU-h", "U GPU-h", "E GPU-h", "r", "rank"):
        table.add_column(col, justify="left" if col == "budget" else "right")
    for row in rows:
        table.add_row(row["path"], f"{row['abs_share']:.4f}", f"{row['occupancy_gpu_s'] / 3600:.2f}",
                      f"{row['unallocated_gpu_s'] / 3600:.2f}", f"{row['entitlement_gpu_s'] / 3600:.2f}",
                      _ratio(row["ratio"]), "" if row["rank"] is None else str(row["rank"]))
    _out().print(table)


@audit_app.command("preemptions")
def preemptions(
    since: Annotated[Optional[str], typer.Option(help="From this event time (ISO).")] = None,
    until: Annotated[Optional[str], typer.Option(help="Up to this event time (ISO).")] = None,
    thrash_over: Annotated[int, typer.Option(help="Flag jobs preempted more than N times.")] = 3,
    bootstrap: Bootstrap = None,
    from_file: FromFile = None,
    as_json: JsonOut = False,
) -> None:
    """Preemptions by victim and preemptor budget; protection violations (must be 0) and thrash.

    Exit code 1 when any protection violation is found.
    """
    from apportion.audit.replay import preemption_report
    from apportion.cli.main import _print_json
    from apportion.timeutil import to_us

    recs = _load(bootstrap, from_file)
    rep = preemption_report(recs, since=to_us(parse_time(since)) if since else None,
                            until=to_us(parse_time(until)) if until else None, thrash_over=thrash_over)
    if as_json:
        _print_json(rep.to_dict())
    else:
        table = Table(title=f"{rep.total} preemptions")
        for col in ("victim budget", "preempting budget", "count"):
            table.add_column(col)
        for (v, p), n in sorted(rep.pairs.items()):
            table.add_row(v, p, str(n))
        _out().print(table)
        _out().print(f"by rule: {rep.rules}")
        _out().print(f"protection violations: {len(rep.violations)}")
        _out().print(f"thrash (> {thrash_over} preemptions): {rep.thrash or 'none'}")
    if rep.violations:
        raise typer.Exit(1)


@audit_app.command("squatting")
def squatting(
    threshold: Annotated[str, typer.Option(help="Idle stretch that counts as squatting (e.g. 30m).")] = "30m",
    util_below: Annotated[float, typer.Option(help="GPU utilisation % below which a GPU is idle.")] = 5.0,
    bootstrap: Bootstrap = None,
    from_file: FromFile = None,
    as_json: JsonOut = False,
) -> None:
    """Jobs whose GPUs showed near-zero utilisation in heartbeats for longer than a threshold."""
    from apportion.audit.replay import squatting_report
    from apportion.cli.main import _print_json
    from apportion.durations import format_duration, parse_duration

    rows = squatting_report(_load(bootstrap, from_file), threshold_s=parse_duration(threshold),
                            util_below_pct=util_below)
    if as_json:
        _print_json(rows)
        return
    table = Table(title=f"squatting ({len(rows)} runs idle > {threshold})")
    for col in ("job", "attempt", "budget", "node", "idle", "since"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["job_id"], str(r["attempt"]), r["budget"], r["node_id"], format_duration(r["idle_s"]), r["since"])
    _out().print(table)


def register(app: typer.Typer) -> None:
    """Attach ``audit`` and ``log`` to the main CLI."""
    app.add_typer(audit_app, name="audit")
    app.add_typer(log_app, name="log")
