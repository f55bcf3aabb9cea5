"""``whatif --budgets NEW.yaml``: the log's submissions re-run under another budget tree.

Inputs taken from the log (in log order):

* jobs: every ``JobSubmitted`` (first one per job id) becomes a
  :class:`~apportion.sim.core.SimJob` with its ``submitted_at``, budget,
  user, shape (g x k), ``min_runtime_s`` and ``duration_s``; a submission
  without ``duration_s`` (a real command) uses the run time observed in the
  log (last replica end minus first start of its last run), and is skipped
  when it never finished (listed in ``skipped``);
* cluster: every ``NodeRegistered`` (latest per node) as a
  :class:`~apportion.sim.core.SimNode`;
* recorded tree: :func:`apportion.domain.budgets.fold_budget_log` of the
  whole log (the tree in force at the end).

Both trees run through :func:`apportion.sim.core.simulate` with the same
jobs, cluster, seed and dispatcher knobs; the per-budget figures are
:func:`apportion.sim.report.summarise`'s (alloc share = allocated GPU-s /
capacity GPU-s over the run, waits from submission to first placement,
preemptions suffered), side by side with ``new - recorded`` differences.
The simulated span runs from the first submission to the last simulated
event (no periodic samples, so no idle tail is added to the capacity).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from apportion import events
from apportion.budgetfile import load_budget_tree
from apportion.domain.budgets import BudgetTree, fold_budget_log
from apportion.domain.dispatch import DispatchConfig
from apportion.domain.engine import EngineConfig
from apportion.logrecord import LogRecord
from apportion.sim.core import SimConfig, SimJob, SimNode, simulate
from apportion.sim.report import PolicyReport, summarise
from apportion.timeutil import WEEK_S, to_us

__all__ = ["WhatIf", "jobs_from_log", "nodes_from_log", "load_tree", "whatif"]

FIELDS = ("alloc_share", "free_share", "jobs", "placed", "never", "wait_p50_s", "wait_p95_s", "preemptions")


def load_tree(path: str | Path) -> BudgetTree:
    """A budget tree from a budget file (:func:`apportion.budgetfile.load_budget_tree`, the one reader).

    Raises:
        apportion.budgetfile.BudgetFileError: a bad file or tree (a ``ValueError``), as one line.
    """
    return load_budget_tree(path)


def jobs_from_log(records: Sequence[LogRecord]) -> tuple[list[SimJob], list[str]]:
    """The log's submissions as simulator jobs, and the ids skipped (no duration known).

    Returns:
        ``(jobs sorted by (submit time, id), skipped job ids)``.
    """
    subs: dict[str, events.JobSubmitted] = {}
    started: dict[tuple[str, int], int] = {}
    ended: dict[tuple[str, int], int] = {}
    for r in records:
        ev = r.event
        if isinstance(ev, events.JobSubmitted):
            for job_id in ev.job_ids:  # an array's elements, each its own job (its throttle is not re-run)
                subs.setdefault(job_id, ev)
        elif isinstance(ev, events.JobStarted):
            started.setdefault((ev.job_id, ev.attempt), to_us(ev.ts))
        elif isinstance(ev, events.JobCompleted):
            ended[(ev.job_id, ev.attempt)] = to_us(ev.ts)
    jobs, skipped = [], []
    for jid, s in subs.items():
        dur = s.duration_s
        if dur is None:
            runs = [(a, ended[(j, a)] - t) for (j, a), t in started.items() if j == jid and (j, a) in ended]
            if not runs:
                skipped.append(jid)
                continue
            dur = max(runs)[1] / 1e6
        jobs.append(
            SimJob(
                jid,
                s.budget,
                s.user,
                to_us(s.submitted_at),
                s.gpus_per_replica,
                s.replicas,
                s.min_runtime_s,
                float(dur),
                s.gpu_model,
            )
        )
    jobs.sort(key=lambda j: (j.submit_us, j.job_id))
    return jobs, sorted(skipped)


def nodes_from_log(records: Sequence[LogRecord]) -> list[SimNode]:
    """The cluster registered in the log (latest ``NodeRegistered`` per node), by node id."""
    nodes: dict[str, SimNode] = {}
    for r in records:
        ev = r.event
        if isinstance(ev, events.NodeRegistered):
            nodes[ev.node_id] = SimNode(ev.node_id, ev.gpu_count, ev.gpu_model)
    return [nodes[k] for k in sorted(nodes)]


@dataclass
class WhatIf:
    """Outcome of :func:`whatif`.

    Attributes:
        recorded, new: the simulator's reports under the two trees.
        rows: per leaf budget of either tree: ``{"path", "recorded": {...},
            "new": {...}, "diff": {...}}`` over :data:`FIELDS` (``None``
            where the budget is not in that tree).
        jobs, nodes, gpus: what was re-run.
        skipped: job ids without a known duration.
    """

    recorded: PolicyReport
    new: PolicyReport
    rows: list[dict[str, Any]]
    jobs: int
    nodes: int
    gpus: int
    skipped: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        summary = {
            k: {"recorded": getattr(self.recorded, k), "new": getattr(self.new, k)}
            for k in ("utilisation", "wait_p50_s", "wait_p95_s", "preemptions", "never", "violations")
        }
        return {
            "jobs": self.jobs,
            "nodes": self.nodes,
            "gpus": self.gpus,
            "skipped": self.skipped,
            "summary": summary,
            "budgets": self.rows,
        }


def _stats(rep: PolicyReport) -> dict[str, dict[str, Any]]:
    return {b.path: {f: getattr(b, f) for f in FIELDS} for b in rep.budgets}


def whatif(
    records: Sequence[LogRecord],
    new_tree: BudgetTree,
    *,
    seed: int = 0,
    config: DispatchConfig | None = None,
    cycle_s: float | None = 300.0,
    window_s: float = float(WEEK_S),
) -> WhatIf:
    """Re-run the log's submissions under ``new_tree`` and the recorded tree.

    Args:
        records: the log in log order.
        new_tree: the tree to try.
        seed: simulator seed (stop delays).
        config: dispatcher knobs (default: the service defaults, no heartbeats).
        cycle_s: periodic cycle while jobs wait (the service ticks on a timer).
        window_s: occupancy window W.

    Raises:
        ValueError: the log has no submissions or no registered nodes.
    """
    jobs, skipped = jobs_from_log(records)
    nodes = nodes_from_log(records)
    if not jobs:
        raise ValueError("the log has no job submissions to re-run")
    if not nodes:
        raise ValueError("the log has no NodeRegistered events: no cluster to re-run on")
    old_tree = fold_budget_log(r.event for r in records if r.event is not None)
    dcfg = config or DispatchConfig(engine=EngineConfig(window_s=window_s), heartbeat_timeout_s=None)
    reports = []
    for tree in (old_tree, new_tree):
        cfg = SimConfig(seed=seed, dispatch=dcfg, cycle_s=cycle_s, keep_log=False, sample_s=0)
        res = simulate(tree, nodes, jobs, cfg)
        # measure to the last simulated event (the simulator's default stops at the last submission,
        # which is an empty span when every submission shares one instant)
        end, total = res.end_us, res.total
        res.measured = (total.occupancy(end), total.unallocated(end), total.capacity_gpu_s(end))
        res.measured_until_us = end
        reports.append(summarise(res, tree, "fairshare", seed))
    old, new = (_stats(r) for r in reports)
    rows = []
    for path in sorted(set(old) | set(new)):
        a, b = old.get(path), new.get(path)
        diff = None
        if a is not None and b is not None:
            diff = {
                f: (b[f] - a[f] if isinstance(a[f], (int, float)) and isinstance(b[f], (int, float)) else None)
                for f in FIELDS
            }
        rows.append(
            {
                "path": path,
                "share_recorded": old_tree.abs_share(path) if path in old_tree else None,
                "share_new": new_tree.abs_share(path) if path in new_tree else None,
                "recorded": a,
                "new": b,
                "diff": diff,
            }
        )
    return WhatIf(reports[0], reports[1], rows, len(jobs), len(nodes), sum(n.gpus for n in nodes), skipped)
