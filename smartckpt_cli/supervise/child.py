"""The training child as ``smartckpt run`` sees it: its command, its environment, and the files
it leaves in the run directory (see ``hooks/_smartckpt_protocol.py`` for the contract).

Pure helpers and small readers, no policy: the supervisor decides what the files mean.
"""

from __future__ import annotations

import contextlib
import glob
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from smartckpt_cli.config import ENV_PREFIX, Settings
from smartckpt_cli.hooks import _smartckpt_protocol as proto
from smartckpt_cli.supervise.policy import root_failure, silent_rank

__all__ = ["RunDir", "alive", "child_env", "hooks_dir", "interpreter_flags_warning", "python_command"]


def hooks_dir() -> Path:
    """The directory holding the hooks' ``sitecustomize.py`` (first on the child's PYTHONPATH)."""
    return Path(proto.__file__).resolve().parent


def python_command(args: list[str]) -> list[str]:
    """``train.py ...`` -> ``<this python> train.py ...``; anything else unchanged."""
    if args and args[0].endswith(".py"):
        return [sys.executable, *args]
    return list(args)


def interpreter_flags_warning(command: list[str]) -> str | None:
    """``python -I/-E/-S`` ignores PYTHONPATH or site, so the hooks cannot load: say how to fix."""
    if not command or not Path(command[0]).name.startswith("python"):
        return None
    for arg in command[1:]:
        if not arg.startswith("-") or arg.startswith("--") or arg in ("-m", "-c"):
            break
        if arg[1:2] in ("X", "W"):  # -X opt, -W arg: their letters are not flags
            continue
        bad = [f"-{c}" for c in arg[1:] if c in "IES"]
        if bad:
            flags = " ".join(bad)
            return (
                f"{command[0]} {flags} ignores PYTHONPATH or site-packages, so smartckpt's hooks are not "
                "live in the child (no zero-code checkpoints, no heartbeat, no hang detection, no error "
                f"file); drop {flags}, or create a CheckpointManager in the script"
            )
    return None


def child_env(
    base: dict[str, str],
    settings: Settings,
    sources: dict[str, str],
    *,
    store_dir: Path,
    run_dir: Path,
    run_id: str,
    attempt: int,
    mtbf: float | None,
) -> dict[str, str]:
    """The child's environment: the caller's, the settings that did not come from it (so the
    child's own ``load_settings`` sees what ``run`` saw), the learned MTBF and the handshake."""
    env = {k: v for k, v in base.items() if k != proto.ENV_LOADED}
    for key, source in sources.items():
        if source.startswith("env "):
            continue  # already in the environment
        value = getattr(settings, key)
        if key == "tiers":
            rules = [{k: v for k, v in vars(r).items() if v is not None} for r in value]
            env[ENV_PREFIX + "TIERS"] = yaml.safe_dump(rules)
        elif value is not None:
            env[ENV_PREFIX + key.upper()] = str(value).lower() if isinstance(value, bool) else str(value)
    env[ENV_PREFIX + "DIR"] = str(store_dir)
    if mtbf is not None and "mtbf" not in sources:
        env[ENV_PREFIX + "MTBF"] = f"{mtbf:.1f}"
    env[proto.ENV_RUN_DIR] = str(run_dir) + os.sep
    env[proto.ENV_RUN_ID] = run_id
    env[proto.ENV_ATTEMPT] = str(attempt)
    hdir = str(hooks_dir())
    env[proto.ENV_HOOKS_DIR] = hdir
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != hdir]
    env["PYTHONPATH"] = os.pathsep.join([hdir, *rest])
    return env


def alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie (dead, not yet reaped: a rank whose launcher died before
    waiting for it) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] != b"Z"
    except OSError:
        return True  # no /proc: what kill(0) said


class RunDir:
    """One attempt's view of the run directory: files that were there before ``mark()`` belong
    to earlier attempts and are ignored (unless rewritten since, for a reused pid)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._before: set[str] = set()
        self._since = 0.0

    def mark(self, since: float) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        self._before, self._since = set(os.listdir(self.path)), since

    def _files(self, pattern: str) -> list[tuple[str, int]]:
        out = []
        for path in glob.glob(os.path.join(self.path, pattern)):
            name = os.path.basename(path)
            with contextlib.suppress(ValueError, OSError):
                pid = int(name.split(".")[1])
                if pid <= 0 or not name.split(".")[1].isdigit():
                    continue  # not a pid a process wrote (-1 would address every process)
                if name not in self._before or os.path.getmtime(path) >= self._since:
                    out.append((path, pid))
        return out

    def beats(self) -> list[proto.Beat]:
        """The heartbeats of this attempt's live processes (a dead rank's last beat would look
        like a hang), DONE ones included: the caller tells finished from training."""
        out = []
        for path, pid in self._files("heartbeat.*"):
            beat = proto.read_heartbeat(path, pid)
            if beat is not None and alive(pid):
                out.append(beat)
        return out

    def reports(self) -> list[dict[str, Any]]:
        """What this attempt's processes said they did (``report.<pid>.json``)."""
        found = [proto.read_json(path) for path, _ in self._files("report.*.json")]
        return [r for r in found if r is not None]

    def max_step(self) -> int | None:
        """The highest step any of this attempt's processes reported, dead or alive."""
        steps = [b.step for p, pid in self._files("heartbeat.*") if (b := proto.read_heartbeat(p, pid))]
        return max(steps) if steps else None

    def hooks_pids(self) -> list[int]:
        return [pid for _, pid in self._files("hooks.*.json")]

    def error(self) -> dict[str, Any] | None:
        """The root cause of this attempt's end: the rank that died first, as torchrun's agent
        reported its ranks' ends (policy.root_failure), else the first error file written (not
        a rank that failed because another one did)."""
        found = []
        for path, _ in self._files("error.*.json"):
            data = proto.read_json(path)
            if data is not None:
                found.append((os.path.getmtime(path), path, data))
        if not found:
            return None
        by_pid = {_pid_of(path): data for _, path, data in found}
        for _, _, data in found:
            if isinstance(data.get("failures"), list):
                root = root_failure(data["failures"], by_pid)
                if root is not None:
                    return root
        # No torchrun report (Lightning starts its own ranks): a rank whose heartbeat stopped
        # without an error file or DONE died silently, and its peers' errors are its doing.
        silent = silent_rank(self.dead_ranks(), by_pid)
        return silent if silent is not None else min(found, key=lambda f: f[0])[2]

    def dead_ranks(self) -> list[tuple[int, int, float]]:
        """(rank, pid, its last beat) of every rank of this attempt whose process is gone without
        having said DONE."""
        ranks = {r.get("pid"): r.get("rank") for r in self.reports()}  # a manager knows its rank
        out = []
        for path, pid in self._files("heartbeat.*"):
            beat = proto.read_heartbeat(path, pid)
            if beat is None or beat.state == proto.DONE or alive(pid):
                continue
            rank = beat.rank if beat.rank >= 0 else ranks.get(pid)
            if isinstance(rank, int) and rank >= 0:
                out.append((rank, pid, beat.time))
        return out

    def stacks(self, pid: int) -> str:
        return proto.stacks_path(str(self.path), pid)


def _pid_of(path: Any) -> int | None:
    """The pid in ``error.<pid>.json``."""
    try:
        return int(os.path.basename(str(path)).split(".")[1])
    except (IndexError, ValueError):
        return None
