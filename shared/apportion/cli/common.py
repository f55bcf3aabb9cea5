"""What every command of the CLI shares: output, exit codes, and the first checks against Kafka.

Exit codes: 0 done, 1 refused or names nothing that exists (:func:`refuse`), 2 bad input (:func:`fail`), 3 the
stack is unreachable (:class:`Unreachable`, :func:`checked`). The command modules (:mod:`apportion.cli.main`,
``jobs``, ``budgets``, ``nodes``, ``history``, ``audit``, ``keys``, ``simulate``, ``verdicts``) import from here; this
module imports none of them. The option types every command shares (``--bootstrap``, ``--redis``, ``--json``,
``--no-wait``, ``--timeout``, ``--reason``, ``--user``) live here too.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, cast

import typer
from typer.core import TyperGroup

try:  # typer vendors click from 0.2x on; before, it used click itself
    from typer._click import Context
    from typer._click.exceptions import NoArgsIsHelpError, UsageError
except ImportError:  # pragma: no cover
    from click import Context  # type: ignore[assignment]
    from click.exceptions import NoArgsIsHelpError, UsageError  # type: ignore[assignment]

from apportion.settings import Connection, StackStopped, topic_name, topic_prefix

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from apportion import events
    from apportion.identity.keys import Identity


class _Console:
    """A rich ``Console(**options)`` made on first use: rich is imported by the commands that print, not by the
    CLI's start (``apportion --help`` prints through click)."""

    def __init__(self, **options: Any) -> None:
        self._options = options
        self._console: Console | None = None
        # rich fixes a console's size from COLUMNS/LINES when it is made, else reads them at each print: the
        # size is that of the start, as when the console was made at import
        self._size = {v: int(os.environ[v]) if os.environ.get(v, "").isdigit() else None for v in ("COLUMNS", "LINES")}

    def __getattr__(self, name: str) -> Any:
        if self._console is None:
            from rich.console import Console

            self._console = Console(**self._options)
            self._console._width = self._options.get("width", self._size["COLUMNS"])
            self._console._height = self._options.get("height", self._size["LINES"])
        return getattr(self._console, name)


out: Console = cast("Console", _Console())
err: Console = cast("Console", _Console(stderr=True))


class Unreachable(RuntimeError):
    """Kafka or Redis did not answer (exit 3)."""


#: The ``verdict`` of the JSON error object :func:`fail` prints under ``--json``, by exit code.
ERROR_VERDICTS: dict[int, str] = {1: "refused", 2: "bad_input", 3: "unreachable"}
#: Whether the command running was given ``--json`` (set by the root callback, :func:`json_errors`).
_json_errors = False
#: Whether the command running has already printed its JSON object (a verdict that carries the refusal).
_json_printed = False


def json_errors(on: bool) -> None:
    """Whether :func:`fail` also prints the JSON error object on stdout: on for a command given ``--json``."""
    global _json_errors, _json_printed
    _json_errors = on
    _json_printed = False


def fail(message: str, code: int = 2) -> NoReturn:
    """Print ``error: message`` on stderr and exit with ``code``.

    Under ``--json`` (:func:`json_errors`) the same error first goes to stdout as one object,
    ``{"ok": false, "verdict": ERROR_VERDICTS[code], "reason": "", "message": message, "exit_code": code}``,
    so a script reads every failure from stdout whatever its exit code; stdout stays one JSON document: a
    command that already printed its object (a verdict naming the refusal) prints no second one.
    """
    if _json_errors and not _json_printed:
        _print_json(_error_object(message, code))
    _exit(message, code)


def _error_object(message: str, code: int, verdict: str = "", reason: str = "", **fields: Any) -> dict[str, Any]:
    return {
        "ok": False,
        "verdict": verdict or ERROR_VERDICTS.get(code, "error"),
        "reason": reason,
        "message": message,
        "exit_code": code,
        **fields,
    }


def _exit(message: str, code: int) -> NoReturn:
    from rich.text import Text

    # the message carries what was given (a job id, a budget path): plain text, never rich markup
    err.print(Text.assemble(("error:", "bold red"), f" {message}"), highlight=False, soft_wrap=True)
    raise typer.Exit(code)


