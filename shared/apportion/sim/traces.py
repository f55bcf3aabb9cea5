"""Trace loaders and the budget file of the simulator.

Two trace formats (picked by the CSV header, see :func:`load_trace`), both
UTF-8 (a byte-order mark is accepted), one job per row; every row is checked
and the first bad one is reported as ``<file>:<line>: <column>: <what>``
(:class:`TraceError`). The formats are documented in docs/simulation.md.

* **Philly** (``timestamp,duration,num_gpus,gpu_time,cluster``; the Pollux
  extract of Microsoft's Philly trace, ``/work/shared/data/README.md``).
  Reference rules, applied here and nowhere else:

  - rows are sorted by (timestamp, row number); job ids are ``p<row>`` (row
    number in the file, 0-based, so ids do not depend on the slice);
  - ``timestamp`` is cluster local time without zone, read as UTC;
  - gangs: ``replicas = ceil(n / 8)`` on distinct nodes, ``n / replicas``
    GPUs each; a ``num_gpus`` that does not split evenly (9, 17, ...) is an
    error (the reference rule has no remainder: every row of the real trace
    splits evenly);
  - budget: the VC (``cluster`` column) mapped through the budget file's
    ``groups``, else its ``default_budget``, else the VC id itself (which
    admission rejects unless the tree has such a leaf); user = the VC id;
  - minimum runtime: with ``random.Random(seed)``, one draw per job in
    sorted order *of the whole file* (so a slice gets the same draws as the
    full run): a draw below ``unallocated_fraction`` (0.25) makes the job
    unallocated (``min_runtime 0``), else ``min_runtime = min(duration,
    cap_s)`` (cap 2 h).

  - checkpoint interval: not declared, so the default of
    :func:`apportion.events.checkpoint_interval_of` (the minimum runtime;
    unallocated jobs never checkpoint).

* **ITP** (``job_id,cluster,submit_time,duration,num_gpus,gpu_time``; Microsoft's
  ITP trace as published by ElasticFlow, ``/work/shared/data/README.md``). The
  Philly reference rules above (gangs, budget by group, minimum runtime), with
  the group in the ``cluster`` column, rows sorted by (submit_time, row
  number), ids ``i<row>``, and ``submit_time`` (seconds from the start of the
  collection) placed on the convention t = 0 = :data:`ITP_T0`
  (2021-03-04T00:00:00Z; the publisher gives no date). Slices count from
  t = 0 (:func:`parse_itp_slice`): ``weekN`` / ``weeksN-M`` are trace weeks
  (``[N x 7 d, (M + 1) x 7 d)``, 0-based), ``daysA-B`` is ``[A d, B d)``.

* **GPU models** (both reference formats, Philly and ITP): with a budget
  file's ``gpu_models.constrained_fraction`` f > 0, one draw per job of
  ``random.Random(f"gpu-model-{seed}")`` in sorted order of the whole file
  (apart from the minimum-runtime draws, which stay as they were): a draw
  below f constrains the job to a model, and a second draw picks the model
  with probability proportional to the cluster's GPUs of that model (models
  in name order). Jobs without a constraint run on any model.

* **apportion CSV** (``submit,job_id,budget,user,gpus_per_replica,replicas,
  min_runtime_s,duration_s[,gpu_model][,checkpoint_interval_s]``; ``user``,
  ``replicas``, ``gpu_model`` and ``checkpoint_interval_s`` may be left out
  or empty): ``submit`` is ISO 8601 (naive = UTC) or seconds since the epoch;
  used as given (no minimum-runtime rule); an empty or missing
  ``checkpoint_interval_s`` is the default (the minimum runtime). Job ids
  must be unique.

Slices: ``all``, ``weekNN`` (ISO week of the trace's year), ``weeksNN-MM``,
or ``YYYY-MM-DD..YYYY-MM-DD`` (end exclusive); the first N days of a slice
with ``+Nd``, e.g. ``week44+3d``.

Budget file (YAML; schema :class:`BudgetFileSpec`, unknown keys are errors)::

    window_s: 604800              # optional, default 7 days
    cluster:                      # node groups; node ids <prefix><index>
      - {prefix: n, count: 32, gpus: 8, model: null}
    budgets:                      # BudgetTree.from_mapping format
      philly: 1.0
      philly/6214e9: {share: 0.178181818182}
    groups: {6214e9: philly/6214e9}   # trace VC/user -> budget
    default_budget: philly/other
    min_runtime: {unallocated_fraction: 0.25, cap_s: 7200}
"""

