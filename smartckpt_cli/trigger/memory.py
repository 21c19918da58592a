"""How close this process is to the memory ceiling that would kill it: a signal for the trigger.

An out-of-memory kill gives no warning a process can act on (the kernel's OOM killer sends
SIGKILL; CUDA raises in the middle of a step), so the checkpoint has to come *before* it. The
ceilings that kill a training process, each read as (bytes in use, bytes allowed):

* the **cgroup** it runs in (SLURM, Kubernetes, systemd, docker): v2 ``memory.max`` against
  ``memory.current``, v1 ``memory.limit_in_bytes`` against ``memory.usage_in_bytes``, the
  tightest limit of the process's cgroup and its ancestors. Page cache the kernel can drop first
  (``inactive_file`` of ``memory.stat``) is not counted as in use: writing checkpoints fills the
  cache, and the OOM killer only acts once reclaim fails (the "working set" Kubernetes evicts on);
* ``RLIMIT_AS`` (``ulimit -v``) against the process's virtual size (``/proc/self/statm``);
* each **CUDA** device this process has initialised: ``torch.cuda.mem_get_info`` gives what the
  whole device has in use; blocks PyTorch's caching allocator holds but does not use
  (reserved − allocated) are subtracted, since PyTorch frees them before it raises out-of-memory.

:meth:`MemoryProbe.read` returns the ceiling with the highest fraction in use. It is called at
evaluation steps only. The cgroup files are kept open and read with one ``pread`` each (a few
microseconds: cgroupfs regenerates them at offset 0); nothing here imports torch unless CUDA is
already initialised. Which cgroups hold the process is found once, at construction; their limits
are read again each time (a limit may be set or changed while the job runs).
"""

from __future__ import annotations

import logging
import os
import resource
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MemoryProbe", "MemorySample", "cgroup_ceilings"]

logger = logging.getLogger(__name__)

# cgroup v1 writes "no limit" as the largest page-aligned signed 64-bit number; anything above
# 2**60 bytes is no limit in practice.
_UNLIMITED = 1 << 60


@dataclass(frozen=True)
class MemorySample:
    used: int  # bytes in use against the ceiling
    limit: int  # the ceiling, bytes
    source: str  # which ceiling: "cgroup v1 /a/b", "cgroup v2 /a", "RLIMIT_AS", "cuda:0"

    @property
    def fraction(self) -> float:
        return self.used / self.limit if self.limit > 0 else 0.0


def _limit(text: bytes | str) -> int | None:
    """A limit file's value in bytes; None for no limit ("max", or v1's huge number)."""
    text = text.strip()
    try:
        value = int(text)
    except ValueError:
        return None  # "max"
    return value if 0 < value < _UNLIMITED else None


