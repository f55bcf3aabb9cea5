"""``apportion simulate``: replay a trace through the real scheduler and the baselines.

Example (the reference Philly setup, see docs/simulation.md)::

    .venv/bin/apportion simulate --trace /work/shared/data/philly/philly.csv \\
        --budgets infra/budgets/philly.yaml --policy all --seed 1 --slice week44 \\
        --plot week44.png

The ITP trace (Microsoft, via ElasticFlow) takes the same rules: ``--trace
/work/shared/data/itp/itp.csv --budgets infra/budgets/itp.yaml`` (512 GPUs;
``itp-equal.yaml``: every cluster at 0.10; ``itp-hetero.yaml``: two GPU
models and a seeded 25% of jobs constrained to one), ``--slice week5``.

Human tables by default, ``--json`` for scripts. The seed is required: it
draws which jobs run unallocated (trace rule) and the simulated stop delays.
Workloads checkpoint once per checkpoint interval (default: the minimum
runtime) and a requeued job resumes from its last checkpoint
(``--no-checkpoints``: restart from scratch). Preempted unallocated
workloads also save their progress on SIGTERM (``--checkpoint-on-stop``
``unallocated``, the default; ``all`` or ``none``). The run always ends: without ``--tail-h`` it stops
when every job is done or at the default horizon
(:func:`apportion.sim.core.default_horizon_us`), whichever comes first.
Bad input (a trace row, the budget file, an option) is one ``error:`` line
on stderr naming the file, line and field, and exit code 2.
"""

from __future__ import annotations

import math
import os
import time
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape

from apportion.cli.common import err, fail, json_option
from apportion.domain.cluster import PROTECTION_CAP_W, PROTECTION_CHURN_BOUND, PROTECTION_DOUBLINGS
from apportion.domain.engine import CHECKPOINT_WAIT_S, PATIENCE_S

if TYPE_CHECKING:
    from apportion.sim.core import StopCheckpoint


class _OnStop(str, Enum):
    """``--checkpoint-on-stop`` values (``SimConfig.checkpoint_on_stop``)."""

    unallocated = "unallocated"
    all = "all"
    none = "none"


app = typer.Typer(
    help=(
        "Simulate a trace under our policy and the baselines, side by side.\n\n"
        "Example (ISO week 44 of the Philly trace, docs/simulation.md):\n\n"
        ".venv/bin/apportion simulate --trace /work/shared/data/philly/philly.csv "
        "--budgets infra/budgets/philly.yaml --policy all --seed 1 --slice week44\n\n"
        "Formats: the budget file (YAML), the Philly CSV and the apportion CSV are documented in "
        'docs/simulation.md, section "Input formats". Bad input exits 2 with one error line.\n\n'
        "Checkpoints: a workload checkpoints once per checkpoint interval (default: its minimum runtime; "
        "unallocated jobs that declare none never do) and a requeued job resumes from its last checkpoint.\n\n"
        "The run always ends: when every job is done, at --tail-h, or at the default horizon: the last "
        "submission + 2 x (the trace's GPU-hours / the cluster's GPUs + the longest job's duration)."
    )
)

POLICY_NAMES = ("fairshare", "fifo", "static", "priority", "slurm", "kueue", "kai")
REFERENCE_FORMATS = ("philly", "itp")  # traces read under the reference rules (minimum runtime, gangs, models)
FORMAT_NAMES = {"philly": "Philly", "itp": "ITP, synthetic tenancy: each ITP cluster a budget", "csv": "apportion CSV"}
MAX_TAIL_H = 1e6


def parse_policies(spec: str) -> list[str]:
    """Policy names of ``--policy`` (case-insensitive, comma list or ``all``), de-duplicated in order.

    Raises:
        ValueError: an empty or unknown name.
    """
    names: list[str] = []
    for part in spec.split(","):
        name = part.strip().lower()
        if not name:
            raise ValueError(f"--policy {spec!r}: empty name; use {', '.join(POLICY_NAMES)}, a comma list or all")
        for n in POLICY_NAMES if name == "all" else (name,):
            if n not in POLICY_NAMES:
                raise ValueError(
                    f"--policy {spec!r}: unknown policy {name!r}; use {', '.join(POLICY_NAMES)}, a comma list or all"
                )
            if n not in names:
                names.append(n)
    return names


