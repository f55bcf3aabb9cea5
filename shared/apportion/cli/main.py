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

import importlib
import importlib.util
import sys
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Annotated, Any

import typer

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
from apportion.settings import topic_name, topic_prefix

if TYPE_CHECKING:
    import click

#: Every command of ``apportion``, in the order ``apportion --help`` lists them: the module that defines it,
#: the name there (``register``: the module's ``register(app)`` adds it), and the line ``--help`` lists it with
#: (its help's first paragraph; tests/unit/test_cli_startup.py checks each against the command's own). A command
#: is imported when it runs or its own help is asked: the CLI's start imports neither the domain, the events'
#: models, Kafka nor rich (``apportion --help`` in docs/performance.md).
COMMANDS: dict[str, tuple[str, str, str]] = {
    "submit": ("apportion.cli.jobs", "submit", "Submit a job."),
    "cancel": (
        "apportion.cli.jobs",
        "cancel",
        "Cancel a pending or running job and wait for the dispatcher's JobCancelled.",
    ),
    "hold": (
        "apportion.cli.jobs",
        "hold",
        "Hold a pending job: it stays queued in its place (its submission time kept) and is never placed until "
        "`apportion release`. Waits for the dispatcher's JobHeld.",
    ),
    "release": (
        "apportion.cli.jobs",
        "release",
        "Release a held job back into its budget's fair-share order. Waits for the dispatcher's JobReleased.",
    ),
    "queue": (
        "apportion.cli.jobs",
        "queue",
        "Jobs in the queue (like squeue): position, budget, user, GPUs, state, start time, nodes or pending reason.",
    ),
    "forecast": (
        "apportion.cli.jobs",
        "forecast",
        "When pending jobs will start: the scheduling engine run forward from the log (like squeue --start).",
    ),
    "share": (
        "apportion.cli.budgets",
        "share",
        "The budget tree with share, occupancy, unallocated use, entitlement, r and rank (like sshare).",
    ),
    "top": (
        "apportion.cli.nodes",
        "top",
        "Live view: the budget tree (share, occupancy, r, rank, jobs), the head of the queue with its pending "
        "reasons, the idle runs (GPUs idle past their nodes' idle_after_s, as the node agents report) and the nodes "
        "(those not ready with their state), refreshed until Ctrl-C. `--json`: one frame.",
    ),
    "deadletter": (
        "apportion.cli.main",
        "deadletter",
        "Dead letters: input a service could not decode or handle, with its topic, offset, key and reason.",
    ),
    "nodes": (
        "apportion.cli.nodes",
        "nodes",
        "Nodes with state, cordon/drain reason, GPUs free/total, model, running jobs and heartbeat age.",
    ),
    "drain": (
        "apportion.cli.nodes",
        "drain",
        "Drain a node: cordon it, preempt unallocated work now, allocated work as its minimum runtime expires.",
    ),
    "cordon": (
        "apportion.cli.nodes",
        "cordon",
        "Cordon a node: no new work lands on it; running work stays. Exit 1 for an unknown or lost node.",
    ),
    "undrain": (
        "apportion.cli.nodes",
        "undrain",
        "Uncordon a cordoned, draining or drained node. Exit 1 for an unknown or lost node; 0 if already ready.",
    ),
    "schemas": (
        "apportion.cli.main",
        "schemas_",
        "The JSON Schema a producer in another language validates against (the file `schemas/TYPE.json`), or every "
        "event type with its topic and record key (docs/producing.md).",
    ),
    "simulate": (
        "apportion.cli.simulate",
        "simulate",
        "Simulate a trace under our policy and the baselines, side by side.",
    ),
    "whatif": (
        "apportion.cli.audit",
        "register",
        "Re-run the log's submissions under another budget tree and the recorded one, side by side.",
    ),
    "history": (
        "apportion.cli.history",
        "register",
        "Finished jobs, like sacct: user, state, GPUs, wait, run time, GPU-hours, end and why it ended.",
    ),
    "usage": (
        "apportion.cli.history",
        "register",
        "GPU-hours per leaf budget over the trailing window, with --by-user a row per user (like sshare -a).",
    ),
    "logs": (
        "apportion.cli.history",
        "register",
        "A job's output: the stdout (or stderr) file the node agent writes per attempt and replica.",
    ),
    "budget": ("apportion.cli.budgets", "budget_app", "Show and change the budget tree (ops)."),
    "audit": (
        "apportion.cli.audit",
        "register",
        "Replay the event log: occupancy at T, explain a job, verify live state, preemptions.",
    ),
    "log": ("apportion.cli.audit", "register", "Export the event log for offline audits."),
    "stack": (
        "apportion.cli.stack",
        "register",
        "An interactive local stack: Kafka, Redis, the four services, N simulated nodes, the web dashboard.",
    ),
    "keys": ("apportion.cli.keys", "app", "Signing keys: init (researchers), register/revoke (ops)."),
}


