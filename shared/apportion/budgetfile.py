"""Budget files: the one schema and the one loader of a budget tree written in YAML.

Every reader of a budget file goes through here: ``apportion budget apply``
and ``budget show --from-file``, ``apportion whatif --budgets``, and the
simulator's budget file (``apportion.sim.traces.load_budget_file``, which adds
the cluster and trace-rule keys of its own). One file therefore means one
tree wherever it is read.

Format (YAML)::

    budgets:                       # or the mapping itself, without this key
      lab: {share: 1.0, max_min_runtime: 12h}
      lab/prior: 0.6               # a bare number is the share
      lab/prior/robotics:
        share: 0.5
        members: [alice, bob]      # users allowed to charge it (default: inherit)
      lab/vision:
        share: 0.4
        max_min_runtime: 8h        # a duration (8h, 90m, 3600) or max_min_runtime_s: seconds
        default_time_limit: 24h    # or default_time_limit_s: the time limit of its jobs that give none
        max_time_limit: 7d         # or max_time_limit_s: the largest time limit its jobs may have
        preempt_idle_after: 2h     # or preempt_idle_after_s: its idle runs past protection are victims

``share`` is a fraction of the parent in (0, 1]; ``members``, ``max_min_runtime``,
the time limits and ``preempt_idle_after`` are inherited down the tree unless a
budget sets its own (:class:`apportion.domain.budgets.BudgetTree`). A time limit
is above 0, and a default in force above the maximum in force is refused, as
``budget set`` refuses them (``bad_time_limit``). A key given twice is an error
with its line (:mod:`apportion.yamlio`); so is an unknown key, naming the
allowed ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from apportion.domain.budgets import Budget, BudgetError, BudgetTree, validate_share, validate_time_limits
from apportion.durations import parse_duration
from apportion.yamlio import load_yaml, problem, where

__all__ = [
    "BudgetEntry",
    "BudgetFileError",
    "Real",
    "SIM_KEYS",
    "StrictSchema",
    "budgets_section",
    "load_budget_tree",
    "load_budgets",
    "read_yaml_mapping",
    "schema_error",
    "tree_of",
]

#: Top-level keys of a simulator budget file besides ``budgets`` (read by ``apportion.sim.traces``).
SIM_KEYS = ("window_s", "cluster", "groups", "default_budget", "min_runtime")


class BudgetFileError(ValueError):
    """A bad budget file; ``str()`` is one line naming the file, and the line or key path at fault."""


class StrictSchema(BaseModel):
    """Strict YAML schema: unknown keys are errors that name the allowed ones; no NaN or infinity."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    @classmethod
    def _coerce(cls, data: Any) -> Any:
        return data

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        data = cls._coerce(data)
        if isinstance(data, Mapping):
            unknown = [str(k) for k in data if k not in cls.model_fields]
            if unknown:
                raise ValueError(
                    f"unknown key {', '.join(map(repr, unknown))}; allowed keys: {', '.join(cls.model_fields)}"
                )
        return data


Real = Annotated[float, Field(strict=True)]


class BudgetEntry(StrictSchema):
    """One budget: a bare number is its share; else ``share``, ``members``, a limit on minimum runtimes, the
    default and the largest time limit of its jobs, and the idle time after which its runs past protection may
    be preempted (D3.idle-runs).

    Each duration is ``<name>`` (a duration: ``8h``, ``90m``, or seconds) or ``<name>_s`` (seconds), not both:
    ``max_min_runtime``, ``default_time_limit``, ``max_time_limit``, ``preempt_idle_after``.
    """

    share: Real
    members: list[Annotated[str, Field(strict=True)]] | None = None
    max_min_runtime_s: Annotated[Real, Field(ge=0.0)] | None = None
    max_min_runtime: str | float | None = None
    default_time_limit_s: Real | None = None
    default_time_limit: str | float | None = None
    max_time_limit_s: Real | None = None
    max_time_limit: str | float | None = None
    preempt_idle_after_s: Annotated[Real, Field(gt=0.0)] | None = None
    preempt_idle_after: str | float | None = None

    @classmethod
    def _coerce(cls, data: Any) -> Any:
        if isinstance(data, (int, float)) and not isinstance(data, bool):
            return {"share": data}
        if isinstance(data, Mapping):
            for name in ("max_min_runtime", "default_time_limit", "max_time_limit", "preempt_idle_after"):
                if data.get(name) is not None:
                    if data.get(f"{name}_s") is not None:
                        raise ValueError(f"give {name} or {name}_s, not both")
                    data = dict(data)
                    data[f"{name}_s"] = parse_duration(data.pop(name))
        return data

    def as_mapping(self) -> dict[str, Any]:
        """``{share, members, max_min_runtime_s, default_time_limit_s, max_time_limit_s, preempt_idle_after_s}``
        as :meth:`BudgetTree.from_mapping` reads it."""
        return {
            "share": self.share,
            "members": self.members,
            "max_min_runtime_s": self.max_min_runtime_s,
            "default_time_limit_s": self.default_time_limit_s,
            "max_time_limit_s": self.max_time_limit_s,
            "preempt_idle_after_s": self.preempt_idle_after_s,
        }

    def budget(self, path: str) -> Budget:
        """The :class:`~apportion.domain.budgets.Budget` this entry sets at ``path``."""
        return Budget(
            path,
            self.share,
            frozenset(self.members) if self.members is not None else None,
            self.max_min_runtime_s,
            self.default_time_limit_s,
            self.max_time_limit_s,
            self.preempt_idle_after_s,
        )


def _key_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