def check_options(cycle_s: float, tail_h: float | None, plot_path: Path | None) -> None:
    """Check the numeric options and the plot path before anything runs.

    Raises:
        ValueError: ``--cycle-s`` not finite or in (0, 1) or negative;
            ``--tail-h`` not finite, negative or absurd; ``--plot`` not a
            ``.png`` in an existing writable directory.
    """
    if not math.isfinite(cycle_s) or cycle_s < 0 or 0 < cycle_s < 1:
        raise ValueError(f"--cycle-s {cycle_s:g}: use 0 (no periodic cycles) or at least 1 second")
    if tail_h is not None and (not math.isfinite(tail_h) or not 0 <= tail_h <= MAX_TAIL_H):
        raise ValueError(f"--tail-h {tail_h:g}: use a finite number of hours from 0 to {MAX_TAIL_H:g}")
    if plot_path is not None:
        parent = plot_path.parent
        if plot_path.suffix.lower() != ".png":
            raise ValueError(f"--plot {plot_path}: the plot is a PNG; name it *.png")
        if not parent.is_dir():
            raise ValueError(f"--plot {plot_path}: directory {parent} does not exist")
        if plot_path.is_dir() or not os.access(plot_path if plot_path.exists() else parent, os.W_OK):
            raise ValueError(f"--plot {plot_path}: not writable")


