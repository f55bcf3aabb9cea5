#!/usr/bin/env python3
"""Slurm and apportion side by side on this machine (design D9, ``D9.live-stack``): ``make bench-slurm``.

Runs the same N one-GPU jobs through both, alternated in one window (Slurm, apportion, Slurm, apportion, ...
``--rounds`` times), and prints for each round and system:

- **placements/s**: N / (the moment every job was placed - the submission). Slurm: when the first ``squeue``
  that shows none of the array's tasks pending was started (polled every ``--poll-s``: the moment is known to
  within one poll and one ``squeue``); apportion: when the N-th ``JobPlaced`` arrived.
- **time to the last real start**: Slurm: the last job script's start, stamped by the script itself
  (``$EPOCHREALTIME``); apportion: the N-th ``JobStarted`` of a simulated workload.
- **CPU seconds per 1,000 jobs by component**, to the last placement and to the last start (``/proc``, the helper
  of ``bench/bench_live.py``). Slurm: slurmctld, slurmd total (every slurmd, slurmstepd and job script: the
  slurmds run under a subreaper, so nothing they start escapes the count), munged, the client (``sbatch``);
  the ``squeue`` polls are measurement. apportion: as ``bench_live`` prints it.
- the ratios apportion / Slurm, and the medians over the rounds.

Slurm: Debian's packages (``slurmctld slurmd slurm-client munge``), installed with apt-get when missing (as root).
One slurmctld, ``--nodes`` slurmd on loopback (multiple-slurmd: ``slurmd -N``, one port each), 8 GPUs a node as
gres backed by character devices made here (gres without files where mknod is not allowed),
``select/cons_tres``, ``sched/backfill``, munge authentication, its own munged; all in a temporary folder.
Submitted as one job array: ``sbatch --array=1-N --gres=gpu:1``. apportion: one Kafka and Redis for all rounds
(TLS, SASL, ACLs), a fresh topic namespace and fresh services each round, every submission signed, transactions
on; ``--nodes`` simulated nodes of 8 GPUs.

Everything started here is stopped on exit, on failure and on Ctrl-C. Progress on stderr; the figures on stdout
(``--json``: one JSON object instead). Exits 2 with the reason when Slurm cannot be installed or started.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_live
from bench_live import BenchError, CpuBudget, LiveRun, budget_table, descendants, throughput
from scratch import scratch_dir

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
BINARIES = ["slurmctld", "slurmd", "slurmstepd", "sbatch", "squeue", "sinfo", "munged"]
GPUS_PER_NODE = 8
SLURM_MEASUREMENT = ("squeue polls",)


class SlurmUnavailable(RuntimeError):
    """Slurm cannot be installed or started here; the message says why."""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def ensure_slurm(install: bool) -> str:
    """Slurm's version, installed from Debian's packages first when a binary is missing."""
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing and install:
        if os.geteuid() != 0:
            raise SlurmUnavailable(
                f"{', '.join(missing)} not installed and not root: apt-get install {' '.join(PACKAGES)}"
            )
        log(f"installing {' '.join(PACKAGES)} (missing: {', '.join(missing)})")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]):
            r = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if r.returncode != 0:
                raise SlurmUnavailable(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()[-800:]}")
        missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        raise SlurmUnavailable(f"not installed: {', '.join(missing)} (packages: {' '.join(PACKAGES)})")
    if os.geteuid() != 0:
        raise SlurmUnavailable("slurmd must run as root (it starts job steps as their user)")
    usage = subprocess.run(["slurmd", "-h"], capture_output=True, text=True)
    if "-N node" not in usage.stdout + usage.stderr:
        raise SlurmUnavailable("this slurmd was built without multiple-slurmd support (no -N): one node only")
    return subprocess.run(["slurmd", "-V"], capture_output=True, text=True).stdout.strip()


#: Runs the slurmds as a child subreaper: slurmstepd and job scripts that outlive their parent are reparented to
#: it, not to init, so their CPU stays in its process tree. Forwards SIGTERM, reaps until nothing is left.
SUBREAPER = r"""
import ctypes, os, signal, subprocess, sys
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
kids = [subprocess.Popen(["slurmd", "-D", "-N", n, "-f", sys.argv[1]]).pid for n in sys.argv[2:]]
def stop(*_):
    for k in kids:
        try: os.kill(k, signal.SIGTERM)
        except ProcessLookupError: pass