from __future__ import annotations

import csv
import io
import math
import random
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, ValidationError, field_validator

from apportion.budgetfile import BudgetEntry, BudgetFileError, Real, read_yaml_mapping, schema_error, tree_of
from apportion.budgetfile import StrictSchema as _Schema
from apportion.domain.budgets import BudgetTree
from apportion.events import MAX_SECONDS  # durations and minimum runtimes: the event contract's limit
from apportion.sim.core import SimJob, SimNode
from apportion.timeutil import WEEK_S, Micros, from_us, s_to_us, to_us

__all__ = [
    "BudgetFile",
    "BudgetFileSpec",
    "TraceError",
    "load_budget_file",
    "load_trace",
    "load_philly",
    "load_itp",
    "load_csv",
    "parse_itp_slice",
    "ITP_COLUMNS",
    "ITP_T0",
    "parse_slice",
    "philly_budget_spec",
    "trace_format",
    "PHILLY_COLUMNS",
    "CSV_COLUMNS",
]

GPUS_PER_NODE = 8
MAX_NODES = 100_000
PHILLY_COLUMNS = ("timestamp", "duration", "num_gpus", "gpu_time", "cluster")
ITP_COLUMNS = ("job_id", "cluster", "submit_time", "duration", "num_gpus", "gpu_time")
ITP_T0: Micros = to_us(datetime(2021, 3, 4, tzinfo=UTC))
"""The ITP trace's t = 0, a convention (the publisher gives seconds from the start of collection, no date)."""
CSV_COLUMNS = (
    "submit",
    "job_id",
    "budget",
    "user",
    "gpus_per_replica",
    "replicas",
    "min_runtime_s",
    "duration_s",
    "gpu_model",
    "checkpoint_interval_s",
)
CSV_OPTIONAL = ("user", "replicas", "gpu_model", "checkpoint_interval_s")
# limits of a JobSubmitted (apportion.events)
MAX_GPUS_PER_REPLICA = 1024
MAX_REPLICAS = 4096
MAX_JOB_ID = 200

_MIN_US = to_us(datetime(1, 1, 2, tzinfo=UTC))
_MAX_US = to_us(datetime(9000, 1, 1, tzinfo=UTC))


class TraceError(ValueError):
    """Bad input (trace, budget file or slice); ``str()`` is one line naming the file, line and field."""


# ------------------------------------------------------------------ budget file


class ClusterGroup(_Schema):
    """``count`` nodes of ``gpus`` GPUs (of ``model``), ids ``<prefix><index>`` (index zero-padded to 3+ digits).

    ``racks`` and ``blocks`` (optional): the group's nodes in id order split evenly into that many racks, the
    racks into that many blocks (:func:`topology_of`); without them the nodes carry no labels.
    """

    prefix: Annotated[str, Field(strict=True)] = "n"
    count: Annotated[int, Field(strict=True, ge=1, le=MAX_NODES)] = 1
    gpus: Annotated[int, Field(strict=True, ge=1, le=MAX_GPUS_PER_REPLICA)]
    model: Annotated[str, Field(strict=True, min_length=1)] | None = None
    racks: Annotated[int, Field(strict=True, ge=1, le=MAX_NODES)] | None = None
    blocks: Annotated[int, Field(strict=True, ge=1, le=MAX_NODES)] | None = None