class OneLineErrors(TyperGroup):
    """The root command: a usage error (an option or argument Typer cannot parse, a value out of its range, an
    unknown option) is ``error: <message>; see `<command> --help```, one line on stderr, exit 2, and under
    ``--json`` the JSON error object of :func:`fail`, not Typer's boxed panel. ``--json`` counts wherever it stands
    before ``--``: a usage error can come before the eager ``--json`` option is processed."""

    def make_context(self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any) -> Any:
        readable_help(self)
        argv = list(args)
        try:
            ctx = super().make_context(info_name, args, parent, **extra)
        except UsageError as exc:
            _usage_error(exc, argv)
        ctx.meta[_ARGV] = argv
        return ctx

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except UsageError as exc:
            _usage_error(exc, ctx.meta.get(_ARGV, []))
        except StackStopped as exc:  # the stack.env found is that of a stopped stack: no address to try
            fail(str(exc), 3)


_ARGV = "apportion.argv"

#: A reStructuredText role and its target (``:func:`~apportion.x.y```), or a double-backquoted literal.
_RST_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")
_RST_LITERAL = re.compile(r"``(.+?)``", re.DOTALL)


#: A line break inside a paragraph: between two lines of text, the second not indented (an example is).
_SOFT_BREAK = re.compile(r"(?<=\S)\n(?=\S)")


#: The start of a paragraph whose first line is indented (examples): click's help printer keeps such a paragraph
#: line by line when a line of ``\b`` alone opens it, rather than wrapping it as prose.
_INDENTED_PARAGRAPH = re.compile(r"(\A|\n\n)(?=[ \t]+\S)")


def help_text(text: str) -> str:
    """A docstring as help: reStructuredText literals (````x````) and roles (``:func:`x```) as ```x```, and each
    paragraph one line, which the terminal wraps (a line wrapped at the source's width would break again
    mid-sentence at the terminal's). Blank lines between paragraphs are kept, and indented lines (examples) are
    kept line by line: their paragraph opens with click's ``\b`` line."""
    text = _SOFT_BREAK.sub(" ", _RST_LITERAL.sub(r"`\1`", _RST_ROLE.sub(r"`\1`", text)))
    return _INDENTED_PARAGRAPH.sub(lambda m: m.group(1) + "\b\n", text)


#: The last line of every command's ``--help`` (docs/operations.md, "Exit codes").
EXIT_CODES_HELP = (
    "Exit codes: 0 done, 1 refused or not found, 2 bad input, 3 stack unreachable or no verdict in time "
    "(docs/operations.md)."
)


def readable_help(command: Any) -> None:
    """Make the help of ``command`` and every command under it readable, once for the whole tree: the docstrings
    and parameter help through :func:`help_text`, no value type (``<bool>``) after a flag, which takes none,
    :data:`EXIT_CODES_HELP` at the end of each command's own, and click's plain layout: each option on its line,
    its help wrapped beside it at any width. Rich's panels cut a word that does not fit their help column with an
    ellipsis (an environment variable's name, a long option) on terminals of 80 columns. A command already made
    readable is left as it is; the commands of a lazy group (:class:`apportion.cli.main.LazyCommands`) are made
    readable as they load."""
    if getattr(command, "_readable", False):
        return
    command._readable = True
    command.rich_markup_mode = None
    if not getattr(command, "commands", None) and not getattr(command, "epilog", None):
        command.epilog = EXIT_CODES_HELP
    for attr in ("help", "short_help", "epilog"):
        if getattr(command, attr, None):
            setattr(command, attr, help_text(getattr(command, attr)))
    if getattr(command, "help", None) and not getattr(command, "short_help", None):
        command.short_help = command.help.split("\n\n", 1)[0]  # a group's list of commands shows it whole
    help_option = command.get_help_option(Context(command))  # made once and kept: the flag every command has
    if help_option is not None and help_option.default is None:
        # a flag not given is False, as click's own: Typer converts a value that is not a bool through pydantic,
        # whose import (~0.1 s) `apportion queue --help` paid for the root's --help it was not given
        help_option.default = False
    for param in (*getattr(command, "params", ()), *([help_option] if help_option is not None else [])):
        if getattr(param, "help", None):
            param.help = help_text(param.help)
        if getattr(param, "is_flag", False) and not getattr(param, "count", False):
            param.metavar = ""
    subs = getattr(command, "commands", {})
    for sub in getattr(subs, "loaded", subs).values():
        readable_help(sub)