signal.signal(signal.SIGTERM, stop)
while True:
    try: os.wait()
    except ChildProcessError: break
    except InterruptedError: continue
"""


class SlurmCluster:
    """slurmctld, ``nodes`` slurmd and a munged of their own under ``root``, on loopback."""

    def __init__(self, root: Path, nodes: int, jobs: int) -> None:
        self.root, self.nodes, self.jobs = root, nodes, jobs
        self.names = [f"n{i}" for i in range(1, nodes + 1)]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.env = dict(os.environ, SLURM_CONF=str(root / "slurm.conf"))
        self.gres_note = ""

    def configure(self) -> None:
        from apportion.bus.stack import free_ports

        r = self.root
        for d in ("state", "log", "dev", "munge", *(f"spool/{n}" for n in self.names)):
            (r / d).mkdir(parents=True, exist_ok=True)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        files = ""
        try:
            for g in range(GPUS_PER_NODE):  # what slurmd hands a job; same numbers as /dev/null, never opened
                os.mknod(r / "dev" / f"gpu{g}", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
            files = f" File={r}/dev/gpu[0-{GPUS_PER_NODE - 1}]"
            self.gres_note = f"character devices {r}/dev/gpu0..{GPUS_PER_NODE - 1}"
        except OSError as exc:
            self.gres_note = f"gres without device files (mknod: {exc.strerror})"
        ctl_port, *ports = free_ports(self.nodes + 1)
        host = socket.gethostname().split(".")[0]
        nodes = "\n".join(
            f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={p} CPUs={GPUS_PER_NODE} "
            f"Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN"
            for n, p in zip(self.names, ports, strict=True)
        )
        (r / "slurm.conf").write_text(
            f"""ClusterName=bench
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctl_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r}/munge/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/spool/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
SlurmctldDebug=error
SlurmdDebug=error
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
MailProg=/bin/true
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
ReturnToService=2
MaxArraySize={self.jobs + 1}
MaxJobCount={max(10_000, 4 * self.jobs)}
{nodes}
PartitionName=bench Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        )
        (r / "gres.conf").write_text(
            f"AutoDetect=off\nNodeName=n[1-{self.nodes}] Name=gpu Count={GPUS_PER_NODE}{files}\n"
        )

    def _spawn(self, name: str, cmd: list[str]) -> None:
        out = open(self.root / "log" / f"{name}.out", "ab")
        self.procs[name] = subprocess.Popen(
            cmd, env=self.env, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True
        )

    def start(self) -> SlurmCluster:
        self.configure()
        m = self.root / "munge"
        self._spawn(
            "munged",
            [
                "munged",
                "--foreground",
                "--force",
                f"--socket={m}/munge.socket",
                f"--key-file={m}/munge.key",
                f"--pid-file={m}/munged.pid",
                f"--log-file={m}/munged.log",
                f"--seed-file={m}/munged.seed",
            ],
        )
        self._wait(lambda: (m / "munge.socket").exists(), 30, "munged did not open its socket", "munged")
        conf = str(self.root / "slurm.conf")
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", conf])
        self._wait(lambda: self.cmd("sinfo", "-h").returncode == 0, 60, "slurmctld does not answer", "slurmctld")
        self._spawn("slurmd", [sys.executable, "-c", SUBREAPER, conf, *self.names])
        self._wait(
            lambda: self.idle_nodes() == self.nodes, 180, f"not all {self.nodes} slurmd registered idle", "slurmd"
        )
        return self

    def _wait(self, ok: Any, timeout: float, what: str, proc: str) -> None:
        end = time.monotonic() + timeout
        while not ok():
            p = self.procs[proc]
            if p.poll() is not None or time.monotonic() > end:
                tail = ""
                for f in sorted((self.root / "log").glob("*")) + [self.root / "munge" / "munged.log"]:
                    if f.is_file() and f.stat().st_size:
                        tail += f"\n--- {f.name}:\n" + "\n".join(f.read_text(errors="replace").splitlines()[-8:])
                        if len(tail) > 6000:
                            break
                state = f"exited {p.returncode}" if p.poll() is not None else f"still running after {timeout:.0f} s"
                raise SlurmUnavailable(f"{what} ({proc} {state}); logs in {self.root / 'log'}:{tail}")
            time.sleep(0.2)

    def cmd(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True)

    def idle_nodes(self) -> int:
        r = self.cmd("sinfo", "-h", "-t", "idle", "-o", "%D")
        return sum(int(x) for x in r.stdout.split() if x.isdigit()) if r.returncode == 0 else 0

    def stop(self) -> None:
        """SIGTERM to every process this cluster started (the whole tree, job steps included), SIGKILL after 15 s."""
        pids = descendants([p.pid for p in self.procs.values()])
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        end = time.monotonic() + 15
        for p in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.1, end - time.monotonic()))
        for pid in descendants(pids) + [p.pid for p in self.procs.values() if p.poll() is None]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for p in self.procs.values():
            p.wait()

    def budget(self, client: ChildCpu) -> CpuBudget:
        return CpuBudget(
            {k: [self.procs[k].pid] for k in ("slurmctld", "slurmd", "munged")},
            own={"client": lambda: client.seconds["sbatch"], "squeue polls": lambda: client.seconds["squeue"]},
            measurement=SLURM_MEASUREMENT,
        )


