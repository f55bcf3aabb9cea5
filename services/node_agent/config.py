"""Node agent settings (env prefix ``APPORTION_``; CLI flags override them).

Two modes:

* **real node** (``sim_nodes == 0``): one node, id ``node_id`` (default the
  host name); GPUs from NVML, or ``gpus_per_node`` x ``gpu_model`` declared
  when no NVIDIA driver answers (logged).
* **simulated nodes** (``sim_nodes > 0``): ``sim_nodes`` nodes named
  ``node_prefix`` + index (``sim-00`` ..), each ``gpus_per_node`` x
  ``gpu_model``; commands for ids with that prefix that are not hosted are
  refused. Give each agent process its own prefix.

Time: ``heartbeat_interval_s`` and workload durations are event-time
seconds (scaled by the clock); ``heartbeat_min_wall_s`` caps the heartbeat
rate in wall time so a fast clock does not flood the bus (so with scale S
the heartbeat period in event time is at least ``S * heartbeat_min_wall_s``:
the dispatcher's heartbeat timeout must exceed that).
"""

from __future__ import annotations

import re
import socket
import tempfile
from pathlib import Path
from typing import Literal

from pydantic import Field

from apportion.bus.service import ServiceSettings


class NodeAgentSettings(ServiceSettings):
    """Settings of one node-agent process.

    Attributes:
        node_id: id of the real node (default: host name).
        sim_nodes: number of simulated nodes to host (0 = one real node).
        sim_node_start: first index of the simulated node ids.
        node_prefix: prefix of simulated node ids.
        gpus_per_node: GPUs per simulated node, and the declared fallback inventory.
        gpu_model: model of simulated / declared GPUs.
        force_simulated: do not try NVML even for the real node.
        sim_util_seed: seed of the GPU utilisation that simulated workloads on
            simulated nodes report in heartbeats (deterministic per job,
            about 5% of jobs idle: :func:`services.node_agent.logic.simulated_utilisation`);
            ``None`` reports none.
        heartbeat_interval_s: event seconds between heartbeats.
        heartbeat_min_wall_s: minimum wall seconds between heartbeats.
        state_dir: where the run journal lives; default a per-agent
            temporary directory (:meth:`data_dir`; the agent starts only when that
            one is its own: ``sandbox.private_dir``), so a restarted agent keeps
            its runs, its newest fencing token and its ended replicas. Point it
            at persistent storage (``/var/lib/apportion``) on a real node.
        memory_journal: keep the journal in memory only (tests, throwaway
            demos): a restarted agent then cannot adopt its runs or recognise
            redelivered commands.
        checkpoint_root: directory of the jobs' persistent checkpoint
            directories, also their working directories (``docs/checkpoints.md``);
            default ``<state_dir>/checkpoints``, or
            ``<tmp>/apportion-node-agent-<agent>/checkpoints`` without a state dir.
            Point it at storage the nodes share for jobs to resume on another node.
        job_log_dir: directory of the per-job stdout/stderr files; default
            ``job-logs`` beside the default checkpoint root.
        progress_poll_wall_s: wall seconds between looks at the progress files
            of running processes (each look is one ``stat`` per process).
        group_id: consumer group for commands (default ``<topic prefix>node-agent.<prefix or node id>``).
        group_instance_id: static group membership id (Kafka KIP-345; default
            :meth:`instance_id`): a restarted agent takes its place in the group
            at once instead of waiting out the session timeout; ``""`` for
            dynamic membership.
        retention_s: event seconds an ended replica is remembered (a second
            start is refused) and a command stays executable.
        ended_cap: most ended replicas remembered, whatever their age.
        require_fenced_lost: ignore a ``NodeLost`` without a fencing token
            (set once every dispatcher stamps its token on ``NodeLost``).
        producer_name: written as ``producer`` on events.
        node_key_dir: directory of the hosted nodes' key files ``<node_id>.json``
            (``apportion keys init --node``); every report is signed with its
            node's key (rule D10.authentication). ``None``: the development keyring
            (``APPORTION_KEYRING``) makes and registers them.
        dispatcher_public_key_file: a file holding the dispatcher's public key (a JSON object with
            ``public_key``: the public half ``infra/signing-key.sh`` writes, or the keyring's
            ``service:dispatcher.json``). Set, a ``NodeLost`` not signed by that key is disregarded
            (``unauthenticated``; any ``node-agent`` principal may write ``apportion.nodes``) and its
            fencing token never remembered. ``None``: every loss is judged on its token only.
        job_isolation: run each process replica as its user's account, in a cgroup of its own, with a clean
            environment (:mod:`services.node_agent.sandbox`; ``docs/security.md``, "Node boundary"). Needs
            root. ``False`` runs processes as the agent itself (a development machine with no one else's
            code: never on a shared node).
        account_map_file: the ops' account map, one ``<user> <account>`` per line, for users whose Unix
            account is not named as they are (default: every user runs as the account of the same name).
        cgroup_root: where the node mounts its cgroups.
        cgroup_version: ``auto`` (v2 when ``cgroup_root`` is a unified hierarchy, else the v1 controllers
            under it), ``1`` or ``2``.
        cgroup_parent: the agent's cgroup, parent of the replicas' (default ``apportion/<topic prefix><agent>``).
        sandbox_memory_mb_per_gpu: memory limit of a replica per GPU it holds, MiB (``None``: the machine's
            memory divided by the GPUs of every node the agent hosts on it, :func:`services.node_agent.sandbox.memory_mb_per_gpu`).
        sandbox_cpu_weight_per_gpu: CPU weight of a replica per GPU it holds (cgroup v2 scale, 100 = one
            ordinary process; v1 ``cpu.shares`` = weight * 1024 / 100).
        sandbox_pids_max: most processes and threads in one replica.
        job_path, job_lang: ``PATH`` of every process (a submission may not set it: ``RESERVED_ENV``) and ``LANG``
            unless its job's ``env`` sets it.
        idle_after_s: event seconds a running replica's GPUs stay idle (below 1% in every heartbeat's sample)
            before its heartbeat reports it ``idle`` (``RunningWorkload.idle``).
        gpu_device_files: the device files of a declared (simulated) inventory's GPUs, in index order (NVML
            names a real node's: ``/dev/nvidia<minor>``).
        sandbox_disk_mb_per_gpu: disk limit of a job's directories on the node (its checkpoint directory, its output
            and its replicas' ``TMPDIR``) per GPU its replicas on the node hold, MiB; each file a replica writes is
            also limited to its own share (``RLIMIT_FSIZE``). ``None``: 90% of the space free on the job roots'
            file system when the agent starts, divided by every GPU the agent hosts
            (:func:`services.node_agent.sandbox.disk_mb_per_gpu`). A job over it is stopped (SIGTERM, the grace,
            SIGKILL) and reported ``JobFailed`` reason ``disk_quota`` (``docs/security.md``, "Disk").
        sandbox_disk_poll_wall_s: wall seconds between two measurements of the jobs' directories: what a replica can
            write beyond its limit is at most this period times its write rate (one file at most its limit).
        sandbox_closed_ports: ports on loopback that no process of a replica may connect to (``EPERM``), on a
            node with a cgroup v2 hierarchy (:mod:`services.node_agent.connfilter`); ``None``: the control
            plane's (:meth:`closed_ports`: a broker the bootstrap list does not name is not among them); ``[]``:
            none.
    """

    node_id: str | None = None
    sim_nodes: int = 0
    sim_node_start: int = 0
    node_prefix: str = "sim-"
    gpus_per_node: int = 8
    gpu_model: str = "sim-a100-80gb"
    force_simulated: bool = False
    sim_util_seed: int | None = 0
    heartbeat_interval_s: float = 10.0
    heartbeat_min_wall_s: float = 0.5
    state_dir: Path | None = None
    memory_journal: bool = False
    checkpoint_root: Path | None = None
    job_log_dir: Path | None = None
    progress_poll_wall_s: float = Field(default=1.0, gt=0)
    group_id: str | None = None
    group_instance_id: str | None = None
    retention_s: float = Field(default=24 * 3600.0, gt=0)
    ended_cap: int = Field(default=100_000, gt=0)
    require_fenced_lost: bool = False
    producer_name: str = "node-agent"
    node_key_dir: Path | None = None
    dispatcher_public_key_file: Path | None = None
    job_isolation: bool = True
    account_map_file: Path | None = None
    cgroup_root: Path = Path("/sys/fs/cgroup")
    cgroup_version: Literal["auto", "1", "2"] = "auto"
    cgroup_parent: str | None = None
    sandbox_memory_mb_per_gpu: int | None = Field(default=None, gt=0)
    sandbox_cpu_weight_per_gpu: int = Field(default=100, ge=1, le=10_000)
    sandbox_pids_max: int = Field(default=4096, gt=0)
    job_path: str = "/usr/local/bin:/usr/bin:/bin"
    job_lang: str = "C.UTF-8"
    gpu_device_files: list[str] | None = None
    idle_after_s: float = Field(default=2 * 3600.0, gt=0)
    sandbox_closed_ports: list[int] | None = None
    sandbox_disk_mb_per_gpu: int | None = Field(default=None, gt=0)
    sandbox_disk_poll_wall_s: float = Field(default=5.0, gt=0)

    def closed_ports(self) -> tuple[int, ...]:
        """The ports closed to jobs on loopback, ascending: :attr:`sandbox_closed_ports`, else those of the Kafka
        bootstrap servers and the Redis URL the agent uses (Redis's default 6379 when the URL names none).

        Raises:
            ValueError: a port outside 1-65535, or a bootstrap server without a numeric port.
        """
        if self.sandbox_closed_ports is not None:
            ports = set(self.sandbox_closed_ports)
        else:
            ports = self.connection().ports()
        bad = sorted(p for p in ports if not 0 < p < 65536)
        if bad:
            raise ValueError(f"sandbox_closed_ports: {bad} outside 1-65535")
        return tuple(sorted(ports))

    def cgroup_parent_path(self) -> str:
        """The agent's cgroup in force: :attr:`cgroup_parent`, else ``apportion/<topic prefix><agent>`` made safe."""
        if self.cgroup_parent:
            return self.cgroup_parent
        from apportion.settings import topic_prefix

        return "apportion/" + re.sub(r"[^A-Za-z0-9._-]", "_", f"{topic_prefix()}{self.agent_name()}")

    def dispatcher_public_key(self) -> str | None:
        """The base64 public key in :attr:`dispatcher_public_key_file`, or ``None`` when none is set.

        Raises:
            OSError: the file cannot be read.
            ValueError: it holds no ``public_key`` string (not a key file).
        """
        if self.dispatcher_public_key_file is None:
            return None
        import json

        key = json.loads(self.dispatcher_public_key_file.read_text()).get("public_key")
        if not isinstance(key, str):
            raise ValueError(f"{self.dispatcher_public_key_file} holds no public_key")
        return key

    def agent_name(self) -> str:
        """Stable name of this agent: the prefix in sim mode, else the node id."""
        if self.sim_nodes:
            return self.node_prefix.rstrip("-_.") or "sim"
        return self.real_node_id()

    def data_dir(self) -> Path:
        """Base of the journal and the default job directories: ``state_dir``, else a per-agent temporary directory.

        The temporary one is named after the agent and the topic namespace
        (``APPORTION_TOPIC_PREFIX``), so agents of different namespaces on one
        host never share a journal.
        """
        if self.state_dir is not None:
            return self.state_dir
        from apportion.settings import topic_prefix

        ns = re.sub(r"[^A-Za-z0-9._-]", "_", topic_prefix())
        return Path(tempfile.gettempdir()) / f"apportion-node-agent-{ns}{self.agent_name()}"

    def journal_path(self) -> Path | None:
        """The journal file (``<data dir>/<agent>.journal``), ``None`` with ``memory_journal``."""
        if self.memory_journal:
            return None
        return self.data_dir() / f"{self.agent_name()}.journal"

    def instance_id(self) -> str | None:
        """Static membership id of the commands consumer: ``<topic prefix>node-agent.<agent>``, or ``None``."""
        if self.group_instance_id is not None:
            return self.group_instance_id or None
        from apportion.settings import topic_prefix

        return f"{topic_prefix()}node-agent.{self.agent_name()}"

    def checkpoint_root_path(self) -> Path:
        """The checkpoint root in force (absolute)."""
        return (self.checkpoint_root or self.data_dir() / "checkpoints").absolute()

    def job_log_path(self) -> Path:
        """The job output directory in force (absolute)."""
        return (self.job_log_dir or self.data_dir() / "job-logs").absolute()

    def real_node_id(self) -> str:
        """The real node's id (``node_id`` or the host name)."""
        return self.node_id or socket.gethostname()

    def consumer_group(self) -> str:
        """Consumer group of the commands consumer: ``<topic prefix>node-agent.<agent>`` unless ``group_id``.

        In the topic namespace, like the static membership id (:meth:`instance_id`): a static member never
        leaves its group, so an agent of another namespace on the same broker (the main job's earlier run,
        whose namespace differs) under the same group name would hold it, and this agent's join would wait
        out that member's session timeout (45 s) before it could register (seen: every second ``make run``
        started 44 s late).
        """
        if self.group_id:
            return self.group_id
        from apportion.settings import topic_prefix

        return f"{topic_prefix()}node-agent.{self.agent_name()}"
