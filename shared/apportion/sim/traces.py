"""Trace loaders and the budget file of the simulator.

Two trace formats (picked by the CSV header, see :func:`load_trace`):

* **Philly** (``timestamp,duration,num_gpus,gpu_time,cluster``; the Pollux
  extract of Microsoft's Philly trace, ``/work/shared/data/README.md``).
  Reference rules, applied here and nowhere else:

  - rows are sorted by (timestamp, row number); job ids are ``p<row>`` (row
    number in the file, 0-based, so ids do not depend on the slice);
  - ``timestamp`` is cluster local time without zone, read as UTC;
  - gangs: ``replicas = ceil(n / 8)`` on distinct nodes, ``n / replicas``
    GPUs each;
  - budget: the VC (``cluster`` column) mapped through the budget file's
    ``groups``, else its ``default_budget``; user = the VC id;
  - minimum runtime: with ``random.Random(seed)``, one draw per job in
    sorted order *of the whole file* (so a slice gets the same draws as the
    full run): a draw below ``unallocated_fraction`` (0.25) makes the job
    unallocated (``min_runtime 0``), else ``min_runtime = min(duration,
    cap_s)`` (cap 2 h).

* **apportion CSV** (``submit,job_id,budget,user,gpus_per_replica,replicas,
  min_runtime_s,duration_s[,gpu_model]``): ``submit`` is ISO 8601 (naive =
  UTC) or seconds since the epoch; used as given.

Slices: ``all``, ``weekNN`` (ISO week of the trace's year), ``weeksNN-MM``,
or ``YYYY-MM-DD..YYYY-MM-DD`` (end exclusive); the first N days of a slice
with ``+Nd``, e.g. ``week44+3d``.

Budget file (YAML)::

    window_s: 604800              # optional, default 7 days
    cluster:                      # node groups
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
import math
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import yaml

from apportion.domain.budgets import BudgetTree
from apportion.sim.core import SimJob, SimNode
from apportion.timeutil import WEEK_S, Micros, s_to_us, to_us

__all__ = ["BudgetFile", "load_budget_file", "load_trace", "load_philly", "load_csv",
           "parse_slice", "philly_budget_spec"]

GPUS_PER_NODE = 8


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


def load_budget_file(path: str | Path) -> BudgetFile:
    """Parse a budget YAML file.

    Raises:
        ValueError: missing ``budgets`` or ``cluster``; a ``groups`` target or
            ``default_budget`` that is not a leaf budget.
        apportion.domain.budgets.BudgetError: an invalid tree.
    """
    spec = yaml.safe_load(Path(path).read_text())
    if not isinstance(spec, dict) or "budgets" not in spec or "cluster" not in spec:
        raise ValueError(f"{path}: a budget file needs 'budgets' and 'cluster'")
    tree = BudgetTree.from_mapping(spec["budgets"])
    nodes: list[SimNode] = []
    for grp in spec["cluster"]:
        prefix = grp.get("prefix", "n")
        count = int(grp.get("count", 1))
        width = max(3, len(str(count - 1)))
        for i in range(count):
            nodes.append(SimNode(f"{prefix}{i:0{width}d}", int(grp["gpus"]), grp.get("model")))
    groups = {str(k): str(v) for k, v in (spec.get("groups") or {}).items()}
    default = spec.get("default_budget")
    for target in [*groups.values(), *([default] if default else [])]:
        if not tree.is_leaf(target):
            raise ValueError(f"{path}: {target!r} is not a leaf budget")
    mr = spec.get("min_runtime") or {}
    return BudgetFile(tree=tree, nodes=tuple(nodes), groups=groups, default_budget=default,
                      unallocated_fraction=float(mr.get("unallocated_fraction", 0.25)),
                      min_runtime_cap_s=float(mr.get("cap_s", 7200.0)),
                      window_s=float(spec.get("window_s", WEEK_S)))


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
    return {"window_s": WEEK_S, "cluster": [{"prefix": "n", "count": nodes, "gpus": gpus}],
            "budgets": budgets, "groups": groups, "default_budget": "philly/other",
            "min_runtime": {"unallocated_fraction": 0.25, "cap_s": 7200}}


def _parse_time(text: str) -> Micros:
    text = text.strip()
    if re.fullmatch(r"-?\d+(\.\d+)?", text):
        return s_to_us(float(text))
    dt = datetime.fromisoformat(text)
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return to_us(dt)


def parse_slice(spec: str | None, year: int = 2017) -> tuple[Micros | None, Micros | None]:
    """``(start_us, end_us)`` of a slice spec (``None`` bounds = open); see module docstring.

    Raises:
        ValueError: an unknown spec.
    """
    if spec is None or spec == "all":
        return None, None
    days = None
    m = re.fullmatch(r"(.+)\+(\d+)d", spec)
    if m:
        spec, days = m.group(1), int(m.group(2))
    m = re.fullmatch(r"weeks?(\d+)(?:-(\d+))?", spec)
    if m:
        a = int(m.group(1))
        b = int(m.group(2) or a)
        start = datetime.combine(date.fromisocalendar(year, a, 1), datetime.min.time(), timezone.utc)
        end = datetime.combine(date.fromisocalendar(year, b, 1), datetime.min.time(), timezone.utc) + timedelta(days=7)
    else:
        m = re.fullmatch(r"(\d{4}-\d\d-\d\d)\.\.(\d{4}-\d\d-\d\d)", spec)
        if not m:
            raise ValueError(f"unknown slice {spec!r}: use all, week44, weeks39-45, week44+3d or "
                             "YYYY-MM-DD..YYYY-MM-DD")
        start = datetime.fromisoformat(m.group(1)).replace(tzinfo=timezone.utc)
        end = datetime.fromisoformat(m.group(2)).replace(tzinfo=timezone.utc)
    if days is not None:
        end = min(end, start + timedelta(days=days))
    return to_us(start), to_us(end)


def load_philly(path: str | Path, budgets: BudgetFile, seed: int, slice_spec: str | None = None
                ) -> list[SimJob]:
    """Philly CSV -> trace jobs under the reference rules (module docstring)."""
    rows = []
    with Path(path).open(newline="") as f:
        for i, r in enumerate(csv.DictReader(f)):
            t = to_us(datetime.fromisoformat(r["timestamp"]).replace(tzinfo=timezone.utc))
            rows.append((t, i, float(r["duration"]), int(r["num_gpus"]), r["cluster"]))
    rows.sort()
    rng = random.Random(seed)
    lo, hi = parse_slice(slice_spec)
    jobs = []
    for t, i, duration, n, vc in rows:
        draw = rng.random()
        if (lo is not None and t < lo) or (hi is not None and t >= hi):
            continue
        replicas = math.ceil(n / GPUS_PER_NODE)
        g = n // replicas
        unalloc = draw < budgets.unallocated_fraction
        budget = budgets.groups.get(vc, budgets.default_budget or vc)
        jobs.append(SimJob(job_id=f"p{i:06d}", budget=budget, user=vc, submit_us=t,
                           gpus_per_replica=g, replicas=replicas,
                           min_runtime_s=0.0 if unalloc else min(duration, budgets.min_runtime_cap_s),
                           duration_s=duration))
    return jobs


def load_csv(path: str | Path, slice_spec: str | None = None) -> list[SimJob]:
    """apportion CSV -> trace jobs (module docstring); week slices use the year of the first job."""
    jobs = []
    with Path(path).open(newline="") as f:
        for r in csv.DictReader(f):
            jobs.append(SimJob(job_id=r["job_id"], budget=r["budget"], user=r.get("user") or "user",
                               submit_us=_parse_time(r["submit"]),
                               gpus_per_replica=int(r["gpus_per_replica"]),
                               replicas=int(r.get("replicas") or 1),
                               min_runtime_s=float(r["min_runtime_s"]),
                               duration_s=float(r["duration_s"]), gpu_model=r.get("gpu_model") or None))
    if not jobs or not slice_spec or slice_spec == "all":
        return jobs
    year = (datetime(1970, 1, 1, tzinfo=timezone.utc)
            + timedelta(microseconds=min(j.submit_us for j in jobs))).year
    lo, hi = parse_slice(slice_spec, year)
    return [j for j in jobs if (lo is None or j.submit_us >= lo) and (hi is None or j.submit_us < hi)]


def load_trace(path: str | Path, budgets: BudgetFile, seed: int, slice_spec: str | None = None
               ) -> list[SimJob]:
    """Load a trace, picking the format from the header (Philly or apportion CSV).

    Raises:
        ValueError: an unknown header.
    """
    with Path(path).open(newline="") as f:
        header = next(csv.reader(f), [])
    if header[:5] == ["timestamp", "duration", "num_gpus", "gpu_time", "cluster"]:
        return load_philly(path, budgets, seed, slice_spec)
    if "submit" in header and "job_id" in header:
        return load_csv(path, slice_spec)
    raise ValueError(f"{path}: unknown trace header {header!r}")
