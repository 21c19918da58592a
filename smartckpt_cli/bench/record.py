"""The result file every benchmark writes (``smartckpt bench --json`` and each ``benchmarks/*.py``):
the exact command, the commit and the machine it ran on, and every figure with its unit.

The documents' benchmark tables are generated from these files (``benchmarks/render_docs.py``),
so that every figure they show can be traced to the command that measured it. The format is
written down in ``docs/benchmarks.md`` ("Result files"); this module writes it, the renderer
reads and checks it. No torch here: the caller passes the device and the torch version.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["FORMAT", "UNITS", "VERSION", "Record", "git_state", "machine", "script_command"]

FORMAT = "smartckpt-bench-result"
VERSION = 1

# What a figure's value is in. Ratios are "x" (0.98 = 0.98 times the anchor); "%" values are
# percentages (0.9 means 0.9 %), never fractions; "num" is any other plain number (a loss, a
# relative error).
UNITS = frozenset(
    {"s", "ms", "us", "x", "%", "B", "MB", "GB", "MB/s", "GB/s", "steps/s", "steps", "count", "num"}
)

# What a benchmark runs: a change here, not committed, makes its result "dirty". The results, the
# documents, the tests and the tools that only render or summarise results do not count.
_MEASURING = (
    "smartckpt_cli",
    "hooks",
    "benchmarks",
    "pyproject.toml",
    "constraints",
    ":(exclude)benchmarks/results",
    ":(exclude)benchmarks/render_docs.py",
    ":(exclude)benchmarks/sections.py",
    ":(exclude)benchmarks/gpu_check_summary.py",
)


def script_command(script: str | os.PathLike[str], argv: Sequence[str] | None = None) -> str:
    """``python benchmarks/x.py ARGS`` as it was run: the script's path from the repository root
    (when it is inside one), the interpreter written as ``python``, the arguments quoted for a
    POSIX shell."""
    path = Path(script).resolve()
    root = _repo_root(path.parent)
    if root is None and path.parent.name == "benchmarks":  # a copy without .git (the GPU check's)
        root = path.parent.parent
    shown = path.relative_to(root).as_posix() if root is not None else str(path)
    args = list(sys.argv[1:] if argv is None else argv)
    return shlex.join(["python", shown, *args])


def _repo_root(start: Path) -> Path | None:
    for d in (start, *start.parents):
        if (d / ".git").exists():
            return d
    return None


def git_state(start: str | os.PathLike[str]) -> tuple[str | None, bool | None]:
    """(HEAD commit, whether tracked code differs from it) of the checkout holding ``start``.
    Outside a checkout (an installed copy, as the GPU check runs), ``BENCH_GIT_COMMIT`` and
    ``BENCH_GIT_DIRTY`` (``0``/``1``) say it, when set; else (None, None)."""
    root = _repo_root(Path(start).resolve())
    if root is None:
        commit = os.environ.get("BENCH_GIT_COMMIT") or None
        dirty = os.environ.get("BENCH_GIT_DIRTY")
        return commit, None if dirty is None or commit is None else dirty == "1"
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=False
        )
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", *_MEASURING],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None, None
    if head.returncode != 0:
        return None, None
    return head.stdout.strip(), bool(status.stdout.strip()) if status.returncode == 0 else None


def machine() -> dict[str, Any]:
    """Cores, memory, CPU model and system of this machine."""
    memory = None
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpus": usable,
        "memory_bytes": memory,
        "cpu_model": model,
        "system": f"{platform.system()} {platform.release()} {platform.machine()}",
    }


class Record:
    """One benchmark run's result file (module docstring). ``add`` a figure per measured number,
    put anything else (samples, per-pair values, settings) in ``details``, then ``write``.

    ``device``: ``{"type": "cpu" | "cuda", "name": ...}``; ``torch``: its version, None for a
    benchmark that does not use it. ``where``: a path inside the checkout whose commit is recorded.
    """

    def __init__(
        self,
        benchmark: str,
        command: str,
        *,
        device: dict[str, Any],
        torch: str | None,
        where: str | os.PathLike[str] = __file__,
    ) -> None:
        self.benchmark, self.command = benchmark, command
        self.device, self.torch = dict(device), torch
        self.commit, self.dirty = git_state(Path(where).parent if Path(where).is_file() else where)
        self.started = datetime.datetime.now(datetime.timezone.utc)
        self.figures: dict[str, dict[str, Any]] = {}
        self.details: dict[str, Any] = {}
        self.notes: list[str] = []

    def add(self, key: str, value: float, unit: str, what: str) -> float:
        """A figure: ``value`` in ``unit`` (one of :data:`UNITS`), and what it is, in words."""
        if unit not in UNITS:
            raise ValueError(f"figure {key!r}: unit {unit!r} is not one of {sorted(UNITS)}")
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(f"figure {key!r}: {value!r} is not a finite number")
        self.figures[key] = {"value": value, "unit": unit, "what": what}
        return value

    def to_json(self) -> dict[str, Any]:
        now = datetime.datetime.now(datetime.timezone.utc)
        return {
            "format": FORMAT,
            "version": VERSION,
            "benchmark": self.benchmark,
            "command": self.command,
            "commit": self.commit,
            "dirty": self.dirty,
            "date": self.started.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "seconds": round((now - self.started).total_seconds(), 1),
            "python": platform.python_version(),
            "torch": self.torch,
            "device": self.device,
            "machine": machine(),
            "figures": self.figures,
            "notes": self.notes,
            "details": self.details,
        }

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the file (whole or not at all: a temporary name, then a rename)."""
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1, default=_plain) + "\n")
        tmp.replace(out)
        return out


def _plain(obj: Any) -> Any:
    """JSON for what ``details`` may hold besides plain data (paths, numpy scalars, tuples)."""
    if isinstance(obj, Path):
        return str(obj)
    for cast in (float, str):
        try:
            return cast(obj)
        except (TypeError, ValueError):
            continue
    return repr(obj)
