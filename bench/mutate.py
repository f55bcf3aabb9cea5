"""Mutation testing of the rule modules (``make mutate``): fair share, occupancy, the preemption rule.

Each target module is mutated by mutmut (2.x: the 3.x line needs a click that
faust-streaming refuses) in a scratch copy of the checkout, so the work tree is
never touched, and judged by the table tests that name its rules. Bytecode
is never written: a mutant of the same length written within one second of the
original would otherwise run the stale ``.pyc`` and "survive"; and any failing
exit (a mutant that breaks the import exits 2) counts as a kill, as does a
timeout and mutmut's ``ok_suspicious`` (a kill that took more than twice the
baseline time). Hypothesis runs its ``mutate`` profile (fewer, fixed examples;
tests/conftest.py).

Speed (the machine is shared): each mutant's pytest runs in a fork of a server
that has imported pytest, hypothesis and the event models once (:func:`serve`),
which saves about 2 s of CPU a mutant; ``--jobs N`` splits one module's mutants
over N mutmut processes in N copies (a ``mutmut_config.py`` skips the other
shards' mutants) and merges their results.

Prints one line per module (killed, survived, timeout, score) and the ids of
the survivors (``mutmut show ID`` in the scratch dir shows each; never while a
run is going in that dir: ``show`` re-reads the file, which is mutated then,
and corrupts mutmut's cache); exits 1 when a module scores below
``--min-score`` (default 90%).

A mutant's run times out after ``--time-multiplier`` (default 10) times the baseline run (mutmut's default 2
made slow runs on the loaded machine look like hangs); the timeouts are printed by id, to be read.

Usage: ``.venv/bin/python bench/mutate.py [--only fairshare] [--jobs 2] [--keep DIR] [--time-multiplier 10]``.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(sys.executable).parent

#: module -> the tests that must kill its mutants
TARGETS: dict[str, tuple[str, tuple[str, ...]]] = {
    "fairshare": ("shared/apportion/domain/fairshare.py", ("tests/unit/test_fairshare.py",)),
    "occupancy": ("shared/apportion/domain/occupancy.py", ("tests/unit/test_occupancy.py",)),
    "preemption": (
        "shared/apportion/domain/preemption.py",
        ("tests/unit/test_preemption_rules.py", "tests/unit/test_engine.py"),
    ),
}


def _statuses(scratch: Path) -> dict[str, list[int]]:
    """Mutant ids by mutmut status (``ok_killed``, ``bad_survived``, ``bad_timeout``, ``ok_suspicious``,
    ``untested``, ``skipped``), read from mutmut's cache (its ``results`` command lists no killed mutants)."""
    import sqlite3

    db = sqlite3.connect(scratch / ".mutmut-cache")
    try:
        out: dict[str, list[int]] = {}
        for mid, status in db.execute("select id, status from Mutant order by id"):
            out.setdefault(status, []).append(mid)
        return out
    finally:
        db.close()


#: Imported once by the fork server (:func:`serve`): what every test run of a mutant would import again. Never a
#: target module nor anything that imports one (each forked run must read the mutated file from disk).
PRELOAD = (
    "pytest",
    "hypothesis",
    "hypothesis.strategies",
    "pydantic",
    "apportion.events",
    "apportion.timeutil",
    "apportion.domain.budgets",
    "apportion.domain.nodes",
)
#: A forked test run still going after this long is stopped and counted as a kill (a mutant that hangs).
RUN_TIMEOUT_S = 600.0


