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
                         learns more): the facts of :data:`REPORT_FACTS`, every one optional.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import time
from dataclasses import dataclass
from typing import Any

# Every fact a training process may put in its report.<pid>.json, with what it means: the one
# list of the child-to-supervisor report (the child's engine/report.py writes no other name).
REPORT_FACTS: dict[str, str] = {
    "pid": "the reporting process",
    "rank": "its rank (-1: no torch.distributed rank)",
    "start_step": "the step the script really began at",
    "restored_from": "where that step came from: ram, disk, remote, or null (nothing restored)",
    "checkpoint": "the id of the checkpoint restored",
    "lineage": "the lineage it continues (engine/restore.py's same_lineage)",
    "start_step_called": "whether the script called start_step()",
    "start_step_early": "it did, before any optimizer existed",
    "resume_check": "the resume check's verdict: {step, verdict, expected, got}",
    "no_optimizer": "backward passes, but no torch.optim optimizer ever stepped",
    "save_failures": "background saves failing: {count, last, step}",
    "io_error": "a write on the loop's path failing: {what, error}; null once it works again",
    "checkpointing_off": "zero-code checkpointing turned itself off: {why, step}",
    "commit_interrupted": "a save cut off before its commit: {step, error}",
    "torch_ready": "wall time: torch imported and the hooks in (a start's first phase)",
    "restore_began": "wall time: the restore began",
    "restore_done": "wall time: the restore ended",
    "first_step_done": "wall time: the first step after the start ended",
    "first_step": "that step's number",
}

# The facts an attempt's run record keeps as the child last said them, each in the field of the
# same name of supervise/records.py's AttemptRecord, with the type a value must have to be taken
# (anything else is ignored: the report is read back, never trusted). A new fact the run record
# keeps is one entry here plus its field there.
KEPT_FACTS: dict[str, type] = {
    "resume_check": dict,
    "no_optimizer": bool,
    "checkpointing_off": dict,
    "save_failures": dict,
    "io_error": dict,
}

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