def topology_of(
    i: int, count: int, racks: int | None, blocks: int | None, prefix: str = ""
) -> tuple[str | None, str | None]:
    """``(block, rack)`` labels of node ``i`` of ``count`` split evenly into ``racks`` racks and ``blocks`` blocks.

    Rack ``i * racks // count`` (label ``<prefix>r<rack>``), block ``rack * blocks // racks`` (``<prefix>b<block>``):
    consecutive nodes share a rack, consecutive racks a block, so a rack never spans two blocks. ``racks``
    ``None``: one rack per block (``blocks`` given) or no labels (neither given).

    >>> topology_of(0, 8, 4, 2), topology_of(3, 8, 4, 2), topology_of(7, 8, 4, 2)
    (('b0', 'r0'), ('b0', 'r1'), ('b1', 'r3'))
    """
    if racks is None and blocks is None:
        return None, None
    r = min(count, racks if racks is not None else blocks or 1)
    rack = i * r // count
    block = rack * min(r, blocks or 1) // r
    return f"{prefix}b{block}", f"{prefix}r{rack}"


class MinRuntimeRule(_Schema):
    """Philly minimum-runtime rule: a seeded ``unallocated_fraction`` of jobs unallocated, else min(duration, cap_s)."""

    unallocated_fraction: Annotated[Real, Field(ge=0.0, le=1.0)] = 0.25
    cap_s: Annotated[Real, Field(ge=0.0)] = 7200.0


class GpuModelRule(_Schema):
    """Reference traces: a seeded ``constrained_fraction`` of jobs must run on one GPU model (module docstring)."""

    constrained_fraction: Annotated[Real, Field(ge=0.0, le=1.0)] = 0.0


class BudgetFileSpec(_Schema):
    """The budget file as written (YAML); :func:`load_budget_file` builds a :class:`BudgetFile` from it."""

    window_s: Annotated[Real, Field(ge=1.0)] = float(WEEK_S)
    cluster: list[ClusterGroup] = Field(min_length=1)
    budgets: dict[Annotated[str, Field(strict=True)], BudgetEntry] = Field(min_length=1)
    groups: dict[str, Annotated[str, Field(strict=True)]] = Field(default_factory=dict)
    default_budget: Annotated[str, Field(strict=True)] | None = None
    min_runtime: MinRuntimeRule = Field(default_factory=MinRuntimeRule)
    gpu_models: GpuModelRule = Field(default_factory=GpuModelRule)

    @field_validator("groups", "min_runtime", "gpu_models", mode="before")
    @classmethod
    def _null_is_empty(cls, v: Any) -> Any:
        if v is None:
            return {}
        if isinstance(v, Mapping):  # YAML reads an unquoted VC id such as 103959 as a number
            return {str(k) if isinstance(k, int) and not isinstance(k, bool) else k: x for k, x in v.items()}
        return v


_MODELS: dict[str, type[_Schema]] = {
    m.__name__: m for m in (ClusterGroup, MinRuntimeRule, GpuModelRule, BudgetEntry, BudgetFileSpec)
}


@dataclass(frozen=True)
class BudgetFile:
    """A parsed budget file (see module docstring)."""

    tree: BudgetTree
    nodes: tuple[SimNode, ...]
    groups: Mapping[str, str] = field(default_factory=dict)
    default_budget: str | None = None
    unallocated_fraction: float = 0.25
    min_runtime_cap_s: float = 7200.0
    window_s: float = float(WEEK_S)
    constrained_fraction: float = 0.0


def _schema_error(path: str | Path, exc: ValidationError) -> TraceError:
    return TraceError(schema_error(path, exc, _MODELS))