@app.callback(invoke_without_command=True)
def simulate(
    trace: Path = typer.Option(
        ...,
        "--trace",
        exists=True,
        dir_okay=False,
        help="Philly CSV, ITP CSV or apportion CSV trace (formats: docs/simulation.md).",
    ),
    budgets: Path = typer.Option(
        ...,
        "--budgets",
        exists=True,
        dir_okay=False,
        help="Budget file (YAML): tree, cluster, groups, min_runtime rule (format: docs/simulation.md).",
    ),
    policy: str = typer.Option(
        "all",
        "--policy",
        help="fairshare, fifo, static, priority, slurm, kueue, kai (docs/simulation.md), a comma list, or all.",
    ),
    seed: int = typer.Option(..., "--seed", help="Required: trace draws and stop delays."),
    slice_: str = typer.Option(
        "all",
        "--slice",
        help="all, week44, weeks39-45, week44+3d, YYYY-MM-DD..YYYY-MM-DD (end exclusive); ITP traces: trace "
        "weeks and days from t = 0, week5, weeks0-7, days35-38 (end exclusive), week5+3d.",
    ),
    as_json: Annotated[bool, json_option("Print JSON instead of tables.")] = False,
    plot_to_end: bool = typer.Option(
        False, "--plot-to-end", help="Draw the plot past the last submission, until the run ends."
    ),
    plot_path: Path | None = typer.Option(
        None,
        "--plot",
        help="Write a PNG (*.png) of occupancy share over time, to the last submission, and NAME-goodput.png.",
    ),
    cycle_s: float = typer.Option(
        300.0,
        "--cycle-s",
        help="Periodic cycle while jobs wait, seconds: at least 1, or 0 for none "
        "(cycles then run only on events and wake-ups).",
    ),
    per_budget: bool = typer.Option(True, "--per-budget/--no-per-budget", help="Per-budget tables."),
    tail_h: float | None = typer.Option(
        None,
        "--tail-h",
        help="Stop the clock this many hours (>= 0) after the last submission (default: run until every "
        "job is done, at most to the default horizon: the last submission + 2 x (the trace's GPU-hours / "
        "the cluster's GPUs + the longest job's duration)). Jobs not placed by then count as never placed, "
        "jobs not completed as unfinished; waits cover placed jobs.",
    ),
    checkpoints: bool = typer.Option(
        True,
        "--checkpoints/--no-checkpoints",
        help="Workloads checkpoint once per interval (declared, else the minimum runtime) and requeued jobs "
        "resume from the last one; --no-checkpoints: every attempt restarts from scratch.",
    ),
    checkpoint_on_stop: _OnStop = typer.Option(
        "unallocated",
        "--checkpoint-on-stop",
        help="Which preempted workloads save their progress on SIGTERM, within the grace period: "
        "'unallocated' (default: jobs with minimum runtime 0 accept preemption at any moment, so they are "
        "taken to save on SIGTERM), 'all', or 'none' (only interval checkpoints).",
    ),
    patience_s: float = typer.Option(
        PATIENCE_S,
        "--patience-s",
        min=0.0,
        help="Fair share's patience: a job of a budget at or over its share preempts only when the GPU-seconds "
        "it has waited cover the work the victims would lose, or after waiting this long (seconds; 0 = "
        "preempt at once). Budgets under their share never wait.",
    ),
    checkpoint_wait_s: float = typer.Option(
        CHECKPOINT_WAIT_S,
        "--checkpoint-wait-s",
        min=0.0,
        help="Fair share's checkpoint alignment: a preemption waits for its victims' next checkpoint when "
        "that costs the job fewer GPU-seconds than the work it keeps, at most this long (seconds; 0 = off).",
    ),
    protection_cap_w: float = typer.Option(
        PROTECTION_CAP_W,
        "--protection-cap-w",
        min=0.001,
        help="Cap of the protection growth after each preemption, as a fraction of the window W "
        "(min_runtime x 2^preemptions, capped; 0.25 = W / 4 as in rule D3.bounded-churn, the default since policy fairtree-6; "
        "1 = the whole window, as in fairtree-5).",
    ),
    protection_doublings: int = typer.Option(
        PROTECTION_DOUBLINGS,
        "--protection-doublings",
        min=-1,
        max=60,
        help="Preemptions for which a job's protection doubles (min_runtime x 1, 2, 4, ...) before it jumps to "
        "the cap; -1 doubles all the way to the cap (policy fairtree-4).",
    ),
    churn_bound: int = typer.Option(
        PROTECTION_CHURN_BOUND or 0,
        "--churn-bound",
        min=0,
        help="Preemptions after which an allocated job is protected until it completes, so none is preempted "
        "more often (default 5, policy fairtree-6); 0 = no bound (with --protection-cap-w 1: policy fairtree-5).",
    ),
    gang_rule: bool = typer.Option(
        True,
        "--gang-rule/--no-gang-rule",
        help="An allocated gang is never preempted for a job smaller than it (since policy fairtree-7; "
        "--no-gang-rule: fairtree-6).",
    ),
    free_order: bool = typer.Option(
        False,
        "--free-order/--no-free-order",
        help="Unallocated jobs go on free GPUs one at a time to the leaf with the fewest unallocated GPUs in use "
        "per unit of share (rule D3.free-order, a measured variant, not part of the policy); --no-free-order (the "
        "default): leaf by leaf in the allocated pass's budget order.",
    ),
    at_share_bound: int = typer.Option(
        0,
        "--at-share-bound",
        min=0,
        help="Churn bound of an allocated job whose budget is at or under its share when placed, where lower than "
        "--churn-bound (a measured variant of rule D3.bounded-churn, not part of the policy); 0 (the default): off.",
    ),
) -> None:
    """Run the simulation(s) and report utilisation, goodput, work lost, share deficit, waits, completions."""
    from apportion.sim.traces import TraceError, load_budget_file, load_trace, trace_format

    try:
        names = parse_policies(policy)
        check_options(cycle_s, tail_h, plot_path)
        bf = load_budget_file(budgets)
        fmt = trace_format(trace)
        jobs = load_trace(trace, bf, seed, slice_)
    except (TraceError, ValueError) as exc:  # bad option, file, row or slice: one clear line
        fail(str(exc))
    if not jobs:
        fail(
            f"{trace}: no jobs"
            if slice_.strip().lower() == "all"
            else f"--slice {slice_!r}: no jobs of {trace} in the slice"
        )
    if fmt in REFERENCE_FORMATS and not bf.groups and not bf.default_budget:
        err.print(
            f"[yellow]warning:[/] {escape(str(budgets))} has no 'groups' and no 'default_budget': every trace job is "
            "charged to its VC id as a budget path, and admission rejects those that are not leaf budgets",
            highlight=False,
            soft_wrap=True,
        )
    bursts: dict[str, Any] = {}
    reports = [
        _run(
            name,
            bf,
            jobs,
            seed,
            cycle_s,
            tail_h,
            checkpoints,
            checkpoint_on_stop.value,
            patience_s,
            bursts=bursts,
            checkpoint_wait_s=checkpoint_wait_s,
            protection_cap_w=protection_cap_w,
            protection_doublings=None if protection_doublings < 0 else protection_doublings,
            churn_bound=churn_bound or None,
            gang_rule=gang_rule,
            free_order=free_order,
            at_share_bound=at_share_bound or None,
        )
        for name in names
    ]
    rejected = {r.policy: sum(r.rejected.values()) for r in reports if r.rejected}
    if rejected:
        first = next(r for r in reports if r.rejected)
        err.print(
            f"[yellow]warning:[/] {max(rejected.values())} of {len(jobs)} jobs rejected at admission "
            f"({', '.join(f'{n} {k}' for k, n in first.rejected.items())}); see 'rejected' / never placed",
            highlight=False,
            soft_wrap=True,
        )
    models = f"; {bf.constrained_fraction:.0%} of jobs constrained to one GPU model" if bf.constrained_fraction else ""
    rule = (
        f"unallocated_fraction={bf.unallocated_fraction}, min_runtime=min(duration, {bf.min_runtime_cap_s:g}s)"
        + (f", gpu_model_fraction={bf.constrained_fraction}" if bf.constrained_fraction else "")
        if fmt in REFERENCE_FORMATS
        else None
    )
    human = (
        f"{bf.unallocated_fraction:.0%} unallocated, min_runtime = min(duration, {bf.min_runtime_cap_s:g} s)" + models
        if fmt in REFERENCE_FORMATS
        else None
    )
    _emit(
        reports,
        as_json=as_json,
        per_budget=per_budget,
        trace=trace,
        budgets=budgets,
        slice_=slice_,
        seed=seed,
        tail_h=tail_h,
        rule=rule,
        human_rule=human,
        checkpoints=("off" if not checkpoints else f"interval; on SIGTERM: {checkpoint_on_stop.value}")
        + f"; fair-share patience {patience_s:g} s, checkpoint wait {checkpoint_wait_s:g} s"
        + f", protection cap {protection_cap_w:g} W"
        + f" after {'unbounded' if protection_doublings < 0 else protection_doublings} doublings"
        + (f", churn bound {churn_bound}" if churn_bound else ""),
        fmt=fmt,
        jobs=len(jobs),
        nodes=bf.nodes,
        bursts=bursts,
    )
    if plot_path is not None:
        from apportion.sim.report import plot, plot_goodput

        try:
            plot(reports, bf.tree, str(plot_path), to_end=plot_to_end)
            plot_goodput(reports, str(plot_path.with_name(plot_path.stem + "-goodput.png")))
        except (OSError, ValueError) as exc:
            fail(f"--plot {plot_path}: {exc} (the results above are complete)", code=1)