def load_command(name: str) -> click.Command:
    """The click command ``apportion NAME`` runs, made from the module :data:`COMMANDS` names (imported now),
    as Typer makes it for an app that registers it."""
    from typer.main import get_command

    module, attr, _ = COMMANDS[name]
    m = importlib.import_module(module)
    one = typer.Typer()
    one.callback()(_noop)  # a group even for one command: its commands are taken by name
    if attr == "register":
        m.register(one)
    elif name == "simulate":  # one command, not a group: `apportion simulate --trace ...`
        one.command(name, help=m.app.info.help)(m.simulate)
    elif isinstance(getattr(m, attr), typer.Typer):
        one.add_typer(getattr(m, attr), name=name)
    else:
        one.command(name)(getattr(m, attr))
    group: Any = get_command(one)
    return group.commands[name]


def _noop() -> None:
    """A group of commands."""


class LazyCommands(Mapping[str, "click.Command"]):
    """The root's commands by name, each imported and made on first use (:func:`load_command`), then made
    readable (:func:`apportion.cli.common.readable_help`). ``loaded`` holds those made so far; a command whose
    module is not installed is not listed."""

    def __init__(self) -> None:
        self.loaded: dict[str, click.Command] = {}
        self.names = [n for n, (module, _, _) in COMMANDS.items() if _installed(module)]

    def __getitem__(self, name: str) -> click.Command:
        if name not in self.loaded:
            if name not in self.names:
                raise KeyError(name)
            from apportion.cli.common import readable_help

            self.loaded[name] = load_command(name)
            readable_help(self.loaded[name])
        return self.loaded[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def _installed(module: str) -> bool:
    return module in sys.modules or importlib.util.find_spec(module) is not None


class LazyRoot(OneLineErrors):
    """``apportion``: the root group of :class:`~apportion.cli.common.OneLineErrors` whose commands load as they
    run (:class:`LazyCommands`); its own help lists each with its line in :data:`COMMANDS`, importing none."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        self.commands = LazyCommands()  # type: ignore[assignment]

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        import click

        lazy: Any = self.commands
        listed = {
            name: lazy.loaded.get(name) or click.Command(name, short_help=COMMANDS[name][2]) for name in lazy.names
        }
        real, lazy.loaded = lazy.loaded, listed
        try:
            super().format_commands(ctx, formatter)
        finally:
            lazy.loaded = real


app = typer.Typer(
    name="apportion",
    cls=LazyRoot,
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
    from apportion import events, topics
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

    from apportion.cli.jobs import QUEUE_WIDE

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
    from rich.table import Table

    from apportion import events
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


__all__ = ["app", "main", "node_rows", "queue_rows", "share_data"]  # noqa: F822 - the dashboard reads the last three (__getattr__)


def __getattr__(name: str) -> Any:
    """The dashboard's ``node_rows``, ``queue_rows`` and ``share_data``, imported on first use."""
    homes = {
        "node_rows": "apportion.cli.nodes",
        "queue_rows": "apportion.cli.jobs",
        "share_data": "apportion.cli.budgets",
    }
    if name in homes:
        return getattr(importlib.import_module(homes[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