def serve(sock_path: str) -> None:
    """Fork server: import :data:`PRELOAD` once, then run each request's pytest arguments in a fork.

    A request is one JSON list of pytest arguments on a Unix socket; the answer is the exit code. The fork
    starts with the interpreter, pydantic's event models and the test plugins already loaded (about 2 s of CPU
    a mutant on the shared machine), and imports the mutated module afresh: bytecode is never written, so the
    source on disk is what runs.
    """
    import importlib

    if not sys.flags.dont_write_bytecode:  # started by run() with PYTHONDONTWRITEBYTECODE=1
        raise SystemExit("mutate --serve: set PYTHONDONTWRITEBYTECODE=1 (a stale .pyc would run instead of a mutant)")
    sys.path[:0] = ["shared", "."]
    for name in PRELOAD:
        importlib.import_module(name)
    import pytest

    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(sock_path)
    srv.listen(4)
    while True:
        conn, _ = srv.accept()
        with conn:
            args = json.loads(conn.makefile("r").readline())
            pid = os.fork()
            if pid == 0:  # the test run
                srv.close()
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, 1)
                os.dup2(null, 2)
                os._exit(int(pytest.main(args)))
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    code = os.waitstatus_to_exitcode(status)
                    break
                # mutmut stops a run that exceeds its timeout by killing the client: stop the fork with it
                gone = bool(select.select([conn], [], [], 0.02)[0]) and not conn.recv(1, socket.MSG_PEEK)
                if gone or time.monotonic() > deadline:
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    code = 1
                    break
            try:
                conn.sendall(f"{code}\n".encode())
            except OSError:
                pass  # the client is gone


def ask(sock_path: str, args: list[str]) -> int:
    """Client of :func:`serve`: run pytest with ``args`` in a fork of the server; 0 when it passed, else 1.

    mutmut 2 counts only exit code 1 as a kill; a mutant that breaks the import makes pytest exit 2
    ("interrupted"), which it would count as a survivor: any failure is mapped to 1.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
        c.connect(sock_path)
        c.sendall((json.dumps(args) + "\n").encode())
        return 0 if int(c.makefile("r").readline()) == 0 else 1


#: ``mutmut_config.py`` of one shard: mutmut 2 calls ``pre_mutation`` before testing a mutant; the mutants of
#: the other shards are skipped (status ``skipped``), so N shards in N copies test disjoint sets in parallel
_SHARD_CONFIG = """\
def pre_mutation(context):
    m = context.mutation_id
    if (m.line_number * 31 + m.index) % {n} != {k}:
        context.skip = True