#: Options a newcomer looks for on one command that another command has (one user's ``sshare -u`` is ``usage -u``
#: here): the usage error names the right command instead of the nearest spelling.
OPTION_ELSEWHERE = {
    ("apportion share", option): "each budget's users are `apportion share --users` (like sshare -a), one "
    "user's usage `apportion usage --user U`"
    for option in ("--user", "-u", "--by-user", "--all")
}


def _usage_error(exc: UsageError, argv: list[str]) -> NoReturn:
    if isinstance(exc, NoArgsIsHelpError):  # a group given no command: its help (the error's message), exit 2
        typer.echo(exc.format_message())
        raise typer.Exit(2)
    command = exc.ctx.command_path if exc.ctx is not None else "apportion"
    message = " ".join(exc.format_message().split()).rstrip(".")
    option = str(getattr(exc, "option_name", ""))  # a NoSuchOption's
    hint = OPTION_ELSEWHERE.get((command, option))
    if hint is not None:  # Slurm's habit: click's nearest spelling would point at an unrelated option
        message = f"No such option: {option}; {hint}"
    before_dashes = argv[: argv.index("--")] if "--" in argv else argv
    json_errors(_json_errors or "--json" in before_dashes)
    try:
        fail(f"{message}; see `{command} --help`")
    finally:
        json_errors(False)


def refuse(
    message: str, *, as_json: bool, verdict: str = "refused", reason: str = "", code: int = 1, **fields: Any
) -> NoReturn:
    """A change command's refusal: with ``--json`` first the verdict object on stdout,
    ``{"ok": false, "verdict": verdict, "reason": reason, "message": message, **fields}``; then, as
    :func:`fail`, ``error: message`` on stderr and exit ``code``.

    ``verdict`` is ``refused`` (the change breaks a rule), ``not_found`` (it names nothing that exists),
    ``rejected`` (the owning service said no) or ``no_verdict``; ``reason`` is the rule's code when there is one
    (``in_use``, ``sum_exceeds``...).
    """
    if as_json or _json_errors:
        _print_json(_error_object(message, code, verdict, reason, **fields))
    _exit(message, code)


def at_seconds(at: Any) -> str:
    """A read model's ISO time (``meta.at``) as a title prints it: ISO 8601 at whole seconds, as the forecasts'
    titles (``2026-12-07T08:41:05+00:00``); ``?`` when missing, the text itself when it is not a time."""
    from datetime import datetime

    if at is None:
        return "?"
    try:
        return datetime.fromisoformat(str(at)).isoformat(timespec="seconds")
    except ValueError:
        return str(at)


def report_verdict(doc: dict[str, Any], error: str | None = None, code: int = 1, *, as_json: bool) -> None:
    """A change command's verdict: with ``--json``, ``doc`` (``ok``, ``verdict``, ``reason``, what was published) on
    stdout, and when the change failed (``error``) also its ``message`` and ``exit_code``, as every JSON error
    carries them (:func:`fail`); then, on a failure, ``error: <error>`` on stderr and exit ``code``."""
    if as_json:
        _print_json({**doc, "message": error, "exit_code": code} if error is not None else doc)
    if error is not None:
        fail(error, code)


def _print_json(obj: Any) -> None:
    global _json_printed
    _json_printed = True

    def default(o: Any) -> Any:
        if isinstance(o, float) and math.isinf(o):
            return "Infinity"
        return str(o)

    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True, default=default) + "\n")