def load_budget_file(path: str | Path) -> BudgetFile:
    """Parse and check a budget YAML file (format: module docstring and docs/simulation.md).

    Raises:
        TraceError: unreadable or not UTF-8, a YAML syntax error, a key or
            value that does not fit :class:`BudgetFileSpec` (named by its
            key path), more than 100,000 nodes, a node id given twice, an
            invalid budget tree, or a ``groups`` target or
            ``default_budget`` that is not a leaf budget.
    """
    try:  # the one reader of budget files (apportion.budgetfile): bytes, UTF-8, YAML, a mapping
        raw = read_yaml_mapping(path)
    except BudgetFileError as exc:
        raise TraceError(str(exc)) from None
    try:
        spec = BudgetFileSpec.model_validate(raw)
    except ValidationError as exc:
        raise _schema_error(path, exc) from None
    total = sum(g.count for g in spec.cluster)
    if total > MAX_NODES:
        raise TraceError(f"{path}: cluster: {total:,} nodes in all; at most {MAX_NODES:,}")
    nodes: list[SimNode] = []
    seen: dict[str, int] = {}
    for gi, grp in enumerate(spec.cluster):
        width = max(3, len(str(grp.count - 1)))
        for i in range(grp.count):
            node_id = f"{grp.prefix}{i:0{width}d}"
            if node_id in seen:
                raise TraceError(
                    f"{path}: cluster[{gi}]: node id {node_id!r} is also in cluster[{seen[node_id]}] "
                    "(give each group its own prefix)"
                )
            seen[node_id] = gi
            block, rack = topology_of(i, grp.count, grp.racks, grp.blocks, grp.prefix)
            nodes.append(SimNode(node_id, grp.gpus, grp.model, block, rack))
    try:
        tree = tree_of(path, spec.budgets)
    except BudgetFileError as exc:
        raise TraceError(str(exc)) from None
    targets = [(f"groups.{k}", v) for k, v in spec.groups.items()]
    if spec.default_budget is not None:
        targets.append(("default_budget", spec.default_budget))
    for where, target in targets:
        if not tree.is_leaf(target):
            what = "is not a budget" if tree.get(target) is None else "has children"
            raise TraceError(f"{path}: {where}: {target!r} {what}; it must name a leaf budget")
    mr = spec.min_runtime
    return BudgetFile(
        tree=tree,
        nodes=tuple(nodes),
        groups=dict(spec.groups),
        default_budget=spec.default_budget,
        unallocated_fraction=mr.unallocated_fraction,
        min_runtime_cap_s=mr.cap_s,
        window_s=spec.window_s,
        constrained_fraction=spec.gpu_models.constrained_fraction,
    )


def philly_budget_spec(vc_csv: str | Path, nodes: int = 32, gpus: int = 8) -> dict[str, Any]:
    """The reference Philly budget file as a dict (share = VC nodes / total x 0.98, other 0.02)."""
    rows = list(csv.DictReader(Path(vc_csv).open()))
    total = sum(int(r["node num"]) for r in rows)
    budgets: dict[str, Any] = {"philly": 1.0}
    groups = {}
    for r in sorted(rows, key=lambda r: r["vc"]):
        budgets[f"philly/{r['vc']}"] = round(int(r["node num"]) / total * 0.98, 12)
        groups[r["vc"]] = f"philly/{r['vc']}"
    budgets["philly/other"] = 0.02
    return {
        "window_s": WEEK_S,
        "cluster": [{"prefix": "n", "count": nodes, "gpus": gpus}],
        "budgets": budgets,
        "groups": groups,
        "default_budget": "philly/other",
        "min_runtime": {"unallocated_fraction": 0.25, "cap_s": 7200},
    }


# ------------------------------------------------------------------ slices


def _split_slice(spec: str | None) -> tuple[str, int | None] | None:
    """A slice spec as ``(its body, lowercased, N of a "+Nd" suffix or None)``; ``None`` for all."""
    if spec is None or spec.strip().lower() == "all":
        return None
    text = spec.strip().lower()
    m = re.fullmatch(r"(.+)\+(\d+)d", text)
    if m:
        return m.group(1), int(m.group(2))
    return text, None


