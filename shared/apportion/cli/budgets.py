"""Budget commands: ``share`` and the ``budget`` group (``set``, ``apply``, ``rm``, ``show``)."""

from __future__ import annotations

import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from apportion.cli.common import (
    DEFAULT_WAIT_S,
    Bootstrap,
    JsonOut,
    NoWait,
    RedisUrl,
    Timeout,
    Unreachable,
    _checked,
    _now,
    _print_json,
    _published,
    _ratio,
    _redis,
    _require_topics,
    _tree_from_file,
    at_seconds,
    end_offsets,
    err,
    fail,
    is_kafka_error,
    kafka_failure,
    out,
    refuse,
    report_verdict,
)
from apportion.cli.jobs import _forecast_input
from apportion.cli.lazyimport import lazy_module
from apportion.durations import format_duration, parse_duration
from apportion.settings import Connection, topic_name

if TYPE_CHECKING:
    from apportion import events
else:
    events = lazy_module("apportion.events")  # imported by the commands that use it, not by their --help

budget_app = typer.Typer(help="Show and change the budget tree (ops).", no_args_is_help=True)


def share_data(rc: Any) -> dict[str, Any]:
    """What `apportion share --json` prints: ``{"meta": usage meta, "budgets": [row, ...]}`` by path.

    The rows are accounting's ``apportion:rm:budgets`` (share, abs_share, occupancy_gpu_s, unallocated_gpu_s,
    entitlement_gpu_s, ratio, rank; GPU-seconds over the trailing window). Used by the CLI and the web dashboard.
    """
    from apportion import readmodel

    rows = readmodel.read_hash(rc, readmodel.budgets_key())
    meta = readmodel.read_hash(rc, readmodel.usage_key()).get("meta", {})
    return {"meta": meta, "budgets": list(rows.values())}


