"""GPU discovery and sampling behind a small interface (STYLE rule 9).

A node agent asks a :class:`GpuProbe` for the node's :class:`Inventory`
once (for ``NodeRegistered``) and for per-GPU :class:`~apportion.events.GpuStatus`
samples on every heartbeat. Three probes:

* :class:`NvmlProbe` - real GPUs through ``pynvml`` (package ``nvidia-ml-py``);
* :class:`SimulatedProbe` - a declared inventory (``gpu_count`` x ``model``)
  for machines without an NVIDIA driver and for simulated nodes; samples
  report health only (utilisation and memory ``None``: unknown);
* :class:`FakeGpuProbe` - tests: inventory and samples set by the test.

:func:`open_probe` tries NVML and falls back to the declared inventory when
no driver is present (``NVMLError_LibraryNotFound``, ``NVMLError_DriverNotLoaded``
or pynvml missing), logging one line that says which it uses and why;
:func:`probe` returns just the :class:`Inventory`.

Nothing is imported from pynvml or initialised at import time.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from apportion.events import GpuInfo, GpuStatus

log = logging.getLogger(__name__)

DEFAULT_SIM_MODEL = "sim-a100-80gb"
"""GPU model name of simulated inventories unless one is declared."""

#: Device files of the NVIDIA driver every process using a GPU opens, whichever GPUs it was given (the node
#: agent allows those present to every replica with GPUs).
NVIDIA_CONTROL_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")


def control_devices(candidates: Sequence[str] = NVIDIA_CONTROL_DEVICES) -> tuple[str, ...]:
    """The NVIDIA control devices present on this node."""
    return tuple(p for p in candidates if os.path.exists(p))


@dataclass(frozen=True, slots=True)
class Inventory:
    """The GPUs of one node.

    Attributes:
        gpus: one :class:`GpuInfo` per device, by index 0..n-1.
        model: the model name when every GPU is the same model, else ``None``.
        simulated: True for a declared (not discovered) inventory.
        source: ``"nvml"`` or ``"simulated: <why>"``, for logs and events.
        device_files: GPU index -> its device file (``/dev/nvidia<minor>`` from NVML; a declared inventory's
            are configured, or none): the node agent lets a replica open only its own GPUs' files.
    """

    gpus: tuple[GpuInfo, ...]
    model: str | None
    simulated: bool
    source: str
    device_files: Mapping[int, str] = field(default_factory=dict)

    @property
    def gpu_count(self) -> int:
        """Number of GPUs."""
        return len(self.gpus)

    @property
    def indices(self) -> frozenset[int]:
        """GPU indices present on the node."""
        return frozenset(g.index for g in self.gpus)


def sim_node_ids(prefix: str, count: int, start: int = 0) -> list[str]:
    """Simulated node ids ``prefix + index``, zero-padded to a common width (``sim-00``..``sim-31``).

    The node agent names its simulated nodes so (``--sim-nodes``), and ``apportion stack up`` registers
    their keys under the same names before it starts the agent.
    """
    width = len(str(start + count - 1)) if count else 1
    return [f"{prefix}{i:0{width}d}" for i in range(start, start + count)]


def simulated_inventory(
    gpu_count: int,
    model: str = DEFAULT_SIM_MODEL,
    memory_mb: int | None = 81920,
    reason: str = "declared",
    device_files: Sequence[str] | None = None,
) -> Inventory:
    """A declared inventory of ``gpu_count`` identical GPUs (indices 0..n-1), GPU ``i`` with device file
    ``device_files[i]`` when given.

    Raises:
        ValueError: ``gpu_count < 0``, or ``device_files`` does not name one file per GPU.
    """
    if gpu_count < 0:
        raise ValueError(f"gpu_count must be >= 0, got {gpu_count}")
    if device_files is not None and len(device_files) != gpu_count:
        raise ValueError(f"{len(device_files)} device file(s) declared for {gpu_count} GPU(s)")
    gpus = tuple(GpuInfo(index=i, uuid=None, name=model, memory_mb=memory_mb) for i in range(gpu_count))
    return Inventory(gpus, model, True, f"simulated: {reason}", dict(enumerate(device_files or ())))


@runtime_checkable
class GpuProbe(Protocol):
    """What a node agent needs from the GPUs."""

    @property
    def inventory(self) -> Inventory:
        """The node's GPUs (fixed for the probe's lifetime)."""
        ...

    def sample(self) -> tuple[GpuStatus, ...]:
        """Health, utilisation (%) and memory used (MiB) per GPU, by index."""
        ...

    def close(self) -> None:
        """Release the driver handle (idempotent)."""
        ...


class SimulatedProbe:
    """A declared inventory; samples say healthy with unknown utilisation."""

    def __init__(self, inventory: Inventory) -> None:
        self._inv = inventory

    @property
    def inventory(self) -> Inventory:
        return self._inv

    def sample(self) -> tuple[GpuStatus, ...]:
        return tuple(GpuStatus(index=g.index, healthy=True) for g in self._inv.gpus)

    def close(self) -> None:
        return None


class NvmlProbe:
    """Real GPUs through NVML. Build with :meth:`open`.

    Args:
        nvml: the ``pynvml`` module (injected so tests can pass a stand-in).
    """

    def __init__(self, nvml: Any, inventory: Inventory, handles: list[Any]) -> None:
        self._nvml = nvml
        self._inv = inventory
        self._handles = handles
        self._open = True

    @classmethod
    def open(cls, nvml: Any | None = None) -> NvmlProbe:
        """Initialise NVML and read the inventory.

        Raises:
            ImportError: pynvml (nvidia-ml-py) is not installed.
            pynvml.NVMLError: no driver (``NVMLError_LibraryNotFound``), driver
                not loaded, or another NVML failure.
        """
        if nvml is None:
            import importlib

            nvml = importlib.import_module("pynvml")  # deliberately lazy: NVML is optional
        assert nvml is not None
        nvml.nvmlInit()
        try:
            n = nvml.nvmlDeviceGetCount()
            handles, gpus, files = [], [], {}
            for i in range(n):
                h = nvml.nvmlDeviceGetHandleByIndex(i)
                handles.append(h)
                files[i] = f"/dev/nvidia{int(nvml.nvmlDeviceGetMinorNumber(h))}"
                name = _text(nvml.nvmlDeviceGetName(h))
                uuid = _text(nvml.nvmlDeviceGetUUID(h))
                mem = nvml.nvmlDeviceGetMemoryInfo(h)
                gpus.append(GpuInfo(index=i, uuid=uuid, name=name, memory_mb=int(mem.total // (1 << 20))))
            names = {g.name for g in gpus}
            model = names.pop() if len(names) == 1 else None
            return cls(nvml, Inventory(tuple(gpus), model, False, "nvml", files), handles)
        except BaseException:
            nvml.nvmlShutdown()
            raise

    @property
    def inventory(self) -> Inventory:
        return self._inv

    def sample(self) -> tuple[GpuStatus, ...]:
        """One reading per GPU; a GPU whose query fails is reported unhealthy."""
        out = []
        for g, h in zip(self._inv.gpus, self._handles):
            try:
                util = self._nvml.nvmlDeviceGetUtilizationRates(h)
                mem = self._nvml.nvmlDeviceGetMemoryInfo(h)
                out.append(
                    GpuStatus(
                        index=g.index,
                        healthy=True,
                        utilization_pct=float(util.gpu),
                        memory_used_mb=int(mem.used // (1 << 20)),
                    )
                )
            except self._nvml.NVMLError as exc:  # e.g. GPU fell off the bus
                log.warning("NVML query of GPU %d failed: %s", g.index, exc)
                out.append(GpuStatus(index=g.index, healthy=False))
        return tuple(out)

    def close(self) -> None:
        if self._open:
            self._open = False
            self._nvml.nvmlShutdown()


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


@dataclass
class FakeGpuProbe:
    """Test double: a declared inventory with samples the test controls.

    Attributes:
        inventory: what :meth:`sample` reports on; default 8 simulated GPUs.
        utilization: GPU index -> utilisation % to report (missing: ``None``).
        memory_used_mb: GPU index -> memory used to report (missing: ``None``).
        unhealthy: GPU indices reported unhealthy.
        closed: set by :meth:`close`.
    """

    inventory: Inventory = field(default_factory=lambda: simulated_inventory(8, reason="fake"))
    utilization: dict[int, float] = field(default_factory=dict)
    memory_used_mb: dict[int, int] = field(default_factory=dict)
    unhealthy: set[int] = field(default_factory=set)
    closed: bool = False

    @classmethod
    def with_gpus(cls, n: int, model: str = DEFAULT_SIM_MODEL) -> FakeGpuProbe:
        """A fake with ``n`` GPUs of ``model``."""
        return cls(simulated_inventory(n, model, reason="fake"))

    def sample(self) -> tuple[GpuStatus, ...]:
        return tuple(
            GpuStatus(
                index=g.index,
                healthy=g.index not in self.unhealthy,
                utilization_pct=self.utilization.get(g.index),
                memory_used_mb=self.memory_used_mb.get(g.index),
            )
            for g in self.inventory.gpus
        )

    def close(self) -> None:
        self.closed = True


def open_probe(
    fallback_gpus: int = 8,
    fallback_model: str = DEFAULT_SIM_MODEL,
    *,
    force_simulated: bool = False,
    nvml: Any | None = None,
    device_files: Sequence[str] | None = None,
) -> GpuProbe:
    """The real GPUs when an NVIDIA driver answers, else the declared inventory.

    Args:
        fallback_gpus: GPU count of the declared inventory.
        fallback_model: model name of the declared inventory.
        force_simulated: skip NVML (simulated nodes on a GPU machine).
        nvml: a pynvml stand-in (tests); default imports ``pynvml``.
        device_files: the declared inventory's device files, one per GPU in index order.

    Returns:
        An open probe; the caller closes it. Logs one line saying whether
        the inventory is real (NVML) or simulated, and why.
    """
    if force_simulated:
        inv = simulated_inventory(fallback_gpus, fallback_model, reason="requested", device_files=device_files)
        log.info("GPU inventory: simulated (requested), %d x %s", inv.gpu_count, fallback_model)
        return SimulatedProbe(inv)
    try:
        p = NvmlProbe.open(nvml)
    except ImportError as exc:
        why = f"pynvml not importable ({exc})"
    except Exception as exc:  # noqa: BLE001 - pynvml.NVMLError_* (no driver, driver not loaded, ...)
        why = f"NVML unavailable: {type(exc).__name__}: {exc}"
    else:
        log.info("GPU inventory: NVML, %d GPU(s), model %s", p.inventory.gpu_count, p.inventory.model)
        return p
    inv = simulated_inventory(fallback_gpus, fallback_model, reason=why, device_files=device_files)
    log.warning("GPU inventory: SIMULATED %d x %s because %s", inv.gpu_count, fallback_model, why)
    return SimulatedProbe(inv)


def probe(
    fallback_gpus: int = 8, fallback_model: str = DEFAULT_SIM_MODEL, *, force_simulated: bool = False
) -> Inventory:
    """The node's :class:`Inventory` (NVML, or the declared fallback); see :func:`open_probe`."""
    p = open_probe(fallback_gpus, fallback_model, force_simulated=force_simulated)
    try:
        return p.inventory
    finally:
        p.close()