def _ratio(r: Any) -> str:
    """A usage ratio r for a table: 3 decimals, ``inf``, ``-`` for none; from 1e6 up in 3 significant digits
    (``1.23e+299``), so a budget with a tiny share does not print a 300-digit number."""
    if r is None:
        return "-"
    r = float(r)
    if math.isinf(r):
        return "inf"
    return f"{r:.3f}" if abs(r) < 1e6 else f"{r:.3g}"


#: What a terminal acts on rather than shows: the C0 and C1 controls (escape, newline, bell...), DEL, and the
#: bidirectional overrides and isolates, which reorder the text around them.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(value: str) -> str:
    """``value`` with each character a terminal would act on written as its Python escape (``\\x1b``, ``\\n``).

    Tables and the lines under them show text others chose: a hold's ``--reason``, a job id a producer other than
    this CLI wrote (the event contract takes any string). An escape sequence there (clear the screen, set the
    window's title) or a newline (a forged line) is shown, never obeyed; ``--json`` keeps the values as they are.
    """
    return _UNPRINTABLE.sub(lambda m: repr(m.group())[1:-1], value)


#: A table column: its title, rich's column options, and its cell of a row.
Column = tuple[str, dict[str, Any], Callable[[Any], str]]


def fitted_table(
    title: str, columns: Sequence[Column], rows: Sequence[Any], width: int, movable: Sequence[str]
) -> tuple[Table, list[str]]:
    """A table of ``rows`` no wider than ``width`` columns whose cells are never cut: the columns titled in
    ``movable`` leave it, in that order, until it fits (or none is left to move). Returns the table and the titles
    of the columns left out, whose values the caller prints elsewhere (:func:`left_out`, a line per row after the
    table). Columns are ``no_wrap`` unless their options say otherwise; titles and cells are plain text, not
    markup (``topic[partition]`` is no style); a rule under the header, no edges, two spaces between columns."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    moved: list[str] = []
    while True:
        t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, collapse_padding=True)
        shown = [c for c in columns if c[0] not in moved]
        for name, opts, _ in shown:
            options: dict[str, Any] = {"no_wrap": True, **opts}
            t.add_column(Text(name), **options)
        for r in rows:
            t.add_row(*(Text(printable(cell(r))) for _, _, cell in shown))
        left = [m for m in movable if m not in moved]
        if not left or natural_width(t) <= width:
            return t, moved
        moved.append(left[0])


def left_out(columns: Sequence[Column], moved: Sequence[str], row: Any, *, bare: Sequence[str] = ()) -> list[str]:
    """``title value`` of each column of ``row`` that :func:`fitted_table` left out, in column order; the value
    alone for a column titled in ``bare``."""
    return [
        printable(cell(row)) if name in bare else f"{name} {printable(cell(row))}"
        for name, _, cell in columns
        if name in moved
    ]


def natural_width(renderable: Any) -> int:
    """The width ``renderable`` takes when nothing limits it (a console's own measure stops at its width)."""
    from rich.console import Console

    wide = Console(width=100_000)
    return int(wide.measure(renderable).maximum)


def check_budget_filter(budget: str | None) -> None:
    """Exit 2 when a ``--budget`` filter is not a well-formed budget path (it could match no job)."""
    from apportion.domain.budgets import BudgetError, validate_path

    if budget is not None:
        try:
            validate_path(budget)
        except BudgetError as exc:
            fail(f"--budget: {exc.message}")


def _tree_from_file(path: Path) -> Any:
    """The :class:`BudgetTree` of budget file ``path`` (:mod:`apportion.budgetfile`); a bad file is one line, exit 2."""
    from apportion.budgetfile import BudgetFileError, load_budget_tree

    try:
        return load_budget_tree(path)
    except BudgetFileError as exc:
        fail(str(exc))


def refused_topics(exc: BaseException, topics: Sequence[str] = ()) -> list[str]:
    """The topics an ACL refusal names: those the error carries (kafka-python raises
    ``TopicAuthorizationFailedError`` with the topic, or the set of topics, it was refused), else ``topics``."""
    named = exc.args[0] if type(exc).__name__ == "TopicAuthorizationFailedError" and exc.args else None
    if isinstance(named, str):
        return [named]
    if isinstance(named, (set, frozenset, list, tuple)) and named and all(isinstance(t, str) for t in named):
        return sorted(named)
    return sorted(set(topics))


def kafka_failure(exc: BaseException, bootstrap: str, doing: str, topics: Sequence[str] = ()) -> NoReturn:
    """Report a kafka error met while ``doing`` (e.g. ``publish to``) on ``topics``: the broker's ACLs refusing the
    principal (an ``...AuthorizationFailedError``) is a refusal naming the topics refused
    (:func:`refused_topics`), exit 1, reason ``not_authorized``; anything else means the stack is unreachable,
    exit 3."""
    if type(exc).__name__.endswith("AuthorizationFailedError"):
        from apportion.bus.security import kafka_user

        who = kafka_user() or "the anonymous principal"
        named = refused_topics(exc, topics)
        what = ", ".join(named) if named else "it"
        extra: dict[str, Any] = {"topics": named} if named else {}
        refuse(
            f"refused: not authorized: the broker's ACLs do not let {who} {doing} {what} ({type(exc).__name__}); "
            "see docs/security.md for who may do what",
            as_json=False,
            reason="not_authorized",
            **extra,
        )
    fail(f"cannot {doing} Kafka at {bootstrap}: {exc} (is the stack up? `apportion stack up`)", 3)


def _publish(evts: list[events.Event], bootstrap: str | None) -> None:
    from apportion import client

    try:
        client.publish(*evts, bootstrap=bootstrap)
    except Exception as exc:  # kafka errors have many types; report them plainly
        if is_kafka_error(exc):
            kafka_failure(exc, Connection.resolve(bootstrap=bootstrap).bootstrap, "publish to")
        raise


def _published(evts: list[events.Event], as_json: bool, message: str) -> None:
    """Report published events: ``message`` for people, or ``{"published": [event, ...]}`` with ``--json``."""
    from apportion import events

    if as_json:
        _print_json({"published": [events.to_dict(e) for e in evts]})
    else:
        out.print(message, soft_wrap=True)


def _checked(fn: Any) -> Any:
    """Run ``fn()``; an unreachable Kafka (:class:`Unreachable` or a kafka error) exits 3 with one line."""
    try:
        return fn()
    except Unreachable as exc:
        fail(f"{exc} (is the stack up? `apportion stack up`)", 3)
    except Exception as exc:
        if is_kafka_error(exc):
            kafka_failure(exc, Connection.resolve().bootstrap, "read from")
        raise


def _require_topics(bootstrap: str | None, *names: str) -> Connection:
    """The connection, after checking Kafka answers and the namespace has ``names`` (else one line, exit 3; a topic
    the broker's ACLs do not let the principal describe is a refusal, :func:`kafka_failure`, exit 1)."""
    conn = Connection.resolve(bootstrap=bootstrap)
    for name in names:
        if _checked(lambda n=name: partitions_of(conn.bootstrap, n)) == 0:
            if _hidden(conn.bootstrap, name):
                from kafka.errors import TopicAuthorizationFailedError

                kafka_failure(TopicAuthorizationFailedError(name), conn.bootstrap, "read from")
            ns = f"namespace {topic_prefix()!r}" if topic_prefix() else "the default namespace"
            fail(
                f"topic {name} does not exist at {conn.bootstrap}: {ns} is not provisioned "
                f"(`python -m apportion.bus.provision --bootstrap {conn.bootstrap}`, or `apportion stack up`)",
                3,
            )
    return conn


def _hidden(bootstrap: str, name: str) -> bool:
    """Whether topic ``name``, left out of the topics the principal may list, exists but its ACLs hide it.

    The broker answers "not authorized" for a topic the principal may not describe whether or not it exists, and
    the ACLs are granted per namespace: so the topic is taken as hidden when the namespace's submissions topic,
    which every user of the CLI may read, is listed (the namespace is provisioned), else as not provisioned.
    """
    from kafka.errors import TopicAuthorizationFailedError

    from apportion import topics

    submissions = topic_name(topics.SUBMISSIONS)
    return (
        name != submissions
        and _checked(lambda: topic_error(bootstrap, name)) == TopicAuthorizationFailedError.errno
        and _checked(lambda: partitions_of(bootstrap, submissions)) > 0
    )


def is_kafka_error(exc: BaseException) -> bool:
    """True for the exceptions kafka-python raises (they have many types)."""
    return type(exc).__module__.startswith("kafka")


def _consumer(bootstrap: str) -> Any:
    """A reader of the log (:func:`apportion.client.log_reader`) whose iteration ends after a second without
    records."""
    from apportion.client import log_reader

    return log_reader(bootstrap, consumer_timeout_ms=1000)


def partitions_of(bootstrap: str, topic: str) -> int:
    """Number of partitions of ``topic``; 0 when it does not exist (an unprovisioned namespace).

    Raises:
        Unreachable: Kafka did not answer.
    """
    return int(_ask(bootstrap, lambda kc: len(kc.partitions_for_topic(topic) or ()) if topic in kc.topics() else 0))


def topic_error(bootstrap: str, topic: str) -> int:
    """The broker's error code for ``topic`` when asked about it alone: 0 none, 3 it does not exist,
    29 (``TopicAuthorizationFailedError.errno``) the principal may not describe it (whether or not it exists).

    Raises:
        Unreachable: Kafka did not answer.
    """
    return int(_ask(bootstrap, lambda admin: admin.describe_topics([topic])[0]["error_code"], client=_admin))


def _admin(bootstrap: str) -> Any:
    """An admin client of ``bootstrap`` (:func:`apportion.bus.clients.kafka_admin`: one that cannot start leaves no
    network thread running)."""
    from apportion.bus.clients import kafka_admin
    from apportion.bus.security import kafka_auth

    return kafka_admin(bootstrap_servers=bootstrap, request_timeout_ms=10_000, **kafka_auth())


def _ask(bootstrap: str, question: Any, client: Any = _consumer) -> Any:
    """``question(consumer)`` on a short-lived consumer of ``bootstrap`` (or another ``client(bootstrap)``), closed
    after.

    Raises:
        Unreachable: Kafka did not answer.
    """
    try:
        kc = client(bootstrap)
        try:
            return question(kc)
        finally:
            kc.close()
    except Exception as exc:
        if is_kafka_error(exc):
            raise Unreachable(f"cannot reach Kafka at {bootstrap}: {exc}") from exc
        raise


def end_offsets(bootstrap: str, keys: list[str]) -> dict[str, int]:
    """The log's end offset of each ``"topic:partition"`` of ``keys``.

    Raises:
        Unreachable: Kafka did not answer.
    """
    from kafka import TopicPartition

    from apportion.bus.reader import tp_of_key

    tps = {k: TopicPartition(*tp_of_key(k)) for k in keys}
    ends = _ask(bootstrap, lambda kc: kc.end_offsets(list(tps.values()))) if tps else {}
    return {k: int(ends.get(tp, 0)) for k, tp in tps.items()}


Bootstrap = Annotated[
    str | None, typer.Option("--bootstrap", help="Kafka bootstrap (host:port).", envvar="APPORTION_KAFKA_BOOTSTRAP")
]
RedisUrl = Annotated[str | None, typer.Option("--redis", help="Redis URL.", envvar="APPORTION_REDIS_URL")]


def _json_on(on: bool) -> bool:
    json_errors(bool(on))
    return on


def json_option(help: str = "Print JSON for scripts instead of a table.") -> Any:
    """Every command's ``--json``: parsed first, it also makes the command's errors JSON (:func:`fail`)."""
    return typer.Option("--json", help=f"{help} Errors too: an object on stdout.", is_eager=True, callback=_json_on)


JsonOut = Annotated[bool, json_option()]
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
        if is_kafka_error(exc):
            kafka_failure(
                exc,
                Connection.resolve(bootstrap=bootstrap).bootstrap,
                "register the development keyring's operator key (signing requests on nodes) at"
                if ops
                else f"register {user}'s key at"
                if user
                else "register your key at",
            )
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