def _stale(meta: dict[str, Any], bootstrap: str | None) -> str | None:
    """The stale read-model notice of the usage ``meta`` (:func:`apportion.readmodel.stale_notice`) against the
    log's end offsets; ``None`` when it is fresh, has no offsets, or Kafka does not answer (nothing to compare)."""
    from apportion import readmodel

    keys = sorted(meta.get("offsets") or {})
    if not keys:
        return None
    try:
        ends = end_offsets(Connection.resolve(bootstrap=bootstrap).bootstrap, keys)
    except Unreachable:
        return None
    return readmodel.stale_notice(meta, ends)


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
    users: Annotated[
        bool,
        typer.Option(
            "--users",
            "-a",
            help="Under each budget, a row per user (like sshare -a): the GPU-hours their runs held over the same "
            "window (O, U) and their part of the budget's O (share), as `apportion usage --by-user` counts them.",
        ),
    ] = False,
    as_json: JsonOut = False,
) -> None:
    """The budget tree with share, occupancy, unallocated use, entitlement, r and rank (like sshare).

    O, U and E are GPU-hours over the trailing window; r = O / E, lower is served first. With --users, each
    budget's users under it: O and U their runs held, share their part of the budget's O (read from the log
    at the table's time).

    With --forecast 7d: r/rank of every budget each --step from now (read from the log), and from when each leaf
    is behind enough to preempt another budget's runs once their protection ends (r lower by at least delta at
    their common ancestor, the other holding allocated GPUs).

    Examples:

      apportion share
      apportion share --users            (each budget's users, like sshare -a)
      apportion share --forecast 7d      (each budget's r and rank for a week)
    """
    if forecast_ is not None:
        if users:
            fail("--users shows the table now; it does not go with --forecast")
        _share_forecast(forecast_, step, at, bootstrap, from_file, as_json)
        return
    data = share_data(_redis(redis_url))
    meta, rows = data["meta"], {row["path"]: row for row in data["budgets"]}
    data["stale"] = _stale(meta, bootstrap)
    people = _users_of(meta, bootstrap) if users and rows else {}
    if users:
        data["users"] = [u.to_dict() for us in people.values() for u in us]
    if as_json:
        _print_json(data)
        return
    if data["stale"]:
        out.print(f"note: {data['stale']}", highlight=False, soft_wrap=True)
    if not rows:
        out.print("no occupancy snapshot yet (is the accounting service running?)")
        return
    t = Table(
        title=f"fair share at {at_seconds(meta.get('at'))} (window {format_duration(float(meta.get('window_s', 0)))}, "
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
        _user_rows(t, people.pop(path, []), depth + 1)
    for path, gone in people.items():  # runs of a budget no longer in the tree, still in the window
        t.add_row(f"{path} (not in the tree)", "", "", "", "", "", "", "")
        _user_rows(t, gone, 1)
    out.print(t)
    if users:
        out.print("users: under their budget; share: their part of its O", highlight=False)


def _users_of(meta: dict[str, Any], bootstrap: str | None) -> dict[str, list[Any]]:
    """``share --users``: each budget's user rows of :func:`apportion.domain.user_usage.usage_by_user` over the
    read model's window at its time (``meta``: ``window_s``, ``at``), most allocated GPU-hours first."""
    from datetime import datetime

    from apportion.cli.history import logged_usage
    from apportion.timeutil import WEEK_S, to_us

    at = meta.get("at")
    rows = logged_usage(
        bootstrap, float(meta.get("window_s") or WEEK_S), to_us(datetime.fromisoformat(at)) if at else None
    )
    people: dict[str, list[Any]] = {}
    for u in rows:
        if u.user:
            people.setdefault(u.budget, []).append(u)
    return people


def _user_rows(t: Table, users: list[Any], depth: int) -> None:
    """A row per user of a budget in ``share --users``: name, its part of the budget's O, its O and U."""
    for u in users:
        share = f"{100 * u.share_of_budget:.0f}%"
        gpu_h = (f"{u.allocated_gpu_h:.1f}", f"{u.unallocated_gpu_h:.1f}")
        t.add_row("  " * depth + u.user, share, "", *gpu_h, "", "", "")


def _share_forecast(
    span: str, step: str, at: str | None, bootstrap: str | None, from_file: Path | None, as_json: bool
) -> None:
    """``share --forecast``: :func:`apportion.forecast.budget_forecast` of the log, as a table or ``--json``."""
    from apportion.audit.replay import decoded
    from apportion.cli.audit import _dur
    from apportion.forecast import budget_forecast, user_history

    days, step_s = _dur(span, "--forecast") / 86_400, _dur(step, "--step")
    if days <= 0 or step_s <= 0:
        fail("--forecast and --step must be longer than 0")
    recs, cfg, state, now = _forecast_input(bootstrap, from_file, at)
    fc = budget_forecast(state, now, cfg, days=days, step_s=step_s, history=user_history(decoded(recs)))
    if as_json:
        _print_json(fc.to_dict())
        return
    out.print(forecast_table(fc, now, step_s, out.width))


def forecast_table(fc: Any, now: int, step_s: float, width: int) -> Any:
    """``share --forecast``'s table of :func:`apportion.forecast.budget_forecast`'s ``fc`` for a terminal
    ``width`` wide, with no cell cut (:func:`apportion.cli.common.fitted_table`): budget (indented by depth),
    r/rank now and at each step, and when it can first preempt; where a row does not fit, the latest step, then
    the one before, ..., then the preempting time leave the table for a line per budget after it
    (``lab/nlp: +6d 0.812/2, +7d 0.900/2``)."""
    from rich.console import Group
    from rich.text import Text

    from apportion.cli.common import Column, fitted_table, left_out
    from apportion.forecast import iso_seconds
    from apportion.timeutil import from_us

    def at_step(i: int) -> Column:
        def cell(path: str) -> str:
            p = fc.points[path][i]
            return _ratio(p.ratio) + ("" if p.rank is None else f"/{p.rank}")

        return (f"+{format_duration(i * step_s)}" if i else "now", {"justify": "right"}, cell)

    def preempting(path: str) -> str:
        first = fc.first_preempting(path)
        return "-" if first is None else from_us(first.at_us).isoformat()[5:16].replace("T", " ")

    steps = [at_step(i) for i in range(len(fc.times))]
    columns: list[Column] = [
        ("budget", {}, lambda path: "  " * path.count("/") + path.rsplit("/", 1)[-1]),
        *steps,
        ("can preempt from", {}, preempting),
    ]
    paths = list(fc.points)
    t, moved = fitted_table(
        f"r/rank from {iso_seconds(now)}, every {format_duration(step_s)}",
        columns,
        paths,
        width,
        [c[0] for c in reversed(steps[1:])] + ["can preempt from"],
    )
    lines = [Text.assemble((path, "bold"), ": ", ", ".join(left_out(columns, moved, path))) for path in paths if moved]
    return Group(t, *lines)


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
        if is_kafka_error(exc):
            kafka_failure(exc, conn.bootstrap, "read from", [topic_name(topics.BUDGETS)])
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


#: ``budget set``'s fields in the order its message names them, each with how a value reads.
_SET_FIELDS: tuple[tuple[str, str, Any], ...] = (
    ("share", "share", lambda v: f"{v:g}"),
    ("members", "members", lambda v: ",".join(sorted(v)) or "none"),
    ("max_min_runtime_s", "max min runtime", format_duration),
    ("default_time_limit_s", "default time limit", format_duration),
    ("max_time_limit_s", "max time limit", format_duration),
    ("preempt_idle_after_s", "preempt idle after", format_duration),
)


def budget_set_message(ev: Any, current: Any) -> str:
    """What ``budget set`` says it did: ``budget P created: <every field set>`` for a new budget, else
    ``budget P set: <each field whose value changed>`` (``no change`` when none did). A field set to inherit
    reads ``inherited``."""

    def text(name: str, show: Any) -> str:
        value = getattr(ev, name)
        return "inherited" if value is None else show(value)

    if current is None:
        done = [f"{label} {text(n, show)}" for n, label, show in _SET_FIELDS if getattr(ev, n) is not None]
        return f"budget [bold]{ev.path}[/] created: {', '.join(done)}"

    def before(name: str) -> Any:
        value = getattr(current, name)
        return tuple(sorted(value)) if isinstance(value, frozenset) else value

    changed = [f"{label} {text(n, show)}" for n, label, show in _SET_FIELDS if getattr(ev, n) != before(n)]
    return f"budget [bold]{ev.path}[/] set: {', '.join(changed) or 'no change'}"


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
    e.g. siblings summing above 1, or a new budget under a leaf that queued or
    running jobs charge: only leaves take jobs), then published, then the policy's
    verdict is awaited (exit 1 when it rejects, 3 when it does not answer).

    Examples:

      apportion budget set lab/vision --share 0.4
      apportion budget set lab/vision/new --share 0.5 --members carol,dan
      apportion budget set lab/vision --max-time-limit 2d --default-time-limit 8h
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
        field = ".".join(str(p) for p in e["loc"])
        fail(f"invalid budget: {SET_OPTIONS.get(field, field)}: {e['msg']}")
    except ValueError as exc:
        fail(str(exc))
    try:
        after = tree.apply(ev)
    except BudgetError as exc:
        refuse(f"refused: {exc.reason}: {exc.message}", as_json=as_json, reason=exc.reason, path=path)
    parent = parent_of(path)
    if current is None and parent is not None and tree.get(parent) is not None and tree.is_leaf(parent):
        # its first child makes the parent an inner budget, which no job can charge: not while jobs charge it
        waiting = _jobs_of(redis_url, parent)
        if waiting:
            refuse(
                f"refused: in_use: {parent} is a leaf with {_job_counts(waiting)} job(s) "
                f"({_some_ids(waiting)}): a budget with queued or running jobs cannot get children "
                f"({path}); let them end or cancel them first",
                as_json=as_json,
                reason="in_use",
                path=path,
                parent=parent,
                jobs=sorted(str(j.get("job_id")) for j in waiting),
            )
    above = after.max_min_runtime_s(parent_of(path)) if parent_of(path) else None
    if ev.max_min_runtime_s is not None and above is not None and ev.max_min_runtime_s > above:
        err.print(  # a limit is inherited, not capped: say what the change means rather than hide it
            f"note: {path}'s max min runtime {format_duration(ev.max_min_runtime_s)} is above its parent "
            f"{parent_of(path)}'s effective {format_duration(above)}: it overrides the parent's for {path} and below",
            highlight=False,
            soft_wrap=True,
        )
    if ev.max_min_runtime_s == 0 and (current is None or current.max_min_runtime_s != 0):
        err.print(  # legal (D1.unallocated-job: min runtime 0), but it turns every allocated submission away
            f"note: with max min runtime 0s, {path} takes only unallocated work: jobs with min runtime 0 "
            "(free, preemptible at any time); allocated jobs are rejected",
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
        budget_set_message(ev, current),
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
            kafka_failure(exc, conn.bootstrap, "publish to", [topic_name(BUDGETS)])
        raise
    if no_wait:
        _published(evts, as_json, message + " (not waiting for the policy's verdict)")
        return
    got = _checked(lambda: verdicts.budget_verdicts(conn.bootstrap, list(zip(evts, offsets, strict=True)), timeout))
    rejected = [v for v in got if v.state == "rejected"]
    folded = None
    if read_model and not rejected and all(v.state == "accepted" for v in got):
        folded = _await_read_model(redis_url, max(offsets), end - time.monotonic())
    silent = any(v.state == "no_verdict" for v in got)
    error, code = None, 1
    if rejected:
        v = rejected[0]
        more = f" (and {len(rejected) - 1} more)" if len(rejected) > 1 else ""
        what = v.message if v.failures else f"{v.event.path}: {v.reason}: {v.message}"  # a batch's names each path
        error = f"refused by the policy: {what}{more}"
    elif silent:
        error, code = f"no verdict from the policy within {timeout:g} s (is it running?); the change is in the log", 3
    report_verdict(
        {
            "ok": not rejected and not silent,
            "verdict": "rejected" if rejected else "no_verdict" if silent else "accepted",
            "reason": rejected[0].reason if rejected else "",
            "published": [events.to_dict(e) for e in evts],
            "verdicts": [v.to_dict() for v in got],
            "read_model": folded,
        },
        error,
        code,
        as_json=as_json,
    )
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

    Examples:

      apportion budget apply infra/budgets/example.yaml --dry-run
      apportion budget apply tree.yaml --prune
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


def _jobs_of(redis_url: str | None, path: str) -> list[dict[str, Any]]:
    """The queued or running jobs that charge budget ``path`` (the dispatcher's jobs read model), by job id."""
    from apportion import readmodel

    jobs = readmodel.read_hash(_redis(redis_url), readmodel.jobs_key()).values()
    return [j for j in jobs if j.get("budget") == path]


def _job_counts(jobs: list[dict[str, Any]]) -> str:
    """``1 pending, 2 running``: the jobs counted by state, states in name order."""
    states: dict[str, int] = {}
    for j in jobs:
        states[str(j.get("state"))] = states.get(str(j.get("state")), 0) + 1
    return ", ".join(f"{n} {s}" for s, n in sorted(states.items()))


def _some_ids(jobs: list[dict[str, Any]], most: int = 5) -> str:
    """The jobs' ids in order, the first ``most`` of them and how many more."""
    ids = sorted(str(j.get("job_id")) for j in jobs)
    return ", ".join(ids[:most]) + (f" and {len(ids) - most} more" if len(ids) > most else "")


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
    running jobs (the dispatcher's jobs read model).

    Examples:

      apportion budget rm lab/vision/old
    """
    from apportion.domain.budgets import BudgetError

    tree = _tree_in_force(bootstrap)
    in_use = _jobs_of(redis_url, path)
    ev = events.BudgetRemoved(path=path, by="cli", ts=_now(), producer="cli")
    try:
        tree.apply(ev, in_use=frozenset({path}) if in_use else frozenset())
    except BudgetError as exc:
        msg = f"{path!r} has {_job_counts(in_use)} job(s)" if exc.reason == "in_use" else exc.message
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
            "default_time_limit_s": tree.time_limits_s(p)[0],
            "max_time_limit_s": tree.time_limits_s(p)[1],
            "preempt_idle_after_s": tree.preempt_idle_after_s(p),
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
    for line in limit_lines(rows) + unallocated_only_lines(rows):
        out.print(wrap_note(line, out.width), highlight=False, soft_wrap=True)


#: The widest a note under a table is, on any terminal (narrower terminals: their width).
NOTE_WIDTH = 80


def wrap_note(line: str, width: int) -> str:
    """``line`` wrapped at spaces within ``min(width, NOTE_WIDTH)`` columns, its continuation lines indented by
    two spaces so that each note reads as one."""
    return textwrap.fill(line, min(width, NOTE_WIDTH), subsequent_indent="  ", break_on_hyphens=False)


def unallocated_only_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Under ``budget show``'s table, a line per budget whose max min runtime in force is 0 and whose parent's is
    not: it (and every budget below it, which inherits the limit) takes only unallocated work (D1.unallocated-job),
    since any allocated job's minimum runtime is above 0."""
    by_path = {r["path"]: r for r in rows}
    lines = []
    for r in rows:
        parent = by_path.get(r["path"].rpartition("/")[0], {})
        if r["max_min_runtime_s"] == 0 and parent.get("max_min_runtime_s") != 0:
            below = "" if r.get("leaf", True) else " and every budget below it"
            lines.append(
                f"{r['path']}{below}: max min runtime 0s: takes only unallocated work (jobs with min runtime 0, "
                "free and preemptible at any time)"
            )
    return lines


#: A ``BudgetSet`` field -> the ``budget set`` option that sets it, for errors in the user's own words.
SET_OPTIONS = {
    "share": "--share",
    "max_min_runtime_s": "--max-min-runtime",
    "default_time_limit_s": "--default-time-limit",
    "max_time_limit_s": "--max-time-limit",
    "preempt_idle_after_s": "--preempt-idle-after",
}


def limit_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Under ``budget show``'s table, a line per budget whose time limits or idle preemption differ from its
    parent's (set there, inherited below it): ``lab/x: default time limit 2h, max time limit 8h, preempt idle
    after none``."""
    fields = (
        ("default_time_limit_s", "default time limit"),
        ("max_time_limit_s", "max time limit"),
        ("preempt_idle_after_s", "preempt idle after"),
    )
    by_path = {r["path"]: r for r in rows}
    lines = []
    for r in rows:
        parent = by_path.get(r["path"].rpartition("/")[0], {})
        if any(r[f] != parent.get(f) for f, _ in fields):
            said = [f"{name} {format_duration(r[f]) if r[f] is not None else 'none'}" for f, name in fields]
            lines.append(f"{r['path']}: {', '.join(said)}")
    return lines