def gang_scope(min_gpus: int | None, bound_x: float | None) -> dict[str, Any]:
    """The ``EngineConfig`` fields of the gang rule's scope given as options (0: off; ``None``: the engine's)."""
    out: dict[str, Any] = {}
    if min_gpus is not None:
        out["gang_min_gpus"] = min_gpus or None
    if bound_x is not None:
        out["gang_bound_x"] = bound_x or None
    return out


def _run(
    name: str,
    bf: Any,
    jobs: list[Any],
    seed: int,
    cycle_s: float,
    tail_h: float | None,
    checkpoints: bool = True,
    checkpoint_on_stop: StopCheckpoint = "unallocated",
    patience_s: float = PATIENCE_S,
    bursts: dict[str, Any] | None = None,
    checkpoint_wait_s: float = CHECKPOINT_WAIT_S,
    protection_cap_w: float = PROTECTION_CAP_W,
    protection_doublings: int | None = PROTECTION_DOUBLINGS,
    delta: float | None = None,
    churn_bound: int | None = PROTECTION_CHURN_BOUND,
    reservation_after_s: float | None = None,
    gang_rule: bool = True,
    free_order: bool = False,
    progress_after: int | None = None,
    at_share_bound: int | None = None,
    knobs: dict[str, Any] | None = None,
) -> Any:
    """One policy's run and report; admission rejections are counted by reason.

    ``bursts``: when given, ``bursts[name]`` gets the run's bursting rows
    (:func:`apportion.sim.bursting.burst_rows`). ``delta``: the engine's hysteresis
    (``EngineConfig.delta``; ``None``: its default); ``reservation_after_s`` the same for
    ``EngineConfig.reservation_after_s``. ``progress_after`` and ``at_share_bound``: the engine's job-dependent
    churn bounds (``EngineConfig``; ``None``: off). ``knobs``: further ``EngineConfig`` fields by name (the
    options measured and not adopted, such as ``owner_free`` and ``gang_wait_s``).
    """
    from dataclasses import replace

    from apportion.domain.dispatch import DispatchConfig
    from apportion.domain.engine import EngineConfig
    from apportion.events import JobRejected
    from apportion.sim.baselines import POLICIES
    from apportion.sim.core import SimConfig, Simulator, default_horizon_us
    from apportion.sim.report import summarise
    from apportion.timeutil import from_us

    rejected: dict[str, int] = {}

    class _Counting(Simulator):
        def _outputs(self, out: list[Any], t: int) -> None:
            for e in out:
                if type(e) is JobRejected:
                    rejected[e.reason.value] = rejected.get(e.reason.value, 0) + 1
            super()._outputs(out, t)

    engine = EngineConfig(
        window_s=bf.window_s,
        patience_s=patience_s,
        checkpoint_wait_s=checkpoint_wait_s,
        protection_cap_w=protection_cap_w,
        protection_doublings=protection_doublings,
        churn_bound=churn_bound,
        gang_rule=gang_rule,
        free_order=free_order,
        progress_after=progress_after,
        at_share_bound=at_share_bound,
        **(knobs or {}),
    )
    dcfg = DispatchConfig(
        engine=replace(
            engine,
            delta=engine.delta if delta is None else delta,
            reservation_after_s=engine.reservation_after_s if reservation_after_s is None else reservation_after_s,
        ),
        heartbeat_timeout_s=None,
        scheduler=POLICIES[name],  # peers reset their memory per simulation
    )
    if tail_h is None:
        until = default_horizon_us(jobs, bf.nodes)
    else:
        until = max(j.submit_us for j in jobs) + round(tail_h * 3600e6)
    cfg = SimConfig(
        seed=seed,
        dispatch=dcfg,
        cycle_s=cycle_s,
        keep_log=False,
        until_us=until,
        checkpoints=checkpoints,
        checkpoint_on_stop=checkpoint_on_stop,
    )
    t0 = time.perf_counter()
    result = _Counting(bf.tree, bf.nodes, jobs, cfg, window_s=bf.window_s).run()
    wall = time.perf_counter() - t0
    rep = summarise(result, bf.tree, name, seed, wall_s=wall, rejected=rejected)
    rep.horizon = from_us(until).isoformat()
    if bursts is not None:
        from apportion.sim.bursting import burst_rows

        bursts[name] = burst_rows(result, bf.tree)
    return rep


