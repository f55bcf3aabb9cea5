"""``apportion simulate``: replay a trace through the real scheduler and the baselines.

Example (the reference Philly setup, see docs/simulation.md)::

    apportion simulate --trace /work/shared/data/philly/philly.csv \\
        --budgets infra/budgets/philly.yaml --policy all --seed 1 --slice week44 \\
        --plot week44.png

Human tables by default, ``--json`` for scripts. The seed is required: it
draws which jobs run unallocated (trace rule) and the simulated stop delays.
"""

from __future__ import annotations

import time
from pathlib import Path

import typer

app = typer.Typer(help="Simulate a trace under our policy and the baselines, side by side.")

POLICY_NAMES = ("fairshare", "fifo", "static", "priority")


@app.callback(invoke_without_command=True)
def simulate(
    trace: Path = typer.Option(..., "--trace", exists=True, dir_okay=False,
                               help="Philly CSV or apportion CSV trace."),
    budgets: Path = typer.Option(..., "--budgets", exists=True, dir_okay=False,
                                 help="Budget file (YAML): tree, cluster, groups, min_runtime rule."),
    policy: str = typer.Option("all", "--policy",
                               help="fairshare, fifo, static, priority, a comma list, or all."),
    seed: int = typer.Option(..., "--seed", help="Required: trace draws and stop delays."),
    slice_: str = typer.Option("all", "--slice",
                               help="all, week44, weeks39-45, week44+3d, YYYY-MM-DD..YYYY-MM-DD."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
    plot_path: Path | None = typer.Option(None, "--plot", help="Write a PNG of occupancy share over time."),
    cycle_s: float = typer.Option(300.0, "--cycle-s", help="Periodic cycle while jobs wait, seconds."),
    per_budget: bool = typer.Option(True, "--per-budget/--no-per-budget", help="Per-budget tables."),
    tail_h: float | None = typer.Option(
        None, "--tail-h", min=0.0,
        help="Stop the clock this many hours after the last submission (default: run until every "
             "job is done). Jobs not placed by then count as never placed; waits cover placed jobs."),
) -> None:
    """Run the simulation(s) and report utilisation, share deficit, waits, preemptions."""
    from dataclasses import replace

    from apportion.domain.dispatch import DispatchConfig
    from apportion.domain.engine import EngineConfig
    from apportion.sim.baselines import POLICIES
    from apportion.sim.core import SimConfig, Simulator
    from apportion.sim.report import plot, render_table, summarise, to_json
    from apportion.sim.traces import load_budget_file, load_trace

    names = list(POLICY_NAMES) if policy == "all" else [p.strip() for p in policy.split(",")]
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        raise typer.BadParameter(f"unknown policy {unknown}; choose from {', '.join(POLICY_NAMES)} or all")
    from apportion.cli.main import fail
    from apportion.domain.budgets import BudgetError

    try:
        bf = load_budget_file(budgets)
        jobs = load_trace(trace, bf, seed, slice_)
    except (ValueError, KeyError, BudgetError) as exc:  # bad file, header, slice or tree: one clear line
        fail(str(exc))
    if not jobs:
        raise typer.BadParameter(f"no jobs in slice {slice_!r}")
    reports = []
    for name in names:
        dcfg = DispatchConfig(engine=EngineConfig(window_s=bf.window_s), heartbeat_timeout_s=None,
                              scheduler=None if name == "fairshare" else POLICIES[name])
        until = None if tail_h is None else max(j.submit_us for j in jobs) + round(tail_h * 3600e6)
        cfg = SimConfig(seed=seed, dispatch=dcfg, cycle_s=cycle_s, keep_log=False, until_us=until)
        t0 = time.perf_counter()
        result = Simulator(bf.tree, bf.nodes, jobs, replace(cfg), window_s=bf.window_s).run()
        wall = time.perf_counter() - t0
        reports.append(summarise(result, bf.tree, name, seed, wall_s=wall))
    if plot_path is not None:
        plot(reports, bf.tree, str(plot_path))
    if as_json:
        typer.echo(to_json(reports, trace=str(trace), budgets=str(budgets), slice=slice_, seed=seed, tail_h=tail_h,
                           rule=f"unallocated_fraction={bf.unallocated_fraction}, "
                                f"min_runtime=min(duration, {bf.min_runtime_cap_s:g}s)"))
    else:
        from rich.console import Console

        console = Console()
        console.print(f"trace {trace} slice {slice_}: {len(jobs)} jobs on {len(bf.nodes)} nodes "
                      f"({sum(n.gpus for n in bf.nodes)} GPUs), seed {seed}; "
                      f"{bf.unallocated_fraction:.0%} unallocated, min_runtime = min(duration, "
                      f"{bf.min_runtime_cap_s:g} s)")
        render_table(reports, console, budgets=per_budget)
        for r in reports:
            console.print(f"{r.policy}: {r.cycles} cycles, {r.events} events, {r.wall_s:.1f} s wall")
