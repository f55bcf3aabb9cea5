"""Export the JSON Schema of every event to ``schemas/<Type>.json``.

Any Kafka producer, in any language, can validate what it publishes against
these files (rule D4.events). They are generated from the pydantic models
in :mod:`apportion.events`, never edited by hand; a unit test
(``tests/unit/test_schemas_current.py``) fails when they are stale.

Usage::

    python -m apportion.schemas_export            # (re)write ./schemas
    python -m apportion.schemas_export --check    # exit 1 if ./schemas is stale
    python -m apportion.schemas_export --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from apportion.events import json_schemas

__all__ = ["render", "write", "stale", "main"]

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def render() -> dict[str, str]:
    """File name -> file text for every event type (deterministic: sorted keys, 2-space indent)."""
    out: dict[str, str] = {}
    for name, schema in json_schemas().items():
        doc = {"$schema": JSON_SCHEMA_DIALECT, "$id": f"apportion/{name}.json", **schema}
        out[f"{name}.json"] = json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    return out


def stale(directory: Path) -> list[str]:
    """Names of files in ``directory`` that are missing, different or no longer generated."""
    want = render()
    problems = []
    for name, text in want.items():
        path = directory / name
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            problems.append(name)
    if directory.is_dir():
        problems += sorted(p.name for p in directory.glob("*.json") if p.name not in want)
    return sorted(problems)


def write(directory: Path) -> list[str]:
    """Write every schema into ``directory`` and delete generated files of removed types.

    Returns:
        Names of the files written or deleted (empty when already current).
    """
    directory.mkdir(parents=True, exist_ok=True)
    want = render()
    changed = stale(directory)
    for name in changed:
        path = directory / name
        if name in want:
            path.write_text(want[name], encoding="utf-8")
        else:
            path.unlink()
    return changed


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the process exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m apportion.schemas_export", description="Export JSON Schemas of apportion events."
    )
    parser.add_argument("--out", type=Path, default=Path("schemas"), help="output directory (default: ./schemas)")
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 when the directory is stale")
    args = parser.parse_args(argv)
    if args.check:
        problems = stale(args.out)
        for name in problems:
            print(f"stale: {args.out / name}", file=sys.stderr)
        return 1 if problems else 0
    changed = write(args.out)
    print(f"{len(render())} schemas in {args.out}, {len(changed)} changed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
