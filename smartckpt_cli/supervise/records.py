"""Run records of ``smartckpt run``: ``<dir>/runs/<run-id>.json``, and what is learned from them.

One record per run: the command, the settings it ran with (no credentials), every attempt (start and end time, steps reached, how it
ended, the checkpoint the next attempt restarts from, steps and seconds lost), checkpoints
taken, rollbacks and the outcome. The record is rewritten whole (tmp + rename) after every
attempt, so a supervisor killed mid-run still leaves the attempts so far.

The mean time between failures learned from all records of a store is handed to the child as
``SMARTCKPT_MTBF`` and feeds the trigger's Young/Daly interval.

Also here: the store-level facts the supervisor reads between attempts (newest live checkpoint,
checkpoints committed since a journal position) and the rollback it appends after a crash loop.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from smartckpt_cli.errors import JournalError, StoreDamagedError
from smartckpt_cli.store.directory import WRITER_LOCK
from smartckpt_cli.store.journal import Journal
from smartckpt_cli.store.storage import LocalStorage
from smartckpt_cli.store.unjournalled import repair_command, say_once, survey
from smartckpt_cli.supervise.policy import estimate_mtbf

__all__ = [
    "RUNS_DIR",
    "AttemptRecord",
    "RunRecord",
    "StoreView",
    "learned_mtbf",
    "new_run_id",
    "read_records",
    "runs_without_checkpoints",
]

logger = logging.getLogger(__name__)

RUNS_DIR = "runs"
RECORD_VERSION = 1


def candidates(records: list[Any]) -> list[Any]:
    """Live healthy checkpoints, newest (latest in the journal) first: what a restore tries.
    The same rule as ``restore.candidates``, without importing torch into the supervisor."""
    return sorted((r for r in records if r.live and r.health == "ok"), key=lambda r: r.position, reverse=True)


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


@dataclass
class AttemptRecord:
    attempt: int
    pid: int
    started: float  # wall time (time.time)
    newest_checkpoint: int = 0  # the newest live checkpoint when it started (what a restore loads)
    # What the child itself reported (report.<pid>.json): the step the script really began at
    # (None: it never said, e.g. it died first or runs without smartckpt), where it was restored
    # from ("ram", "disk", "remote"; None: nothing restored), and the resume check's verdict
    # ({"step", "verdict": "exact" | "close" | "differs", "expected", "got"}).
    start_step: int | None = None
    restored_from: str | None = None
    resume_check: dict[str, Any] | None = None
    began_again: str = ""  # why it began at step 0 although a checkpoint existed
    no_optimizer: bool = False  # backward passes, but no torch.optim optimizer ever stepped
    # What went wrong while it trained, as the child reported it: zero-code checkpointing that
    # turned itself off ({"why", "step"}), failed background saves ({"count", "last", "step"}),
    # the newest write on the loop's path that failed ({"what", "error"}).
    checkpointing_off: dict[str, Any] | None = None
    save_failures: dict[str, Any] | None = None
    io_error: dict[str, Any] | None = None
    ended: float = 0.0
    max_step: int | None = None  # highest step a heartbeat reported (None: no heartbeat)
    max_committed: int | None = None  # newest step committed during the attempt
    returncode: int | None = None
    exit_code: int | None = None
    category: str = ""
    cause: str = ""
    error: dict[str, Any] | None = None
    stacks: str | None = None  # the stack dump taken before a hang kill
    # the step the next attempt began at (restored, or 0); for the last attempt, where a rerun resumes
    restart_from: int | None = None
    steps_lost: int | None = None
    seconds_lost: float | None = None
    delay: float = 0.0  # backoff before the next attempt
    rollback_to: int | None = None
    # The RAM tier (supervise/ramowner.py): the step of the RAM snapshot the supervisor wrote to
    # the store after this attempt died (flash persist); this attempt's restart phases, from its
    # report and the previous attempt's death (seconds, ``childreport.restart_phases``).
    flash_persisted: int | None = None
    phases: dict[str, float] | None = None
    # A warm restart (supervise/warm.py): this attempt ran in the spare interpreter prepared
    # while the previous one trained; when the process died (``ended``: when that was noticed).
    warm: bool = False
    died: float | None = None

    @property
    def began(self) -> int:
        """The step it began at: reported, else the checkpoint a restore would have loaded."""
        return self.start_step if self.start_step is not None else self.newest_checkpoint


@dataclass
class RunRecord:
    run_id: str
    command: list[str]
    directory: str
    started: float
    attempts: list[AttemptRecord] = field(default_factory=list)
    ended: float | None = None
    outcome: str = "running"
    exit_code: int | None = None
    diagnosis: str = ""
    checkpoints_taken: int = 0
    mtbf: float | None = None  # what was handed to the child
    settings: dict[str, Any] = field(default_factory=dict)  # config.public_settings at the start
    version: int = RECORD_VERSION

    @property
    def restarts(self) -> int:
        return max(0, len(self.attempts) - 1)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["restarts"] = self.restarts
        out["wall_seconds"] = (self.ended or time.time()) - self.started
        out["steps_lost"] = sum(a.steps_lost or 0 for a in self.attempts)
        out["seconds_lost"] = sum(a.seconds_lost or 0.0 for a in self.attempts)
        return out

    def path(self) -> Path:
        return Path(self.directory) / RUNS_DIR / f"{self.run_id}.json"

    def save(self) -> None:
        path = self.path()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.to_json(), indent=2))
        os.replace(tmp, path)


def read_records(directory: str | os.PathLike[str]) -> list[dict[str, Any]]:
    runs = Path(directory) / RUNS_DIR
    out = []
    for p in sorted(runs.glob("*.json")) if runs.is_dir() else []:
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError):
            logger.warning("run record %s is unreadable; ignored", p)
            continue
        if not isinstance(data, dict):
            logger.warning("run record %s is not a run record; ignored", p)
            continue
        attempts = data.get("attempts", [])
        if not isinstance(attempts, list) or not all(isinstance(a, dict) for a in attempts):
            logger.warning("run record %s: attempts is not a list of attempts; ignored", p)
            continue
        out.append(data)
    return out


def runs_without_checkpoints(directory: str | os.PathLike[str]) -> str | None:
    """The line for a directory that holds run records but no checkpoint store (no journal):
    what ran there and why nothing was checkpointed, when the records say; None when there
    are no run records either."""
    try:
        records = read_records(directory)
    except OSError:  # an unreadable directory: the caller's own error says so
        return None
    if not records:
        return None
    last = max(records, key=lambda r: r.get("started") or 0)
    attempts = [a for r in records for a in r.get("attempts") or [] if isinstance(a, dict)]
    line = (
        f"{directory} holds the records of {len(records)} run(s) of `smartckpt run` (runs/) but no "
        "checkpoint: none was ever committed there"
    )
    if any(a.get("no_optimizer") for a in attempts):
        line += (
            "; the training never stepped a torch.optim optimizer, and zero-code checkpointing needs "
            "one (for a hand-written update, use a CheckpointManager in the script)"
        )
    return line + f"; last run {last.get('run_id')}: {last.get('outcome')}"


def learned_mtbf(directory: str | os.PathLike[str], current: RunRecord | None = None) -> float | None:
    """MTBF from every run record of the store (the running one included)."""
    records = [r for r in read_records(directory) if current is None or r.get("run_id") != current.run_id]
    if current is not None:
        records.append(current.to_json())
    return estimate_mtbf(records)


class StoreView:
    """Read-only looks at the checkpoint store between attempts; the one write is ``rollback``."""

    def __init__(self, directory: str | os.PathLike[str], meta_dir: str | os.PathLike[str] | None) -> None:
        self.root = Path(directory)
        self.meta_root = Path(meta_dir) if meta_dir else self.root
        self.meta = LocalStorage(self.meta_root)
        self.journal = Journal(self.meta, self.meta_root)

    def refuse_damaged(self) -> None:
        """Before the first attempt: a journal that cannot be read, or a missing or empty one
        beside manifests no journal line names, stops the run here (StoreDamagedError, one
        line): the child would refuse the store, or train with nothing checkpointed."""
        if not self.root.is_dir():
            return  # a new store: nothing to lose
        found = survey(LocalStorage(self.root), self.journal)
        blocking = found.blocking
        if blocking is not None:
            raise StoreDamagedError(blocking.line(str(self.root), repair_command(self.root, self.meta_root)))

    def _records(self) -> list[Any]:
        try:
            return self.journal.read().records
        except JournalError as err:
            say_once(f"cannot read the journal: {err}")  # polled every second: said once
            return []

    def newest_step(self) -> int:
        """Step of the newest live, healthy checkpoint (what a restart restores); 0 if none."""
        live = candidates(self._records())
        return live[0].step if live else 0

    def newest(self) -> Any:
        """The newest live, healthy checkpoint's journal record; None if none."""
        live = candidates(self._records())
        return live[0] if live else None

    def live_steps(self) -> list[int]:
        """Steps of the live healthy checkpoints, newest first."""
        return [r.step for r in candidates(self._records())]

    def position(self) -> int:
        recs = self._records()
        return max((r.position for r in recs), default=-1)

    def commits_since(self, position: int) -> list[int]:
        """Steps committed after journal position ``position``."""
        return [r.step for r in self._records() if r.position > position]

    def rollback(self, to_step: int, why: str, timeout: float = 30.0) -> None:
        """Append a journal ``rollback`` event: every checkpoint newer than ``to_step`` stops being
        a restore candidate (``smartckpt inspect`` shows them as rolled back; nothing is deleted).
        Taken under the store's writer lock, which the dead child no longer holds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                with self.meta.lock(WRITER_LOCK, blocking=False):
                    self.journal.append(
                        {"event": "rollback", "to_step": int(to_step), "why": why, "by": "smartckpt run"}
                    )
                    return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
