"""``python -m services.node_agent``: run a node agent (one real node or many simulated).

Examples::

    python -m services.node_agent                                  # this host, NVML or declared
    python -m services.node_agent --sim-nodes 32 --gpus-per-node 8 --node-prefix sim-
    APPORTION_TIME_SCALE=600 python -m services.node_agent --sim-nodes 4

Every flag has an ``APPORTION_<NAME>`` environment variable; flags win.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from apportion.bus.principal import start_as
from apportion.bus.service import add_common_flags, flag_overrides, serve
from services.node_agent.config import NodeAgentSettings


def parse_args(argv: list[str] | None = None) -> dict:
    """Command-line flags -> settings overrides (only the flags given)."""
    ap = argparse.ArgumentParser(
        prog="python -m services.node_agent",
        description="apportion node agent: registers nodes, heartbeats, runs StartWorkload/StopWorkload commands.",
    )
    ap.add_argument("--node-id", help="id of the real node (default: host name)")
    ap.add_argument("--sim-nodes", type=int, help="host this many simulated nodes (0: one real node)")
    ap.add_argument("--sim-node-start", type=int, help="first index of simulated node ids")
    ap.add_argument("--node-prefix", help="simulated node id prefix (default sim-)")
    ap.add_argument("--gpus-per-node", type=int, help="GPUs per simulated node / declared fallback")
    ap.add_argument("--gpu-model", help="model name of simulated GPUs")
    ap.add_argument("--force-simulated", action="store_true", default=None, help="skip NVML")
    ap.add_argument(
        "--sim-util-seed", type=int, help="seed of the GPU utilisation simulated workloads report (default 0)"
    )
    ap.add_argument("--heartbeat-interval-s", type=float, help="event seconds between heartbeats")
    ap.add_argument("--state-dir", type=Path, help="journal directory (default: a per-agent temporary directory)")
    ap.add_argument(
        "--memory-journal", action="store_true", default=None, help="keep the journal in memory only (demos)"
    )
    ap.add_argument("--group-instance-id", help='static consumer-group member id ("" for dynamic membership)')
    ap.add_argument(
        "--require-fenced-lost", action="store_true", default=None, help="ignore NodeLost without a fencing token"
    )
    ap.add_argument("--checkpoint-root", type=Path, help="jobs' persistent checkpoint directories")
    ap.add_argument("--job-log-dir", type=Path, help="per-job stdout/stderr files")
    ap.add_argument("--progress-poll-wall-s", type=float, help="wall seconds between looks at progress files")
    ap.add_argument(
        "--job-isolation",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run processes as their users' accounts in cgroups of their own (--no-job-isolation: as the agent)",
    )
    ap.add_argument("--account-map-file", type=Path, help="the ops' account map: '<user> <account>' per line")
    ap.add_argument("--cgroup-root", type=Path, help="where the node mounts its cgroups")
    ap.add_argument("--cgroup-version", choices=("auto", "1", "2"), help="cgroup driver")
    ap.add_argument("--cgroup-parent", help="the agent's cgroup, parent of the replicas'")
    ap.add_argument("--sandbox-memory-mb-per-gpu", type=int, help="memory limit of a replica per GPU, MiB")
    ap.add_argument("--sandbox-cpu-weight-per-gpu", type=int, help="CPU weight of a replica per GPU")
    ap.add_argument("--sandbox-pids-max", type=int, help="most processes and threads of a replica")
    ap.add_argument(
        "--sandbox-disk-mb-per-gpu",
        type=int,
        help="disk limit of a job's directories on the node per GPU its replicas hold, MiB "
        "(default: 9/10 of the job roots' free space over every hosted GPU)",
    )
    ap.add_argument(
        "--sandbox-disk-poll-wall-s", type=float, help="wall seconds between measurements of the jobs' directories"
    )
    ap.add_argument("--idle-after-s", type=float, help="event seconds of idle GPUs before a run is reported idle")
    add_common_flags(ap, NodeAgentSettings)
    return flag_overrides(ap, argv)


def main(argv: list[str] | None = None) -> None:
    """Entry point: settings from flags and environment, then run until SIGTERM."""
    from services.node_agent.app import run

    args = parse_args(argv)
    start_as("node_agent")  # its own Kafka principal, or exit 2 saying which to set
    serve("node-agent", NodeAgentSettings(**args), run)


if __name__ == "__main__":
    main()