def _mounts(mountinfo: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(root, mount point) of every cgroup v1 memory mount and every cgroup v2 mount."""
    v1: list[tuple[str, str]] = []
    v2: list[tuple[str, str]] = []
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        root, point = fields[3], fields[4].replace("\\040", " ")
        if tail[0] == "cgroup2":
            v2.append((root, point))
        elif tail[0] == "cgroup" and "memory" in tail[2].split(","):
            v1.append((root, point))
    return v1, v2


def _inside(path: str, root: str) -> str:
    """``path`` (from /proc/self/cgroup) relative to a mount whose root is ``root``."""
    if root != "/" and (path == root or path.startswith(root + "/")):
        path = path[len(root) :] or "/"
    return path


def _name(here: Path, point: str) -> str:
    rel = here.relative_to(point).as_posix()
    return "/" if rel == "." else "/" + rel


def cgroup_ceilings(proc_cgroup: str, mountinfo: str) -> list[tuple[str, Path, Path, Path, str]]:
    """The memory cgroups of a process, from the text of ``/proc/<pid>/cgroup`` and
    ``/proc/<pid>/mountinfo``: (description, limit file, usage file, memory.stat file,
    inactive-file key) for the process's cgroup and each ancestor that has a limit file."""
    v1_mounts, v2_mounts = _mounts(mountinfo)
    out: list[tuple[str, Path, Path, Path, str]] = []
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            mounts, files = v2_mounts, ("v2", "memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            mounts, files = (
                v1_mounts,
                ("v1", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
            )
        else:
            continue
        version, limit, usage, key = files
        for root, point in mounts:
            rel = _inside(path, root).strip("/")
            here = Path(point) / rel if rel else Path(point)
            while True:
                if (here / limit).is_file() and (here / usage).is_file():
                    name = f"cgroup {version} {_name(here, point)}"
                    out.append((name, here / limit, here / usage, here / "memory.stat", key))
                if here == Path(point) or here.parent == here:
                    break
                here = here.parent
    return out


class _Cgroup:
    """One memory cgroup, its files kept open."""

    def __init__(self, name: str, limit: Path, usage: Path, stat: Path, key: str) -> None:
        self.name = name
        self.key = key.encode() + b" "
        self.fds: list[int] = []
        try:
            for path in (limit, usage, stat):
                self.fds.append(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
        except OSError:
            self.close()
            raise

    def read(self) -> MemorySample | None:
        limit_fd, usage_fd, stat_fd = self.fds
        limit = _limit(os.pread(limit_fd, 64, 0))
        if limit is None:
            return None
        used = int(os.pread(usage_fd, 64, 0))
        stat = os.pread(stat_fd, 8192, 0)
        at = stat.find(self.key)
        if at == 0 or (at > 0 and stat[at - 1 : at] == b"\n"):
            end = stat.find(b"\n", at)
            used -= int(stat[at + len(self.key) : end if end >= 0 else None])
        return MemorySample(max(0, used), limit, self.name)

    def close(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []


class MemoryProbe:
    """The memory ceilings of this process (module docstring); :meth:`read` the tightest."""

    def __init__(self) -> None:
        self._cgroups: list[_Cgroup] = []
        try:
            found = cgroup_ceilings(
                Path("/proc/self/cgroup").read_text(), Path("/proc/self/mountinfo").read_text()
            )
        except OSError:
            found = []
        for name, limit, usage, stat, key in found:
            try:
                self._cgroups.append(_Cgroup(name, limit, usage, stat, key))
            except OSError as err:
                logger.debug("memory ceiling %s unreadable: %s", name, err)
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        self._rlimit_as = soft if soft != resource.RLIM_INFINITY and soft > 0 else None
        self._statm: int | None = None
        if self._rlimit_as is not None:
            try:
                self._statm = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self._rlimit_as = None
        self._page = os.sysconf("SC_PAGE_SIZE")

    @property
    def ceilings(self) -> list[str]:
        """What is watched (cgroups whether limited now or not), for logs and tests."""
        out = [c.name for c in self._cgroups]
        if self._rlimit_as is not None:
            out.append(f"RLIMIT_AS ({self._rlimit_as} bytes)")
        return out

    def read(self) -> MemorySample | None:
        """The ceiling closest to being reached, or None when none is known."""
        samples: list[MemorySample] = []
        for cg in self._cgroups:
            try:
                sample = cg.read()
            except (OSError, ValueError):
                continue
            if sample is not None:
                samples.append(sample)
        if self._rlimit_as is not None and self._statm is not None:
            try:
                vm = int(os.pread(self._statm, 128, 0).split()[0]) * self._page
                samples.append(MemorySample(vm, self._rlimit_as, "RLIMIT_AS"))
            except (OSError, ValueError, IndexError):
                pass
        samples.extend(_cuda_samples())
        return max(samples, key=lambda s: s.fraction) if samples else None

    def close(self) -> None:
        for cg in self._cgroups:
            cg.close()
        self._cgroups.clear()
        if self._statm is not None:
            os.close(self._statm)
            self._statm = None


def _cuda_samples() -> list[MemorySample]:
    """Every initialised CUDA device: in use on the whole device, less PyTorch's free cache."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return []
    out = []
    try:
        dev = torch.cuda.current_device()
        free, total = torch.cuda.mem_get_info(dev)
        stats = torch.cuda.memory_stats(dev)
        cached = stats.get("reserved_bytes.all.current", 0) - stats.get("allocated_bytes.all.current", 0)
        out.append(MemorySample(max(0, total - free - cached), total, f"cuda:{dev}"))
    except RuntimeError:
        pass
    return out
