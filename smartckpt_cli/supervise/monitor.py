"""Resource use of the supervised process tree: CPU and memory through psutil, GPU through NVML.

psutil's ``cpu_percent`` measures between two calls on the *same* ``Process`` object, so the
objects are cached by pid (and dropped when their process goes). GPU figures come from
nvidia-ml-py (``pip install 'smartckpt[gpu]'``) when it imports and finds a driver; a machine
without a GPU is normal and simply reports none.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

__all__ = ["GpuMonitor", "TreeMonitor", "Usage", "oom_kills"]

logger = logging.getLogger(__name__)


@dataclass
class Usage:
    processes: int = 0
    cpu_percent: float = 0.0  # summed over the tree (100 = one core)
    rss: int = 0  # bytes, summed over the tree
    mem_available: int = 0  # bytes the machine still has
    gpus: list[dict[str, Any]] = field(default_factory=list)  # index, util, mem_used, mem_total
    gpu_mem_tree: int = 0  # bytes of GPU memory held by the tree's processes

    def line(self) -> str:
        s = f"cpu {self.cpu_percent:.0f}% rss {self.rss / 2**30:.2f} GiB ({self.processes} proc)"
        for g in self.gpus:
            s += (
                f"; gpu{g['index']} {g['util']}% {g['mem_used'] / 2**30:.1f}/{g['mem_total'] / 2**30:.0f} GiB"
            )
        return s


class TreeMonitor:
    """CPU and memory of a process and its descendants."""

    def __init__(self, root_pid: int) -> None:
        self.root_pid = root_pid
        self._procs: dict[int, psutil.Process] = {}

    def pids(self) -> list[int]:
        return list(self._procs)

    def sample(self) -> Usage:
        try:
            root = self._procs.get(self.root_pid) or psutil.Process(self.root_pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            tree = []
        fresh: dict[int, psutil.Process] = {}
        for p in tree:
            cached = self._procs.get(p.pid)
            # A reused pid is a different process: the creation time tells them apart.
            fresh[p.pid] = cached if cached is not None and _same(cached, p) else p
        self._procs = fresh
        usage = Usage(mem_available=psutil.virtual_memory().available)
        for p in fresh.values():
            try:
                with p.oneshot():
                    usage.cpu_percent += p.cpu_percent(None)
                    usage.rss += p.memory_info().rss
                usage.processes += 1
            except psutil.Error:
                continue
        return usage


def _same(a: psutil.Process, b: psutil.Process) -> bool:
    try:
        return a.create_time() == b.create_time()
    except psutil.Error:
        return False


class GpuMonitor:
    """GPU utilisation and memory through NVML; ``available`` is False without it (no error)."""

    def __init__(self) -> None:
        self._nvml: Any = None
        self._handles: list[Any] = []
        try:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self._nvml = pynvml
        except Exception as err:  # ImportError, or NVMLError: no driver, no GPU
            logger.debug("no GPU monitoring: %s", err)
            self._nvml = None

    @property
    def available(self) -> bool:
        return self._nvml is not None and bool(self._handles)

    def sample(self, usage: Usage, pids: set[int]) -> None:
        if not self.available:
            return
        nv = self._nvml
        for i, h in enumerate(self._handles):
            try:
                util = nv.nvmlDeviceGetUtilizationRates(h).gpu
                mem = nv.nvmlDeviceGetMemoryInfo(h)
                usage.gpus.append({"index": i, "util": util, "mem_used": mem.used, "mem_total": mem.total})
                usage.gpu_mem_tree += sum(p.usedGpuMemory or 0 for p in self._procs(h) if p.pid in pids)
            except Exception as err:
                logger.debug("NVML query of GPU %d failed: %s", i, err)

    def _procs(self, handle: Any) -> list[Any]:
        nv = self._nvml
        procs = list(nv.nvmlDeviceGetComputeRunningProcesses(handle))
        try:
            procs += list(nv.nvmlDeviceGetGraphicsRunningProcesses(handle))
        except Exception:
            pass
        return procs

    def held_by(self, pids: set[int]) -> int:
        """GPU memory (bytes) still held by any of ``pids``."""
        if not self.available or not pids:
            return 0
        held = 0
        for h in self._handles:
            try:
                held += sum(p.usedGpuMemory or 0 for p in self._procs(h) if p.pid in pids)
            except Exception:
                continue
        return held

    def wait_freed(self, pids: set[int], timeout: float = 120.0, poll: float = 0.5) -> tuple[bool, float]:
        """Wait until the processes of a dead attempt hold no GPU memory (the driver frees it
        once their contexts are torn down). Returns (freed, seconds waited); (True, 0) without
        NVML."""
        t0 = time.monotonic()
        if not self.available:
            return True, 0.0
        while self.held_by(pids) > 0:
            if time.monotonic() - t0 > timeout:
                return False, time.monotonic() - t0
            time.sleep(poll)
        return True, time.monotonic() - t0


def oom_kills() -> int | None:
    """The cgroup v2 ``oom_kill`` counter of this process's cgroup (children share it), or None.
    An increase across an attempt that died by SIGKILL means the kernel's OOM killer did it."""
    try:
        cg = Path("/proc/self/cgroup").read_text().strip().splitlines()
        rel = next(line.split("::", 1)[1] for line in cg if line.startswith("0::"))
        events = Path("/sys/fs/cgroup") / rel.lstrip("/") / "memory.events"
        for line in events.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return None


def near_memory_limit(usage: Usage | None, fraction: float = 0.9) -> bool:
    """The tree's last sampled RSS was at least ``fraction`` of what it could have had."""
    if usage is None or usage.rss == 0:
        return False
    return usage.rss >= fraction * (usage.rss + usage.mem_available)