class ChildCpu:
    """CPU seconds of the commands this process runs and waits for, by command (``getrusage`` of children)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.seconds: dict[str, float] = {"sbatch": 0.0, "squeue": 0.0}

    def run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        import resource

        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        r = subprocess.run(list(argv), env=self.env, capture_output=True, text=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.seconds[argv[0]] = self.seconds.get(argv[0], 0.0) + (
            after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
        )
        return r


def slurm_round(cluster: SlurmCluster, jobs: int, rnd: int, poll_s: float, timeout: float) -> dict[str, Any]:
    """One job array of ``jobs`` one-GPU jobs, each a script that stamps its start time."""
    stamps = cluster.root / f"stamps{rnd}"
    stamps.mkdir()
    script = cluster.root / f"job{rnd}.sh"
    script.write_text(f"#!/bin/bash\necho $EPOCHREALTIME > {stamps}/$SLURM_ARRAY_TASK_ID\n")
    client = ChildCpu(cluster.env)
    cpu = cluster.budget(client)
    cpu0 = cpu.sample()
    t0 = time.time()
    r = client.run("sbatch", "--parsable", f"--array=1-{jobs}", "--gres=gpu:1", "-o", "/dev/null", str(script))
    if r.returncode != 0:
        raise SlurmUnavailable(f"sbatch failed: {r.stderr.strip()}")
    job = r.stdout.strip().split(";")[0]
    end = time.monotonic() + timeout
    at_placed: dict[str, float] | None = None
    t_placed = 0.0
    while True:
        if at_placed is None:
            t_poll = time.time()  # slurmctld answers after this: the last placement came before the answer
            q = client.run("squeue", "-h", "-t", "PD", "-j", job, "-o", "%i")
            if q.returncode == 0 and not q.stdout.strip():
                t_placed = t_poll - t0
                at_placed = cpu.sample()
        if at_placed is not None and len(os.listdir(stamps)) >= jobs:
            at_started = cpu.sample()
            break
        if time.monotonic() > end:
            raise SlurmUnavailable(f"{len(os.listdir(stamps))} of {jobs} job scripts started in {timeout:.0f} s")
        time.sleep(poll_s)
    starts = read_stamps(stamps, jobs)
    while client.run("squeue", "-h", "-j", job, "-o", "%i").stdout.strip():  # done before the next round
        if time.monotonic() > end:
            raise SlurmUnavailable(f"array {job} still in the queue after {timeout:.0f} s")
        time.sleep(0.2)
    return {
        "jobs": jobs,
        "last_placed_s": t_placed,
        "placements_per_s": jobs / t_placed,
        "last_started_s": max(starts) - t0,
        "first_started_s": min(starts) - t0,
        "cpu_per_1000_to_last_placed": cpu.per_1000(cpu0, at_placed, jobs),
        "cpu_per_1000_to_last_started": cpu.per_1000(cpu0, at_started, jobs),
    }


def read_stamps(folder: Path, jobs: int) -> list[float]:
    """Each job script's start (epoch s); waits out a script still writing its line."""
    for _ in range(100):
        try:
            return [float((folder / str(i)).read_text()) for i in range(1, jobs + 1)]
        except ValueError:
            time.sleep(0.05)
    raise SlurmUnavailable(f"a job script in {folder} left an empty start stamp")


