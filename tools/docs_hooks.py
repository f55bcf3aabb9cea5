"""MkDocs hooks (``mkdocs.yml``): the reference pages, generated from the code at every build.

* ``reference/cli.md``: every command's ``--help``, from the typer app (:data:`apportion.cli.main.app`).
* ``reference/events.md`` and ``reference/schemas/<Type>.json``: each event type's topic, key and fields,
  linked to its JSON Schema (:func:`apportion.events.json_schemas`, the files in ``schemas/``).
* ``reference/configuration.md``: each service's settings (``services/<name>/config.py``): environment
  variable, type, default and meaning (the models' docstrings).
* ``reference/rules.md``: each rule of the design contract (``docs/design/README.md``) -> the code that cites
  it (its home) -> the tests that name it (:func:`rules_page`).

Nothing generated is committed, so no page can go stale.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

SERVICES = ("accounting", "dispatcher", "node_agent", "policy", "web")


def _help_pages(cmd: Any, ctx: Any) -> Iterator[tuple[str, str]]:
    """``(command line, help text)`` of ``cmd`` and every command under it, depth first, in name order."""
    yield ctx.command_path, cmd.get_help(ctx)
    for name in sorted(getattr(cmd, "commands", {}) or {}):
        sub = cmd.commands[name]
        if not getattr(sub, "hidden", False):
            yield from _help_pages(sub, sub.context_class(sub, info_name=name, parent=ctx, max_content_width=110))


def cli_page() -> str:
    """The CLI reference: one section per command with its ``--help`` (click's plain layout, no colours)."""
    import typer

    from apportion.cli.common import readable_help
    from apportion.cli.main import app

    typer.core.HAS_RICH = False  # plain text in this build process: the same options, no terminal boxes
    out = [
        "# CLI reference",
        "",
        "Every command of `apportion`, with its `--help` (generated from the command line app at each build of",
        "these pages). Exit codes: 0 done, 1 refused or not found, 2 bad input, 3 stack unreachable or no verdict",
        "in time ([Commands and verdicts](../operations.md)).",
        "",
    ]
    root: Any = typer.main.get_command(app)
    readable_help(root)  # as the command line shows it: examples line by line, each command's exit codes
    for path, text in _help_pages(root, root.context_class(root, info_name="apportion", max_content_width=110)):
        out += [f"## `{path}`", "", "```text", text.rstrip(), "```", ""]
    return "\n".join(out)


def _schema_type(prop: dict[str, Any]) -> str:
    if "$ref" in prop:
        return prop["$ref"].rsplit("/", 1)[-1]
    if "anyOf" in prop:
        return " or ".join(_schema_type(p) for p in prop["anyOf"])
    if prop.get("type") == "array":
        return f"array of {_schema_type(prop.get('items', {}))}"
    if "const" in prop:
        return json.dumps(prop["const"])
    if "enum" in prop:
        return " / ".join(json.dumps(v) for v in prop["enum"])
    return str(prop.get("type", "any"))


def _cell(text: str) -> str:
    """One table cell: one line, docstring markup as Markdown (``x`` and :role:`~a.b` as code)."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", lambda m: f"`{m.group(1)}`", text)
    return " ".join(text.replace("``", "`").split()).replace("|", "\\|")


def events_page(schemas: dict[str, dict[str, Any]]) -> str:
    """The event reference: per type its topic, key, schema version and fields, linked to its JSON Schema."""
    from apportion import events

    out = [
        "# Event reference",
        "",
        "Every event on the log: the topic it goes to, its key, and its fields. Each type links to its JSON",
        "Schema (the contract of what a producer writes; readers accept unknown fields and the previous version).",
        "The same schemas are in the repository's `schemas/` folder and printed by `apportion schemas TYPE`;",
        "producing from another language: [Producing](../producing.md). Generated from the event models.",
        "",
        "| event | topic | key | schema |",
        "|---|---|---|---|",
    ]
    for name in sorted(schemas):
        topic = events.TOPIC_OF[name]
        out.append(
            f"| [`{name}`](#{name.lower()}) | `{topic.base}` | `{topic.key}` | [{name}.json](schemas/{name}.json) |"
        )
    out.append("")
    for name in sorted(schemas):
        schema = schemas[name]
        out += [f"## {name}", ""]
        if schema.get("description"):
            out += [" ".join(schema["description"].split()), ""]
        out += [f"JSON Schema: [{name}.json](schemas/{name}.json)", "", "| field | type | required |", "|---|---|---|"]
        required = set(schema.get("required", ()))
        for field, prop in schema.get("properties", {}).items():
            out.append(f"| `{field}` | {_cell(_schema_type(prop))} | {'yes' if field in required else ''} |")
        out.append("")
    return "\n".join(out)


def _attribute_docs(cls: type) -> dict[str, str]:
    """``name -> text`` from the ``Attributes:`` section of the docstrings of ``cls`` and its bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        doc = inspect.getdoc(klass) or ""
        if "Attributes:" not in doc:
            continue
        section = doc.split("Attributes:", 1)[1]
        current: list[str] = []
        text: list[str] = []
        for line in section.splitlines():
            if line and not line.startswith(" "):
                break
            m = re.match(r"^    ([a-z_][a-z0-9_, ]*):\s*(.*)$", line)
            if m:
                for n in current:
                    docs[n] = " ".join(text)
                current = [n.strip() for n in m.group(1).split(",")]
                text = [m.group(2)]
            elif line.strip() and current:
                text.append(line.strip())
        for n in current:
            docs[n] = " ".join(text)
    return docs


def configuration_page() -> str:
    """The configuration reference: every service's settings, from its pydantic-settings model."""
    out = [
        "# Configuration reference",
        "",
        "Each service reads its settings from `APPORTION_*` environment variables (flags of",
        "`python -m services.<name>` override them). Generated from the settings models",
        "(`services/<name>/config.py`); the connection variables every process shares (Kafka, Redis, TLS, topic",
        "namespace) are in [Infrastructure](../infra.md) and [Security](../security.md).",
        "",
    ]
    for svc in SERVICES:
        mod = importlib.import_module(f"services.{svc}.config")
        classes: list[Any] = [
            c
            for _, c in inspect.getmembers(mod, inspect.isclass)
            if c.__module__ == mod.__name__ and hasattr(c, "model_fields") and c.__name__.endswith("Settings")
        ]
        for cls in classes:
            prefix = cls.model_config.get("env_prefix", "")
            docs = _attribute_docs(cls)
            out += [f"## {svc} (`{cls.__name__}`)", "", "| variable | type | default | meaning |", "|---|---|---|---|"]
            for name, field in cls.model_fields.items():
                env = (field.alias or f"{prefix}{name}").upper()
                kind = getattr(field.annotation, "__name__", None) or str(field.annotation).replace("typing.", "")
                kind = kind.replace("datetime.datetime", "datetime").replace(" | ", " or ")
                default = "(required)" if field.is_required() else repr(field.get_default(call_default_factory=True))
                meaning = field.description or docs.get(name, "")
                out.append(f"| `{env}` | `{_cell(kind)}` | `{_cell(default)}` | {_cell(meaning)} |")
            out.append("")
    return "\n".join(out)


ROOT = Path(__file__).resolve().parents[1]
#: a rule id (``D3.refused-starts``) and a rule's anchor in the design contract
RULE_ID = re.compile(r"\bD\d+\.[a-z][a-z0-9]*(?:-[a-z0-9]+)*\b")
RULE_ANCHOR = re.compile(r'<a id="(D\d+\.[a-z0-9-]+)"></a>`[^`]+`\s*([^.:]*)')


def _citing(roots: tuple[str, ...]) -> dict[str, set[str]]:
    """Rule id -> the Python files under ``roots`` (repository-relative) that cite it."""
    out: dict[str, set[str]] = {}
    for root in roots:
        for path in sorted((ROOT / root).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for rid in set(RULE_ID.findall(path.read_text())):
                out.setdefault(rid, set()).add(rel)
    return out


def rules_page() -> str:
    """Rule id -> its home (the library and service files that cite it) -> the tests that name it, for every
    rule the design contract defines (its anchors), in the contract's order."""
    design = (ROOT / "docs" / "design" / "README.md").read_text()
    homes, tests = _citing(("shared", "services")), _citing(("tests",))
    out = [
        "# Design rules: where each lives and which tests name it",
        "",
        "Every rule of the [design contract](../design/README.md), the code that cites it by id (its home) and the",
        "tests that name it; generated from the sources at each build of these pages. A rule with no test here is",
        "checked by tests that do not cite it by id, or not yet.",
        "",
        "| rule | what | home | tests |",
        "|---|---|---|---|",
    ]
    for rid, what in RULE_ANCHOR.findall(design):
        home = "<br>".join(f"`{f}`" for f in sorted(homes.get(rid, ()))) or "-"
        named = "<br>".join(f"`{f}`" for f in sorted(tests.get(rid, ()))) or "-"
        out.append(f"| [`{rid}`](../design/README.md#{rid}) | {_cell(what.strip()[:80])} | {home} | {named} |")
    return "\n".join(out) + "\n"


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add the generated reference pages (and the JSON Schemas they link) to the site."""
    from apportion import events

    schemas = events.json_schemas()
    pages = {
        "reference/cli.md": cli_page(),
        "reference/events.md": events_page(schemas),
        "reference/configuration.md": configuration_page(),
        "reference/rules.md": rules_page(),
    }
    for uri, text in pages.items():
        files.append(File.generated(config, uri, content=text))
    for name, schema in schemas.items():
        files.append(File.generated(config, f"reference/schemas/{name}.json", content=json.dumps(schema, indent=2)))
    return files