def parse_slice(spec: str | None, year: int = 2017) -> tuple[Micros | None, Micros | None]:
    """``(start_us, end_us)`` of a slice spec (``None`` bounds = open); see module docstring.

    Raises:
        TraceError: an unknown spec, a week or date that does not exist, or
            an end that is not after the start; the message names ``--slice``.
    """
    parts = _split_slice(spec)
    if parts is None:
        return None, None
    text, days = parts
    m = re.fullmatch(r"weeks?(\d+)(?:-(\d+))?", text)
    try:
        if m:
            a = int(m.group(1))
            b = int(m.group(2) or a)
            start = datetime.combine(date.fromisocalendar(year, a, 1), datetime.min.time(), UTC)
            end = datetime.combine(date.fromisocalendar(year, b, 1), datetime.min.time(), UTC) + timedelta(days=7)
        else:
            m = re.fullmatch(r"(\d{4}-\d\d-\d\d)\.\.(\d{4}-\d\d-\d\d)", text)
            if not m:
                raise TraceError(
                    f"--slice {spec!r}: unknown slice; use all, week44, weeks39-45, week44+3d or YYYY-MM-DD..YYYY-MM-DD"
                )
            start = datetime.fromisoformat(m.group(1)).replace(tzinfo=UTC)
            end = datetime.fromisoformat(m.group(2)).replace(tzinfo=UTC)
        if days is not None:
            end = min(end, start + timedelta(days=days))
    except (ValueError, OverflowError) as exc:
        if isinstance(exc, TraceError):
            raise
        raise TraceError(f"--slice {spec!r}: {exc} (ISO weeks of {year})") from None
    if end <= start:
        raise TraceError(
            f"--slice {spec!r}: end before start ({start:%Y-%m-%d} .. {end:%Y-%m-%d}, end "
            "exclusive): the slice is empty"
        )
    return to_us(start), to_us(end)


def parse_itp_slice(spec: str | None) -> tuple[Micros | None, Micros | None]:
    """``(start_us, end_us)`` of an ITP slice (module docstring), on the :data:`ITP_T0` convention.

    Raises:
        TraceError: an unknown spec or an empty slice; the message names ``--slice``.
    """
    parts = _split_slice(spec)
    if parts is None:
        return None, None
    text, days = parts
    m = re.fullmatch(r"weeks?(\d+)(?:-(\d+))?", text)
    if m:
        start_d, end_d = 7 * int(m.group(1)), 7 * (int(m.group(2) or m.group(1)) + 1)
    else:
        m = re.fullmatch(r"days(\d+)-(\d+)", text)
        if not m:
            raise TraceError(
                f"--slice {spec!r}: unknown ITP slice; use all, week5, weeks0-7, days35-38 (end exclusive) "
                "or week5+3d (trace weeks and days from t = 0)"
            )
        start_d, end_d = int(m.group(1)), int(m.group(2))
    if days is not None:
        end_d = min(end_d, start_d + days)
    if end_d <= start_d:
        raise TraceError(f"--slice {spec!r}: end not after start (days {start_d} .. {end_d}, end exclusive)")
    day = s_to_us(86400)
    return ITP_T0 + start_d * day, ITP_T0 + end_d * day


# ------------------------------------------------------------------ CSV rows


