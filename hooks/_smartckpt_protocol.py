"""The contract between ``smartckpt run`` (the supervisor) and the hooks in the training process.

Standard library only: the child's ``sitecustomize`` imports this at interpreter start-up, long
before torch (or smartckpt itself) may be imported. The supervisor imports it as
``smartckpt_cli.hooks._smartckpt_protocol``.

Everything goes through files in one *run directory* (``<store>/runs/<run-id>/``), named by the
writer's pid, so that several processes (torchrun workers, DataLoader workers) never share a file:

``hooks.<pid>.json``     written by ``sitecustomize`` when it loads: proof the hooks are live.
``heartbeat.<pid>``      a fixed 64-byte record (:data:`HEARTBEAT`), rewritten in place at every
                         optimizer step through a shared memory mapping of the file: no system
                         call, no fsync (a ``pwrite`` per step, ~2 µs alone, cost several times
                         that inside a training loop); ``pwrite`` where mapping fails. Readers
                         see it through the page cache.
``error.<pid>.json``     the uncaught exception that ended the process (type, message, traceback),
                         so the supervisor can tell a SyntaxError from an NCCL timeout.
``stacks.<pid>.txt``     Python stacks of every thread, dumped by ``faulthandler`` when the
                         supervisor sends :data:`STACK_SIGNAL` to a hung process.
``report.<pid>.json``    what the training process itself says it did (rewritten whole as it
                         learns more): the facts of :data:`FACTS`, every one optional, each
                         declared with what the supervisor does with it.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import time
from dataclasses import dataclass
from typing import Any

# What the supervisor does with a fact (Fact.use); "" : nothing, it is there for whoever reads the
# file. Each use is read in one place, supervise/childreport.py, through these declarations.
START = "start"  # where the attempt began: kept in the AttemptRecord field of its name, the START
#                  facts taken together once the first one is said (and again when the child
#                  corrects itself); the start line says them
KEPT = "kept"  # kept as last said (a value of its kind, not empty) in the AttemptRecord field of
#                its name; new (a trouble line may say it) the first time in an attempt
CAUSE = "cause"  # its value ``when`` says the script does not resume through start_step(): why an
#                  attempt began at step 0 although a checkpoint existed, and that the next will too
PHASE = "phase"  # a wall time that ends restart phases (AttemptRecord.phases)


@dataclass(frozen=True)
class Fact:
    """One fact of the report: what it means, what the supervisor does with it (``use``, above)
    and the type a value must have to be taken (``kind``; the report is read back, never
    trusted: a value of another type is as if unsaid, and a bool is no number)."""

    meaning: str
    use: str = ""
    kind: type | tuple[type, ...] = object
    # PHASE: the phases this wall time ends, each with the fact it is measured from ("": the
    # attempt's start, as the supervisor timed it; a mark before it, a warm spare's, counts 0).
    # ``needed``: no phase is said before it is; an optional mark said after the next one is out
    # of order and ends nothing. ``stepped``: it says the first step is done.
    phases: tuple[tuple[str, str], ...] = ()
    needed: bool = False
    stepped: bool = False
    # CAUSE: the value that says it, why the attempt began at step 0 ({script}: the script's
    # name) and the fix; the first CAUSE fact said, in this order, is the one given.
    when: object = None
    why: str = ""
    fix: str = ""


_TIME = (int, float)
_FIX_CALL = (
    "add one line after the model and optimizer are built, `start = smartckpt_cli.start_step()`, "
    'and count the loop from `start` (README, section "Your loop")'
)
_FIX_EARLY = (
    "call smartckpt_cli.start_step() after building the model, optimizer and schedulers "
    '(README, section "Your loop")'
)

# Every fact a training process may put in its report.<pid>.json: the one list of the
# child-to-supervisor report (the child's engine/report.py writes no other name). A new fact the
# run record keeps is one entry here (use KEPT or START, and its kind) plus the field of the same
# name in supervise/records.py's AttemptRecord.
FACTS: dict[str, Fact] = {
    "pid": Fact("the reporting process"),
    "rank": Fact("its rank (-1: no torch.distributed rank)"),
    "start_step": Fact("the step the script really began at", START, int),
    "restored_from": Fact(
        "where that step came from: ram, disk, remote, or null (nothing restored)", START, (str, type(None))
    ),
    "checkpoint": Fact("the id of the checkpoint restored"),
    "lineage": Fact("the lineage it continues (engine/restore.py's same_lineage)"),
    "start_step_early": Fact(
        "the script called start_step() before any optimizer existed",
        CAUSE,
        bool,
        when=True,
        why="{script} calls smartckpt_cli.start_step() before its optimizer exists",
        fix=_FIX_EARLY,
    ),
    "start_step_called": Fact(
        "whether the script called start_step()",
        CAUSE,
        bool,
        when=False,
        why="{script} does not call smartckpt_cli.start_step()",
        fix=_FIX_CALL,
    ),
    "resume_check": Fact("the resume check's verdict: {step, verdict, expected, got}", KEPT, dict),
    "no_optimizer": Fact("backward passes, but no torch.optim optimizer ever stepped", KEPT, bool),
    "checkpointing_off": Fact("zero-code checkpointing turned itself off: {why, step}", KEPT, dict),
    "save_failures": Fact("background saves failing: {count, last, step}", KEPT, dict),
    "io_error": Fact(
        "a write on the loop's path failing: {what, error}; null once it works again", KEPT, dict
    ),
    "commit_interrupted": Fact("a save cut off before its commit: {step, error}"),
    "torch_ready": Fact(
        "wall time: torch imported and the hooks in (a start's first phase)", PHASE, _TIME, (("imports", ""),)
    ),
    "restore_began": Fact("wall time: the restore began", PHASE, _TIME, (("to_restore", ""),), needed=True),
    "restore_done": Fact(
        "wall time: the restore ended", PHASE, _TIME, (("restore", "restore_began"),), needed=True
    ),
    "first_step_done": Fact(
        "wall time: the first step after the start ended",
        PHASE,
        _TIME,
        (("to_first_step", "restore_done"), ("start_to_first_step", "")),
        stepped=True,
    ),
    "first_step": Fact("that step's number"),
}

# Derived, for who needs only the names: every fact and its meaning; the facts each attempt's
# run record keeps as last said, with their kind.
REPORT_FACTS: dict[str, str] = {name: fact.meaning for name, fact in FACTS.items()}
KEPT_FACTS: dict[str, type | tuple[type, ...]] = {n: f.kind for n, f in FACTS.items() if f.use == KEPT}


def of_use(use: str) -> list[str]:
    """The names of the facts of ``use``, in their order here."""
    return [name for name, fact in FACTS.items() if fact.use == use]


def taken(report: dict[str, Any], use: str) -> dict[str, Any]:
    """The facts of ``use`` that ``report`` says with a value of their kind, in their order here."""
    out = {}
    for name in of_use(use):
        if name in report and _of_kind(report[name], FACTS[name].kind):
            out[name] = report[name]
    return out


def _of_kind(value: Any, kind: type | tuple[type, ...]) -> bool:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return isinstance(value, kinds) and (bool in kinds or not isinstance(value, bool))


# Set by the supervisor in the child's environment.
ENV_RUN_DIR = "SMARTCKPT_RUN_DIR"  # the run directory above; its presence arms the hooks
ENV_RUN_ID = "SMARTCKPT_RUN_ID"
ENV_ATTEMPT = "SMARTCKPT_ATTEMPT"  # 0 for the first start, then 1, 2, ... after each restart
ENV_HOOKS_DIR = "SMARTCKPT_HOOKS_DIR"  # the directory holding our sitecustomize (to chain past it)
# Reserved, not set: the hooks' once-per-process guard is a flag on the child's ``sys`` module
# (``sys._smartckpt_hooks``), since an inherited variable would stop torchrun workers and other
# children from running the hooks.
ENV_LOADED = "SMARTCKPT_HOOKS_LOADED"

STACK_SIGNAL_NAME = "SIGQUIT"  # registered with faulthandler by the hooks; only sent when live

# Heartbeat states.
STARTING, TRAINING, SAVING, RESTORING, DONE, WAITING = 0, 1, 2, 3, 4, 5
STATE_NAMES = {
    STARTING: "starting",
    TRAINING: "training",
    SAVING: "saving",
    RESTORING: "restoring",
    DONE: "done",
    WAITING: "waiting for the remote",  # nothing local to resume, the remote unreachable (yet)
}

# Trouble flags, carried by every beat (a bit set while the trouble lasts): the heartbeat is a
# mapping written in place, so it reaches the supervisor even when the disk is full and no file
# can be written. The details (why, how often) follow in ``report.<pid>.json`` when it can be.
SAVE_FAILING = 1  # the newest background save failed (cleared by the next commit)
IO_FAILING = 2  # a write on the loop's path (the trigger trace) fails (cleared when one works)
CHECKPOINTING_OFF = 4  # zero-code checkpointing turned itself off: training goes on unsaved
TROUBLE_NAMES = {
    SAVE_FAILING: "saves failing",
    IO_FAILING: "writes failing",
    CHECKPOINTING_OFF: "checkpointing OFF",
}

# wall time (time.time), monotonic-free on purpose: the supervisor compares it with its own
# time.time(); step; loss (nan when unknown); state; last committed step (-1: none); rank (-1:
# not distributed); a sequence number bumped at every write, so a torn read (a write racing the
# read) is detected by reading twice; the trouble flags above; the steps the training will take
# in all (-1: not known), for the live view's ETA.
HEARTBEAT = struct.Struct("<dqdiqiqiq")
HEARTBEAT_SIZE = 64
assert HEARTBEAT.size <= HEARTBEAT_SIZE


@dataclass(frozen=True)
class Beat:
    pid: int
    time: float
    step: int
    loss: float
    state: int
    committed_step: int
    rank: int
    seq: int
    trouble: int = 0
    total: int = -1

    @property
    def state_name(self) -> str:
        return STATE_NAMES.get(self.state, "unknown")


def hooks_path(run_dir: str, pid: int) -> str:
    return os.path.join(run_dir, f"hooks.{pid}.json")


def heartbeat_path(run_dir: str, pid: int) -> str:
    return os.path.join(run_dir, f"heartbeat.{pid}")


def error_path(run_dir: str, pid: int) -> str:
    return os.path.join(run_dir, f"error.{pid}.json")


def stacks_path(run_dir: str, pid: int) -> str:
    return os.path.join(run_dir, f"stacks.{pid}.txt")


def report_path(run_dir: str, pid: int) -> str:
    return os.path.join(run_dir, f"report.{pid}.json")


def write_json(path: str, payload: dict[str, Any]) -> None:
    """Small file, written whole: tmp + rename, so a reader never sees half of it."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(payload, f)
    os.replace(tmp, path)