def _emit(
    reports: list[Any],
    *,
    as_json: bool,
    per_budget: bool,
    trace: Path,
    budgets: Path,
    slice_: str,
    seed: int,
    tail_h: float | None,
    rule: str | None,
    human_rule: str | None,
    checkpoints: str,
    fmt: str,
    jobs: int,
    nodes: Any,
    bursts: dict[str, Any] | None = None,
) -> None:
    """Print the reports: JSON, or a header line and tables (wide, uncut, when stdout is not a terminal).

    ``bursts``: policy -> bursting rows; the JSON gets them under ``bursting``
    (ratios against ``static`` when it ran), the tables show our policy's.
    """
    from apportion.sim.bursting import render_bursting, to_dicts, with_ratios
    from apportion.sim.report import render_table, to_json

    burst = with_ratios(bursts or {})

    if as_json:
        typer.echo(
            to_json(
                reports,
                trace=str(trace),
                budgets=str(budgets),
                format=fmt,
                slice=slice_,
                seed=seed,
                tail_h=tail_h,
                rule=rule,
                checkpoints=checkpoints,
                bursting=to_dicts(burst),
            )
        )
        return
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    console.print(
        f"trace {trace} ({FORMAT_NAMES.get(fmt, fmt)}) slice {slice_}: {jobs} jobs "
        f"on {len(nodes)} nodes ({sum(n.gpus for n in nodes)} GPUs), seed {seed}"
        + (f"; {human_rule}" if human_rule else "; min_runtime as given in the trace")
        + f"; checkpoints: {checkpoints}",
        highlight=False,
    )
    render_table(reports, console, budgets=per_budget)
    render_bursting(burst, console)
    for r in reports:
        console.print(f"{r.policy}: {r.cycles} cycles, {r.events} events, {r.wall_s:.1f} s wall")
        if r.unfinished:
            why = (
                "the clock stopped there ("
                + ("--tail-h" if tail_h is not None else "default horizon, see --help")
                + ")"
                if r.horizon is not None and r.end >= r.horizon
                else "nothing left could run them"
            )
            console.print(
                f"{r.policy}: {r.unfinished} admitted jobs not completed at the end, {r.end}: {why}",
                highlight=False,
            )