def _csv_rows(path: str | Path) -> Iterator[tuple[int, list[str]]]:
    """``(line, cells)`` of every non-blank row, header included; UTF-8 with an optional BOM."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise TraceError(
            f"{path}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x}); save the file as UTF-8"
        ) from None
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        for row in reader:
            if row:  # csv.DictReader skips blank lines too: row numbers (Philly job ids) stay the same
                yield reader.line_num, row
    except csv.Error as exc:
        raise TraceError(f"{path}:{reader.line_num}: bad CSV: {exc}") from None


def _header(path: str | Path, rows: Iterator[tuple[int, list[str]]]) -> list[str]:
    first = next(rows, None)
    if first is None:
        raise TraceError(f"{path}: empty file (no header)")
    return [h.strip() for h in first[1]]


_EXPECTED = (
    f"expected a Philly trace ({','.join(PHILLY_COLUMNS)}), an ITP trace ({','.join(ITP_COLUMNS)}) or an apportion CSV "
    f"({','.join(CSV_COLUMNS[:-2])}[,gpu_model][,checkpoint_interval_s]; user, replicas, gpu_model, "
    "checkpoint_interval_s optional), "
    "see docs/simulation.md"
)


@dataclass(frozen=True)
class _Row:
    """One data row: cell access by column name, errors as ``<file>:<line>: <column>: <what>``."""

    path: str
    line: int
    index: Mapping[str, int]
    cells: list[str]

    def error(self, col: str, what: str) -> TraceError:
        return TraceError(f"{self.path}:{self.line}: {col}: {what}")

    def text(self, col: str, required: bool = True) -> str:
        i = self.index.get(col)
        v = self.cells[i].strip() if i is not None else ""
        if required and not v:
            raise self.error(col, "empty")
        return v

    def integer(self, col: str, lo: int, hi: int, default: int | None = None) -> int:
        v = self.text(col, required=default is None)
        if not v and default is not None:
            return default
        try:
            n = int(v)
        except ValueError:
            raise self.error(col, f"{v!r} is not a whole number") from None
        if not lo <= n <= hi:
            raise self.error(col, f"{n} is out of range ({lo}..{hi})")
        return n

    def seconds(self, col: str, positive: bool) -> float:
        v = self.text(col)
        try:
            x = float(v)
        except ValueError:
            raise self.error(col, f"{v!r} is not a number of seconds") from None
        if not math.isfinite(x) or x < 0 or (positive and x == 0) or x > MAX_SECONDS:
            need = "> 0" if positive else ">= 0"
            raise self.error(col, f"{v!r} must be a finite number of seconds {need} and <= {MAX_SECONDS:.0e}")
        return x

    def instant(self, col: str, epoch_ok: bool) -> Micros:
        v = self.text(col)
        try:
            if epoch_ok and re.fullmatch(r"-?\d+(\.\d+)?", v):
                us = s_to_us(float(v))
            else:
                dt = datetime.fromisoformat(v)
                us = to_us(dt if dt.tzinfo is not None and epoch_ok else dt.replace(tzinfo=UTC))
        except (ValueError, OverflowError):
            form = "ISO 8601 or seconds since the epoch" if epoch_ok else "a date-time YYYY-MM-DD HH:MM:SS"
            raise self.error(col, f"{v!r} is not {form}") from None
        if not _MIN_US <= us <= _MAX_US:
            raise self.error(col, f"{v!r} is out of range (years 1..8999)")
        return us


def _rows_of(path: str | Path, header: list[str], rows: Iterator[tuple[int, list[str]]]) -> Iterator[_Row]:
    index = {c: i for i, c in enumerate(header)}
    for line, cells in rows:
        if len(cells) != len(header):
            raise TraceError(f"{path}:{line}: expected {len(header)} fields ({','.join(header)}), got {len(cells)}")
        yield _Row(str(path), line, index, cells)


# ------------------------------------------------------------------ traces


def trace_format(path: str | Path) -> str:
    """``"philly"``, ``"itp"`` or ``"csv"`` (apportion CSV), from the header.

    Raises:
        TraceError: unreadable, not UTF-8, or an unknown header (the message
            lists the expected columns).
    """
    return _format(path, _header(path, _csv_rows(path)))


def _format(path: str | Path, header: list[str]) -> str:
    if tuple(header[:5]) == PHILLY_COLUMNS:
        return "philly"
    if tuple(header[:6]) == ITP_COLUMNS:
        return "itp"
    if "submit" in header and "job_id" in header:
        return "csv"
    raise TraceError(f"{path}:1: unknown trace header {','.join(header)!r}; {_EXPECTED}")


def load_philly(path: str | Path, budgets: BudgetFile, seed: int, slice_spec: str | None = None) -> list[SimJob]:
    """Philly CSV -> trace jobs under the reference rules (module docstring).

    Raises:
        TraceError: a bad header, row or slice (``<file>:<line>: <column>: <what>``).
    """
    lo, hi = parse_slice(slice_spec)
    return _load_reference(
        path, "a Philly", PHILLY_COLUMNS, lambda r: r.instant("timestamp", epoch_ok=False), budgets, seed, lo, hi, "p"
    )


def _load_reference(
    path: str | Path,
    kind: str,
    columns: tuple[str, ...],
    submit_of: Callable[[_Row], Micros],
    budgets: BudgetFile,
    seed: int,
    lo: Micros | None,
    hi: Micros | None,
    prefix: str,
) -> list[SimJob]:
    """Read a reference trace (Philly or ITP: ``duration``, ``num_gpus`` and ``cluster`` columns, the submit
    time by ``submit_of``) and apply the reference rules (:func:`_reference_jobs`)."""
    rows_in = _csv_rows(path)
    header = _header(path, rows_in)
    if tuple(header[: len(columns)]) != columns:
        raise TraceError(f"{path}:1: not {kind} header {','.join(header)!r}; expected {','.join(columns)}")
    rows = []
    for i, r in enumerate(_rows_of(path, header, rows_in)):
        t = submit_of(r)
        duration = r.seconds("duration", positive=True)
        n = r.integer("num_gpus", 1, GPUS_PER_NODE * MAX_REPLICAS)
        _gang_of(r, n)
        rows.append((t, i, duration, n, r.text("cluster")))
    return _reference_jobs(rows, budgets, seed, lo, hi, prefix)


def _gang_of(r: _Row, n: int) -> None:
    """The reference gang rule: ``n`` GPUs must split into ``ceil(n / 8)`` equal replicas."""
    replicas = math.ceil(n / GPUS_PER_NODE)
    if n % replicas:
        raise r.error(
            "num_gpus",
            f"{n} GPUs do not split into ceil({n}/{GPUS_PER_NODE}) = {replicas} equal "
            "replicas (reference gang rule: docs/simulation.md)",
        )


def _reference_jobs(
    rows: list[tuple[Micros, int, float, int, str]],
    budgets: BudgetFile,
    seed: int,
    lo: Micros | None,
    hi: Micros | None,
    prefix: str,
) -> list[SimJob]:
    """Trace jobs of ``(submit µs, row, duration s, GPUs, group)`` rows under the reference rules (module
    docstring): gangs, budget by group, the seeded minimum runtime and GPU-model draws over the whole file
    in (submit, row) order, then the slice ``[lo, hi)``."""
    rows.sort()
    rng = random.Random(seed)
    frac = budgets.constrained_fraction
    model_rng = random.Random(f"gpu-model-{seed}")
    per_model: dict[str, int] = {}
    for node in budgets.nodes:
        if node.model is not None:
            per_model[node.model] = per_model.get(node.model, 0) + node.gpus
    models = sorted(per_model)
    weights = [per_model[m] for m in models]
    jobs = []
    for t, i, duration, n, group in rows:
        draw = rng.random()
        model = None
        if frac > 0 and models:
            constrained = model_rng.random() < frac
            pick = model_rng.random()
            if constrained:
                model = _weighted(models, weights, pick)
        if (lo is not None and t < lo) or (hi is not None and t >= hi):
            continue
        replicas = math.ceil(n / GPUS_PER_NODE)
        g = n // replicas
        unalloc = draw < budgets.unallocated_fraction
        budget = budgets.groups.get(group, budgets.default_budget or group)
        jobs.append(
            SimJob(
                job_id=f"{prefix}{i:06d}",
                budget=budget,
                user=group,
                submit_us=t,
                gpus_per_replica=g,
                replicas=replicas,
                min_runtime_s=0.0 if unalloc else min(duration, budgets.min_runtime_cap_s),
                duration_s=duration,
                gpu_model=model,
            )
        )
    return jobs


def _weighted(items: list[str], weights: list[int], u: float) -> str:
    """The item a uniform draw ``u`` in [0, 1) picks, each with probability weight / total."""
    total = sum(weights)
    acc = 0.0
    for item, w in zip(items, weights, strict=True):
        acc += w / total
        if u < acc:
            return item
    return items[-1]


def load_itp(path: str | Path, budgets: BudgetFile, seed: int, slice_spec: str | None = None) -> list[SimJob]:
    """ITP CSV -> trace jobs under the reference rules (module docstring).

    Raises:
        TraceError: a bad header, row or slice (``<file>:<line>: <column>: <what>``).
    """
    lo, hi = parse_itp_slice(slice_spec)
    return _load_reference(
        path,
        "an ITP",
        ITP_COLUMNS,
        lambda r: ITP_T0 + s_to_us(r.seconds("submit_time", positive=False)),
        budgets,
        seed,
        lo,
        hi,
        "i",
    )


def load_csv(path: str | Path, slice_spec: str | None = None) -> list[SimJob]:
    """apportion CSV -> trace jobs (module docstring); week slices use the year of the first job.

    Raises:
        TraceError: a missing or unknown column, a bad row, a job id given
            twice (both lines named) or a bad slice.
    """
    rows_in = _csv_rows(path)
    header = _header(path, rows_in)
    unknown = [c for c in header if c not in CSV_COLUMNS]
    missing = [c for c in CSV_COLUMNS if c not in header and c not in CSV_OPTIONAL]
    twice = sorted({c for c in header if header.count(c) > 1})
    for what, cols in (("unknown", unknown), ("missing", missing), ("repeated", twice)):
        if cols:
            raise TraceError(
                f"{path}:1: {what} column{'s' if len(cols) > 1 else ''} {', '.join(cols)}; "
                f"expected {','.join(CSV_COLUMNS[:-2])}[,gpu_model][,checkpoint_interval_s] (user, replicas, "
                "gpu_model, checkpoint_interval_s optional)"
            )
    jobs = []
    seen: dict[str, int] = {}
    for r in _rows_of(path, header, rows_in):
        job_id = r.text("job_id")
        if len(job_id) > MAX_JOB_ID:
            raise r.error("job_id", f"longer than {MAX_JOB_ID} characters")
        if job_id in seen:
            raise r.error("job_id", f"{job_id!r} is also on line {seen[job_id]}; job ids must be unique")
        seen[job_id] = r.line
        jobs.append(
            SimJob(
                job_id=job_id,
                budget=r.text("budget"),
                user=r.text("user", required=False) or "user",
                submit_us=r.instant("submit", epoch_ok=True),
                gpus_per_replica=r.integer("gpus_per_replica", 1, MAX_GPUS_PER_REPLICA),
                replicas=r.integer("replicas", 1, MAX_REPLICAS, default=1),
                min_runtime_s=r.seconds("min_runtime_s", positive=False),
                duration_s=r.seconds("duration_s", positive=True),
                gpu_model=r.text("gpu_model", required=False) or None,
                checkpoint_interval_s=r.seconds("checkpoint_interval_s", positive=True)
                if r.text("checkpoint_interval_s", required=False)
                else None,
            )
        )
    year = from_us(min(j.submit_us for j in jobs)).year if jobs else 2017
    lo, hi = parse_slice(slice_spec, year)
    return [j for j in jobs if (lo is None or j.submit_us >= lo) and (hi is None or j.submit_us < hi)]


def load_trace(path: str | Path, budgets: BudgetFile, seed: int, slice_spec: str | None = None) -> list[SimJob]:
    """Load a trace, picking the format from the header (Philly or apportion CSV).

    Raises:
        TraceError: an unknown header (the expected columns are listed), or
            any error of :func:`load_philly` / :func:`load_csv`.
    """
    fmt = trace_format(path)
    if fmt == "philly":
        return load_philly(path, budgets, seed, slice_spec)
    if fmt == "itp":
        return load_itp(path, budgets, seed, slice_spec)
    return load_csv(path, slice_spec)