"""


def _copy(scratch: Path) -> None:
    shutil.copytree(
        ROOT,
        scratch,
        ignore=shutil.ignore_patterns(".venv*", ".run", ".git", "__pycache__", "lib", ".mutmut-cache", "out"),
    )


#: mutmut stops a mutant's run after ``multiplier x baseline`` seconds and calls it ``bad_timeout``. Its default, 2,
#: turned slow runs on the loaded machine into false kills (an annotation mutant, inert, timed out in the seventh
#: session's first run), so the default here is 10: a mutant that truly hangs still ends as a timeout.
TIME_MULTIPLIER = 10.0


def run(
    name: str,
    module: str,
    tests: tuple[str, ...],
    base: Path,
    jobs: int = 1,
    time_multiplier: float = TIME_MULTIPLIER,
) -> tuple[int, int, list[int], list[int]]:
    """Mutate ``module`` in fresh copies under ``base`` (``jobs`` shards run in parallel, each in its own copy
    ``base/name`` or ``base/name/shard-K``); ``(total, survived, timeout ids, survivor ids)``."""
    scratches = [base / name] if jobs == 1 else [base / name / f"shard-{k}" for k in range(jobs)]
    for k, scratch in enumerate(scratches):
        _copy(scratch)
        if jobs > 1:
            (scratch / "mutmut_config.py").write_text(_SHARD_CONFIG.format(n=jobs, k=k))
    env = dict(os.environ, HYPOTHESIS_PROFILE="mutate", PYTHONDONTWRITEBYTECODE="1")
    pytest_args = ["-x", "-q", "-p", "no:cacheprovider", *tests]
    servers, procs = [], []
    for scratch in scratches:
        sock = scratch / ".forkserver.sock"
        servers.append(
            subprocess.Popen(
                [str(VENV / "python"), str(Path(__file__).resolve()), "--serve", str(sock)], cwd=scratch, env=env
            )
        )
        while not sock.exists():
            time.sleep(0.1)
        # the client itself, no shell: mutmut's timeout kills it, and the server then stops the fork
        runner = f"{VENV / 'python'} {Path(__file__).resolve()} --ask {sock} -- {' '.join(pytest_args)}"
        procs.append(
            subprocess.Popen(
                [
                    *(str(VENV / "mutmut"), "run", "--paths-to-mutate", module, "--runner", runner, "--no-progress"),
                    *("--test-time-multiplier", str(time_multiplier)),
                ],
                cwd=scratch,
                env=env,
                stdout=subprocess.DEVNULL,
            )
        )
    for proc in procs:
        proc.wait()
    for server in servers:
        server.kill()
        server.wait()
    got: dict[str, list[int]] = {}
    for scratch in scratches:  # every copy numbers the mutants alike; each tested its own share
        for status, ids in _statuses(scratch).items():
            if status != "skipped" or jobs == 1:
                got.setdefault(status, []).extend(ids)
    # mutmut 2 marks a mutant ``ok_suspicious`` when the tests *failed* (a kill) but took longer than twice the
    # baseline run (mutmut/__init__.py: ``if not survived and time_elapsed > ...: return OK_SUSPICIOUS``): on a
    # loaded machine that is most kills, so it is counted as killed, never as a survivor
    survived = sorted(got.get("bad_survived", []))
    timeout = sorted(got.get("bad_timeout", []))  # a mutant that makes the tests hang is caught: a kill (read them)
    total = sum(len(v) for k, v in got.items() if k not in ("untested", "skipped"))
    return total, len(survived), timeout, survived


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        serve(argv[1])
        return 0
    if argv[:1] == ["--ask"]:
        return ask(argv[1], argv[3:])  # --ask SOCK -- PYTEST ARGS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=sorted(TARGETS), action="append", help="mutate only this module (repeat)")
    ap.add_argument("--min-score", type=float, default=90.0, help="fail below this %% of mutants killed")
    ap.add_argument("--keep", type=Path, help="keep the scratch copies here (to `mutmut show` survivors)")
    ap.add_argument("--jobs", type=int, default=1, help="mutmut processes per module, each on its share of mutants")
    ap.add_argument(
        "--time-multiplier",
        type=float,
        default=TIME_MULTIPLIER,
        help="a mutant's run times out after this many baseline durations (mutmut's -m; default %(default)g)",
    )
    args = ap.parse_args(argv)
    if shutil.which("mutmut", path=str(VENV)) is None:
        print("mutate: mutmut is not installed; run `make mutate` (installs the [mutate] extra)", file=sys.stderr)
        return 2
    base = args.keep or Path(tempfile.mkdtemp(prefix="apportion-mutate-"))
    base.mkdir(parents=True, exist_ok=True)
    worst = 100.0
    for name in args.only or sorted(TARGETS):
        module, tests = TARGETS[name]
        if not (ROOT / module).exists():
            print(f"mutate: {name}: {module} does not exist", file=sys.stderr)
            return 2
        total, survived, timeouts, ids = run(name, module, tests, base, args.jobs, args.time_multiplier)
        killed = total - survived
        score = 100.0 * killed / total if total else 100.0
        worst = min(worst, score)
        print(
            f"mutate: {name} ({module}): {total} mutants, {killed} killed ({len(timeouts)} by timeout), "
            f"{survived} survived: score {score:.1f}%"
        )
        where = base / name if args.jobs == 1 else base / name / "shard-0"
        if ids:
            print(f"  survivors (mutmut show ID in {where}): {', '.join(map(str, ids))}")
        if timeouts:
            print(f"  timeouts, counted as kills (read each: a hang or a slow run?): {', '.join(map(str, timeouts))}")
    if args.keep is None:
        shutil.rmtree(base, ignore_errors=True)
    return 0 if worst >= args.min_score else 1


if __name__ == "__main__":
    sys.exit(main())
