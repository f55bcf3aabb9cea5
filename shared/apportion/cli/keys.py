"""``apportion keys``: signing keys (rule D10.proven-user; :mod:`apportion.identity`).

Researchers run ``keys init`` once: it makes an Ed25519 key pair in their
identity file (``~/.config/apportion/identity.json``, mode 0600, or
``APPORTION_IDENTITY``) and prints the public key, which they hand to ops.
Ops run ``keys register USER PUBKEY`` (``--role ops`` for another operator)
and ``keys revoke USER PUBKEY``; both publish the event on ``apportion.budgets``
and exit 0 once the broker has acknowledged it (the dispatcher folds it; it
refuses nothing, so there is no verdict to wait for).

Node agents sign their reports with one key per node: ``keys init --node
NODE_ID --file DIR/NODE_ID.json`` makes it (principal ``node:NODE_ID``; the
agent reads ``APPORTION_NODE_KEY_DIR``), and ops run ``keys register
node:NODE_ID PUBKEY``.
"""

from __future__ import annotations

import getpass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from apportion.cli.common import _publish, _published, _require_topics, fail, json_option, out
from apportion.cli.lazyimport import lazy_module
from apportion.settings import topic_name

if TYPE_CHECKING:
    from apportion import events
else:
    events = lazy_module("apportion.events")  # imported by the commands that use it, not by their --help

app = typer.Typer(help="Signing keys: init (researchers), register/revoke (ops).", no_args_is_help=True)


@app.command("init")
def init_key(
    user: Annotated[str | None, typer.Option("--user", "-u", help="Who the key signs as (default: $USER).")] = None,
    role: Annotated[str, typer.Option(help="user, or ops for an operator's key.")] = "user",
    file: Annotated[Path | None, typer.Option("--file", help="Identity file (default: APPORTION_IDENTITY).")] = None,
    node: Annotated[
        str | None,
        typer.Option(
            "--node",
            help="A node agent's key for this node id (principal node:ID), in "
            "APPORTION_NODE_KEY_DIR/ID.json unless --file.",
        ),
    ] = None,
    service: Annotated[
        str | None,
        typer.Option("--service", help="A service's key (dispatcher: principal service:dispatcher); needs --file."),
    ] = None,
) -> None:
    """Make a key pair in your identity file (or a node's or service's key file); print the public key for ops."""
    import os

    from apportion.domain.admission import DISPATCHER, node_principal
    from apportion.identity.keys import Identity, identity_file, node_key_file

    if role not in ("user", "ops"):
        fail(f"--role must be user or ops, not {role!r}")
    if service is not None:
        if service != "dispatcher" or node is not None or user is not None or role != "user" or file is None:
            fail("--service dispatcher --file FILE makes the dispatcher's key (no --node, --user or --role)")
        user = DISPATCHER
    if node is not None:
        if user is not None or role != "user":
            fail("--node makes a node's key: no --user or --role with it")
        user = node_principal(node)
        if file is None:
            key_dir = os.environ.get("APPORTION_NODE_KEY_DIR")
            if not key_dir:
                fail("--node needs --file or APPORTION_NODE_KEY_DIR (the node agent's key directory)")
            file = node_key_file(Path(key_dir), node)
    path = file or identity_file()
    ident = Identity.generate(user or getpass.getuser(), role)
    try:
        ident.save(path)
    except FileExistsError:
        fail(f"{path} exists: a key is never overwritten (move it away first, and ask ops to revoke its key)", 1)
    out.print(f"identity of [bold]{escape(ident.user)}[/] ({role}) written to {escape(str(path))}")
    out.print(f"give ops this public key to register (`apportion keys register {escape(ident.user)} PUBKEY`):")
    print(ident.public_key)


@app.command("show")
def show_key(
    file: Annotated[Path | None, typer.Option("--file", help="Identity file (default: APPORTION_IDENTITY).")] = None,
) -> None:
    """Print the user, role and public key of your identity file (never the private key)."""
    from apportion.identity.keys import Identity, identity_file

    path = file or identity_file()
    try:
        ident = Identity.load(path)
    except (FileNotFoundError, ValueError) as exc:
        fail(f"{exc} (make one with `apportion keys init`)", 1)
    print(f"{ident.user}\t{ident.role}\t{ident.public_key}")


def _publish_identity_event(ev: events.Event, bootstrap: str | None, as_json: bool, message: str) -> None:
    from apportion.topics import BUDGETS

    _require_topics(bootstrap, topic_name(BUDGETS))
    _publish([ev], bootstrap)
    _published([ev], as_json, message)


@app.command("register")
def register_key(
    user: Annotated[str, typer.Argument(help="The user the key proves.")],
    public_key: Annotated[str, typer.Argument(help="Base64 Ed25519 public key (from `apportion keys init`).")],
    role: Annotated[str, typer.Option(help="user, or ops (may cancel any job).")] = "user",
    bootstrap: Annotated[str | None, typer.Option("--bootstrap", envvar="APPORTION_KAFKA_BOOTSTRAP")] = None,
    as_json: Annotated[bool, json_option("Print JSON for scripts.")] = False,
) -> None:
    """(ops) Register USER's public key: from now on their signed requests are accepted."""
    from datetime import UTC, datetime

    from apportion import client

    if role not in ("user", "ops"):
        fail(f"--role must be user or ops, not {role!r}")
    try:
        ev = client.key_registration(user, public_key, role=role, by=getpass.getuser(), now=datetime.now(UTC))
    except ValueError as exc:
        fail(str(exc))
    _publish_identity_event(ev, bootstrap, as_json, f"registered a {escape(role)} key for [bold]{escape(user)}[/]")


@app.command("revoke")
def revoke_key(
    user: Annotated[str, typer.Argument(help="The user whose key is revoked.")],
    public_key: Annotated[str, typer.Argument(help="The base64 public key to revoke.")],
    reason: Annotated[str, typer.Option(help="Why (kept in the log).")] = "",
    bootstrap: Annotated[str | None, typer.Option("--bootstrap", envvar="APPORTION_KAFKA_BOOTSTRAP")] = None,
    as_json: Annotated[bool, json_option("Print JSON for scripts.")] = False,
) -> None:
    """(ops) Revoke USER's key: what it signs is refused from when the readers read this, whatever its event time."""
    from datetime import UTC, datetime

    from pydantic import ValidationError

    try:
        ev = events.UserKeyRevoked(
            user=user, public_key=public_key, reason=reason, by=getpass.getuser(), ts=datetime.now(UTC), producer="cli"
        )
    except ValidationError as exc:
        fail(f"invalid key: {exc.errors(include_url=False)[0]['msg']}")
    _publish_identity_event(ev, bootstrap, as_json, f"revoked a key of [bold]{escape(user)}[/]")