def read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class HeartbeatWriter:
    """Owned by the training process; ``beat`` rewrites the 64-byte record in place."""

    def __init__(self, run_dir: str, rank: int = -1) -> None:
        self.path = heartbeat_path(run_dir, os.getpid())
        self.rank = rank
        self.seq = 0
        self.step = 0
        self.loss = float("nan")
        self.state = STARTING
        self.committed = -1
        self.trouble = 0
        self.total = -1
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        self._map: mmap.mmap | None = None
        try:
            os.pwrite(self._fd, b"\0" * HEARTBEAT_SIZE, 0)
            self._map = mmap.mmap(self._fd, HEARTBEAT_SIZE)
        except (OSError, ValueError):
            self._map = None  # written with pwrite instead
        self.beat()

    def beat(
        self,
        step: int | None = None,
        loss: float | None = None,
        state: int | None = None,
        committed_step: int | None = None,
        trouble: tuple[int, bool] | None = None,
        total: int | None = None,
    ) -> None:
        """``trouble``: (flag, on) sets or clears one trouble flag; ``total``: the steps the
        training takes in all."""
        if step is not None:
            self.step = step
        if loss is not None:
            self.loss = loss
        if state is not None:
            self.state = state
        if committed_step is not None:
            self.committed = committed_step
        if total is not None:
            self.total = total
        if trouble is not None:
            flag, on = trouble
            self.trouble = self.trouble | flag if on else self.trouble & ~flag
        self.seq += 1
        fields = (
            time.time(),
            self.step,
            self.loss,
            self.state,
            self.committed,
            self.rank,
            self.seq,
            self.trouble,
            self.total,
        )
        if self._map is not None:
            HEARTBEAT.pack_into(self._map, 0, *fields)
            return
        try:
            os.pwrite(self._fd, HEARTBEAT.pack(*fields).ljust(HEARTBEAT_SIZE, b"\0"), 0)
        except OSError:
            pass  # a full or vanished run directory must never stop training

    def close(self) -> None:
        try:
            if self._map is not None:
                self._map.close()
                self._map = None
            os.close(self._fd)
        except (OSError, ValueError):
            pass


def read_heartbeat(path: str, pid: int) -> Beat | None:
    """The latest beat, or None when the file is missing or being rewritten."""
    for _ in range(3):
        try:
            with open(path, "rb") as f:
                a = f.read(HEARTBEAT_SIZE)
                f.seek(0)
                b = f.read(HEARTBEAT_SIZE)
        except OSError:
            return None
        if len(a) >= HEARTBEAT.size and a == b:
            t, step, loss, state, committed, rank, seq, trouble, total = HEARTBEAT.unpack_from(a)
            return Beat(pid, t, step, loss, state, committed, rank, seq, trouble, total)
    return None