#: apportion's ways of submitting the jobs: one signed record per job, or one job array (one record).
APPORTION = ("apportion", "apportion-array")


def apportion_round(stack: Any, tmp: Path, nodes: int, jobs: int, timeout: float, array: bool) -> dict[str, Any]:
    run = LiveRun(stack.bootstrap, stack.redis_url, tmp, nodes, *bench_live.server_pids(stack))
    try:
        run.start()
        return throughput(run, jobs, timeout, array=array)
    finally:
        run.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=1000, help="jobs per round, one GPU each (default 1000)")
    ap.add_argument("--nodes", type=int, default=0, help="nodes of 8 GPUs on each side (default: jobs / 8 + 1)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each system, alternated (default 3)")
    ap.add_argument("--poll-s", type=float, default=0.05, help="Slurm: squeue / start-stamp poll interval")
    ap.add_argument("--timeout-s", type=float, default=600, help="per round")
    ap.add_argument(
        "--systems",
        default="slurm,apportion,apportion-array",
        help="which to run (default all three; apportion-array: the same jobs as one job array)",
    )
    ap.add_argument("--quick", action="store_true", help="one round of each (a few minutes at 1,000 jobs)")
    ap.add_argument("--no-install", action="store_true", help="fail instead of apt-get installing Slurm")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder (configs, logs)")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout instead of the text figures")
    args = ap.parse_args()
    if args.quick:
        args.rounds = 1
    systems = [s for s in args.systems.split(",") if s]
    if set(systems) - {"slurm", *APPORTION} or not systems:
        ap.error(f"--systems: slurm, apportion and/or apportion-array, got {args.systems!r}")
    nodes = args.nodes or args.jobs // GPUS_PER_NODE + 1
    for sig in (signal.SIGTERM, signal.SIGINT):  # SIGINT too: a shell's background job starts with it ignored
        signal.signal(sig, _interrupt)  # the finally blocks stop what was started
    found: dict[str, Any] = {"jobs": args.jobs, "nodes": nodes, "gpus_per_node": GPUS_PER_NODE, "rounds": []}
    with scratch_dir("apportion-vs-slurm-", args.keep) as tmp:
        try:
            with contextlib.ExitStack() as stop:
                cluster = stack = None
                if "slurm" in systems:
                    found["slurm_version"] = ensure_slurm(not args.no_install)
                    log(f"{found['slurm_version']}: starting munged, slurmctld and {nodes} slurmd in {tmp / 'slurm'}")
                    cluster = SlurmCluster(tmp / "slurm", nodes, args.jobs)
                    stop.callback(cluster.stop)
                    cluster.start()
                    found["slurm_gres"] = cluster.gres_note
                    log(f"slurm up: {nodes} nodes idle; GPUs: {cluster.gres_note}")
                if set(APPORTION) & set(systems):
                    from apportion.bus.stack import LocalStack

                    os.environ.pop("APPORTION_NO_TLS", None)
                    log("starting Kafka and Redis (TLS)")
                    stack = LocalStack(tmp / "stack")
                    stop.callback(stack.stop)  # before start: an interrupted start is stopped too
                    stack.start()
                for rnd in range(1, args.rounds + 1):
                    for system in systems:
                        log(f"round {rnd}: {system}, {args.jobs} jobs")
                        if system == "slurm":
                            assert cluster is not None
                            got = slurm_round(cluster, args.jobs, rnd, args.poll_s, args.timeout_s)
                        else:
                            where = tmp / f"live{rnd}{system[9:]}"
                            got = apportion_round(
                                stack, where, nodes, args.jobs, args.timeout_s, system == "apportion-array"
                            )
                        got.update(system=system, round=rnd)
                        found["rounds"].append(got)
                        log(one_line(got))
                found["load_avg"] = [round(x, 1) for x in os.getloadavg()]
        except SlurmUnavailable as exc:
            print(f"bench-slurm: Slurm unavailable: {exc}", file=sys.stderr)
            return 2
        except BenchError as exc:
            print(f"bench-slurm: apportion run failed: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("bench-slurm: interrupted; everything it started is stopped", file=sys.stderr)
            return 130
    found["medians"] = medians(found["rounds"])
    if args.json:
        print(json.dumps(found, indent=1))
    else:
        print(report(found))
    return 0


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def one_line(got: dict[str, Any]) -> str:
    cpu = got["cpu_per_1000_to_last_started"]
    return (
        f"{got['system']} round {got['round']}: {got['placements_per_s']:,.0f} placements/s, last start at "
        f"{got['last_started_s']:.2f} s, CPU {cpu['total']:.2f} s per 1,000 to the last start"
    )


def medians(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per system: the median of each figure and of each component's CPU over the rounds; apportion / Slurm."""
    out: dict[str, Any] = {}
    for system in {r["system"] for r in rounds}:
        mine = [r for r in rounds if r["system"] == system]
        m: dict[str, Any] = {
            k: statistics.median(r[k] for r in mine) for k in ("placements_per_s", "last_placed_s", "last_started_s")
        }
        for col in ("cpu_per_1000_to_last_placed", "cpu_per_1000_to_last_started"):
            m[col] = {c: statistics.median(r[col][c] for r in mine) for c in mine[0][col]}
        out[system] = m
    for system in APPORTION:
        if {"slurm", system} <= out.keys():
            a, s = out[system], out["slurm"]
            out[f"{system.replace('-', '_')}_over_slurm"] = {
                "placements_per_s": a["placements_per_s"] / s["placements_per_s"],
                "last_started_s": a["last_started_s"] / s["last_started_s"],
                "cpu_to_last_placed": a["cpu_per_1000_to_last_placed"]["total"]
                / s["cpu_per_1000_to_last_placed"]["total"],
                "cpu_to_last_started": a["cpu_per_1000_to_last_started"]["total"]
                / s["cpu_per_1000_to_last_started"]["total"],
            }
    return out


def report(found: dict[str, Any]) -> str:
    lines = [
        f"{found['jobs']} one-GPU jobs, {found['nodes']} nodes x {found['gpus_per_node']} GPUs on each side; "
        f"{found.get('slurm_version', '')}; load average at the end {found.get('load_avg', ['?'])[0]}",
        f"{'round':<6}{'system':<16}{'placements/s':>14}{'last placed s':>15}{'last start s':>14}"
        f"{'CPU/1000 placed':>17}{'CPU/1000 started':>18}",
    ]
    for r in found["rounds"]:
        lines.append(
            f"{r['round']:<6}{r['system']:<16}{r['placements_per_s']:>14,.0f}{r['last_placed_s']:>15.2f}"
            f"{r['last_started_s']:>14.2f}{r['cpu_per_1000_to_last_placed']['total']:>17.2f}"
            f"{r['cpu_per_1000_to_last_started']['total']:>18.2f}"
        )
    med = found["medians"]
    for system in ("slurm", *APPORTION):
        if system in med:
            m = med[system]
            lines.append(
                f"median {system}: {m['placements_per_s']:,.0f} placements/s, last placed {m['last_placed_s']:.2f} s, "
                f"last start {m['last_started_s']:.2f} s"
            )
            meas = SLURM_MEASUREMENT if system == "slurm" else ("watcher",)
            lines.append(
                budget_table(
                    {
                        "to last placement": m["cpu_per_1000_to_last_placed"],
                        "to last start": m["cpu_per_1000_to_last_started"],
                    },
                    measurement=meas,
                )
            )
    for system in APPORTION:
        q = med.get(f"{system.replace('-', '_')}_over_slurm")
        if q is None:
            continue
        lines.append(
            f"{system} / Slurm (medians): placements/s {q['placements_per_s']:.2f}x; time to the last start "
            f"{q['last_started_s']:.2f}x; CPU to the last placement {q['cpu_to_last_placed']:.2f}x, to the last "
            f"start {q['cpu_to_last_started']:.2f}x (Slurm runs real job scripts; apportion simulated workloads)"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