def schema_error(path: str | Path, exc: ValidationError, models: Mapping[str, type[BaseModel]] | None = None) -> str:
    """One line for the first error of ``exc``: ``"<path>: <key path>: <what>"`` (and how many more).

    Args:
        path: the file, as the user named it.
        exc: pydantic's error.
        models: schema classes by name, to list the keys a mapping takes.
    """
    errs = exc.errors(include_url=False)
    e = errs[0]
    at = _key_path(e["loc"])
    kind = e["type"]
    got = e.get("input")
    if kind == "value_error":
        what = e["msg"].removeprefix("Value error, ")
    elif kind == "missing":
        what = "missing (required)"
    elif kind == "model_type":
        model = (models or {}).get(e.get("ctx", {}).get("class_name", ""))
        keys = f" ({', '.join(model.model_fields)})" if model else ""
        what = f"expected a mapping{keys}, got {got!r}"
    elif kind == "dict_type":
        what = f"expected a mapping (key: value), got {got!r}"
    elif kind == "list_type":
        what = f"expected a list, got {got!r}"
    else:
        what = f"{e['msg'][0].lower()}{e['msg'][1:]}, got {got!r}"
    more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
    return f"{path}: {at}: {what}{more}"


def read_yaml_mapping(path: str | Path) -> Mapping[str, Any]:
    """The top-level YAML mapping of file ``path``.

    Raises:
        BudgetFileError: unreadable, not UTF-8, a YAML syntax error or a key
            given twice (with line and column), or not a mapping.
    """
    try:
        text = Path(path).read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise BudgetFileError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise BudgetFileError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        raw = load_yaml(text)
    except yaml.YAMLError as exc:
        raise BudgetFileError(f"{path}{where(exc)}: YAML syntax error: {problem(exc)}") from None
    if not isinstance(raw, Mapping):
        raise BudgetFileError(f"{path}: a budget file is a YAML mapping of budget path -> share (or a 'budgets' key)")
    return raw


def budgets_section(path: str | Path, raw: Mapping[str, Any]) -> dict[str, BudgetEntry]:
    """The validated ``budgets`` of a file's top-level mapping (or the mapping itself when it has no such key).

    Raises:
        BudgetFileError: an entry that does not fit :class:`BudgetEntry`, whose share is not in (0, 1]
            (``bad_share``, :func:`apportion.domain.budgets.validate_share`) or whose time limit is not a
            positive duration (``bad_time_limit``, :func:`apportion.domain.budgets.validate_time_limits`), or
            (with a ``budgets`` key) a top-level key that no reader knows.
    """
    if "budgets" in raw:
        unknown = [str(k) for k in raw if k != "budgets" and k not in SIM_KEYS]
        if unknown:
            raise BudgetFileError(
                f"{path}: unknown key {', '.join(map(repr, unknown))}; allowed keys: budgets, {', '.join(SIM_KEYS)}"
            )
        section = raw["budgets"]
        prefix: tuple[str, ...] = ("budgets",)
    else:
        section, prefix = raw, ()
    if not isinstance(section, Mapping) or not section:
        raise BudgetFileError(f"{path}: {'budgets: ' if prefix else ''}expected a non-empty mapping of path -> share")
    out: dict[str, BudgetEntry] = {}
    for key, value in section.items():
        if not isinstance(key, str):
            raise BudgetFileError(f"{path}: {_key_path((*prefix, str(key)))}: a budget path is text, got {key!r}")
        try:
            out[key] = BudgetEntry.model_validate(value)
        except ValidationError as exc:
            line = schema_error(path, exc, {"BudgetEntry": BudgetEntry})
            at = _key_path((*prefix, key))
            raise BudgetFileError(line.replace(f"{path}: ", f"{path}: {at}.", 1).replace(".(top level)", "")) from None
        except ValueError as exc:  # a bad duration
            raise BudgetFileError(f"{path}: {_key_path((*prefix, key))}: {exc}") from None
        try:  # the tree's rules, here so that a partial file (`budget apply`) is checked as a whole one is
            validate_share(key, out[key].share)
            validate_time_limits(out[key].budget(key))
        except BudgetError as exc:
            raise BudgetFileError(f"{path}: {_key_path((*prefix, key))}: {exc.reason}: {exc.message}") from None
    return out


def tree_of(path: str | Path, entries: Mapping[str, BudgetEntry]) -> BudgetTree:
    """The :class:`BudgetTree` of validated entries.

    Raises:
        BudgetFileError: an invalid tree (path, share, sibling sum, missing parent).
    """
    try:
        return BudgetTree.from_mapping({p: e.as_mapping() for p, e in entries.items()})
    except BudgetError as exc:
        raise BudgetFileError(f"{path}: budgets: {exc.message}") from None


def load_budget_tree(path: str | Path) -> BudgetTree:
    """Read budget file ``path`` (module docstring) into a :class:`BudgetTree`.

    Raises:
        BudgetFileError: anything wrong with the file, as one line.
    """
    raw = read_yaml_mapping(path)
    return tree_of(path, budgets_section(path, raw))


def load_budgets(path: str | Path) -> dict[str, Budget]:
    """The budgets of file ``path`` as set (path -> :class:`~apportion.domain.budgets.Budget`), each entry
    validated but not yet as a tree: ``budget apply`` checks them on the tree in force, where a partial file's
    parents and siblings may already be.

    Raises:
        BudgetFileError: an unreadable file or a bad entry, as one line.
    """
    entries = budgets_section(path, read_yaml_mapping(path))
    return {p: e.budget(p) for p, e in entries.items()}
