"""What ``smartckpt run`` settles before its first attempt: whether there is anything to do (the
same command already finished on this store: :func:`already_finished`), and under SLURM which
attempt this job's run is (:func:`slurm_first_attempt`).

Separate from ``supervisor.py`` because neither needs a child, a poll or the run's state: they
read the store's journal and run records, or the SLURM environment, once, and answer.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from smartckpt_cli.errors import SmartckptError
from smartckpt_cli.supervise.records import StoreView, read_records
from smartckpt_cli.supervise.runstate import Emit

__all__ = ["already_finished", "slurm_first_attempt"]


def already_finished(store: StoreView, store_dir: Path, command: list[str]) -> str | None:
    """The same command again on a store whose last run finished with a final checkpoint:
    a loop that tests its end after a step (``while True`` with its own counter) would
    train one more step every time. What to say then (nothing to do); None otherwise."""
    newest = store.newest()
    if newest is None or newest.reason != "final":
        return None
    runs = sorted(read_records(store_dir), key=lambda r: r.get("started") or 0)
    last = runs[-1] if runs else None
    if last is None or last.get("outcome") != "finished" or last.get("command") != list(command):
        return None
    return (
        f"the training in {store_dir} already finished: run {last.get('run_id')} ended at step "
        f"{newest.step} with its final checkpoint; nothing to do (to train on from it, pass "
        "--resume-finished; to start over, use another --dir)"
    )


def slurm_first_attempt(requeue: bool, emit: Emit) -> int | None:
    """Under SLURM the first attempt number is SLURM_RESTART_COUNT (one record per job run);
    None outside a job (said when ``requeue`` is on: there is nothing to requeue)."""
    try:
        slurm = importlib.import_module("smartckpt_cli.supervise.slurm")
        job = slurm.job_from_env()
    except (SmartckptError, ImportError) as err:
        if requeue:
            emit("warning", f"requeue: {err}")
        return None
    if job is None:
        if requeue:
            emit("warning", "requeue is on but this is not a SLURM job: nothing will be requeued")
        return None
    emit("info", f"SLURM job {job.requeue_target}, run {job.restart_count} (SLURM_RESTART_COUNT)")
    return job.restart_count
