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
from typing import Annotated, Any

import typer
from rich.table import Table

from apportion import events
from apportion.cli import budgets, jobs, nodes
from apportion.cli.budgets import budget_app, share_data
from apportion.cli.common import (
    Bootstrap,
    Column,
    JsonOut,
    OneLineErrors,
    _checked,
    _print_json,
    _require_topics,
    fail,
    fitted_table,
    json_errors,
    left_out,
    out,
)
from apportion.cli.jobs import QUEUE_WIDE, queue_rows
from apportion.cli.nodes import node_rows
from apportion.settings import topic_name, topic_prefix

app = typer.Typer(
    name="apportion",
    cls=OneLineErrors,
    help=(
        "Budgeted, hierarchical fair-share GPU scheduling.\n\n"
        "Researchers: `keys init`, `submit`, `cancel`, `hold`, `release`, `queue`, `forecast`, `history`, `logs`, "
        "`share`, `usage`, `top` (requests are signed with your key). Ops: `nodes`, `drain`, `cordon`, `undrain`, "
        "`budget`, `audit`, `log`, `deadletter`, `keys register`. Everyone: `simulate`, `whatif`, `schemas`, "
        "`stack` (a local stack in one command).\n\n"
        "Change commands wait for the owning service's verdict. Exit codes: 0 done, 1 refused or not found, "
        "2 bad input, 3 stack unreachable or no verdict in time (docs/operations.md).\n\n"
        "Jobs with --min-runtime > 0 are charged to their budget and protected from preemption "
        "for that long; --min-runtime 0 runs unallocated: free, on idle GPUs, preempted first."
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


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
    out.print(deadletter_table(rows, out.width))


def deadletter_table(rows: list[dict[str, Any]], width: int) -> Any:
    """``deadletter``'s table of its rows for a terminal ``width`` wide: time (UTC; ``MM-DD HH:MM:SS`` below
    :data:`~apportion.cli.jobs.QUEUE_WIDE` columns), by, topic[partition]@offset, key, reason. No cell is cut:
    when a row does not fit, the reason, then the key, then the producer leave the table for a line per letter
    after it (``topic[partition]@offset: key K; reason``), wrapped at word boundaries."""
    from rich.console import Group
    from rich.text import Text

    wide = width >= QUEUE_WIDE

    def where(r: dict[str, Any]) -> str:
        return f"{r['topic']}[{r['partition'] if r['partition'] is not None else '?'}]@{r['offset']}"

    columns: list[Column] = [
        ("time (UTC)", {}, lambda r: (r["ts"][:19] if wide else r["ts"][5:19]).replace("T", " ")),
        ("by", {}, lambda r: r["producer"]),
        ("topic[partition]@offset", {}, where),
        ("key", {}, lambda r: str(r["key"] or "-")),
        ("reason", {}, lambda r: r["error"]),
    ]
    t, moved = fitted_table(
        f"dead letters ({len(rows)})",
        columns,
        rows,
        width,
        ("reason", "key", "by"),
    )
    lines = [
        Text.assemble((where(r), "bold"), ": ", "; ".join(left_out(columns, moved, r, bare=("reason",))))
        for r in (rows if moved else ())
    ]
    return Group(t, *lines)


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


__all__ = ["app", "main", "node_rows", "queue_rows", "share_data"]  # the dashboard reads the last three from here

app.add_typer(budget_app, name="budget")
# the order here is the order `apportion --help` lists them
app.command()(jobs.submit)
app.command()(jobs.cancel)
app.command()(jobs.hold)
app.command()(jobs.release)
app.command()(jobs.queue)
app.command()(jobs.forecast)
app.command()(budgets.share)
app.command()(nodes.top)
app.command()(deadletter)
app.command()(nodes.nodes)
app.command()(nodes.drain)
app.command()(nodes.cordon)
app.command()(nodes.undrain)
app.command("schemas")(schemas_)


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

    from apportion.settings import StackStopped, apply_stack_prefix

    try:
        applied = apply_stack_prefix()
    except StackStopped:  # no namespace to bring; a command that needs the stack says so, one offline runs
        applied = None
    if applied is not None:  # the namespace of the stack found: for this command only
        ctx.call_on_close(lambda: os.environ.pop("APPORTION_TOPIC_PREFIX", None))
    ctx.call_on_close(lambda: json_errors(False))  # a command's ``--json`` turns JSON errors on for it alone


def main() -> None:
    """Console entry point."""
    app()


if __name__ == "__main__":
    main()
