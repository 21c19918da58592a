"""What the training child says it did (``report.<pid>.json``; the contract is
``hooks/_smartckpt_protocol.py``'s), turned into the attempt's record and the lines ``smartckpt
run`` prints. The supervisor never guesses where a script began from the store: a script that
does not call ``start_step()`` begins again at step 0 whatever checkpoints exist, and only the
child knows whether it restored.

Pure: the supervisor reads the files (``RunDir.reports``) and prints what these return.
"""

from __future__ import annotations

import os
from typing import Any

from smartckpt_cli.hooks import _smartckpt_protocol as proto
from smartckpt_cli.supervise.records import AttemptRecord

__all__ = [
    "began_again",
    "lead_report",
    "learn",
    "predicted_start",
    "restart_phases",
    "script_name",
    "start_line",
    "trouble_lines",
    "trouble_summary",
]

FIX_CALL = (
    "add one line after the model and optimizer are built, `start = smartckpt_cli.start_step()`, "
    'and count the loop from `start` (README, section "Your loop")'
)
FIX_EARLY = 'call smartckpt_cli.start_step() after building the model, optimizer and schedulers (README, section "Your loop")'


def script_name(command: list[str]) -> str:
    """The training script as a user names it: ``train.py`` of ``python train.py ...``."""
    for arg in command[1:] if command and not command[0].endswith(".py") else command:
        if arg.endswith(".py"):
            return os.path.basename(arg)
    return "the script"


def lead_report(reports: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The report that speaks for the attempt: rank 0's (or the one process's)."""
    if not reports:
        return None
    return min(reports, key=lambda r: (max(int(r.get("rank", -1) or -1), 0), int(r.get("pid", 0) or 0)))


def began_again(report: dict[str, Any], script: str) -> tuple[str, str]:
    """(why a script began at step 0 although a checkpoint existed, the fix)."""
    if report.get("start_step_early"):
        return f"{script} calls smartckpt_cli.start_step() before its optimizer exists", FIX_EARLY
    if report.get("start_step_called") is False:
        return f"{script} does not call smartckpt_cli.start_step()", FIX_CALL
    return "nothing was restored", "see the child's output above for why"


def learn(
    att: AttemptRecord, report: dict[str, Any], script: str, prev: AttemptRecord | None = None
) -> list[str]:
    """Take what ``report`` says into ``att``; returns what is new: ``"start"`` (where it began
    is known now; ``"corrected"`` too when it said otherwise before) and each of the protocol's
    ``KEPT_FACTS`` said for the first time in this attempt."""
    new = []
    start = report.get("start_step")
    came_from = report.get("restored_from")
    # Taken when first said, and again when the child corrects itself (zero-code mode stood down
    # for the script's own manager, which then restored): the record holds what happened.
    if (
        isinstance(start, int)
        and not isinstance(start, bool)
        and (att.start_step, att.restored_from) != (start, came_from)
    ):
        if att.start_step is not None:
            new.append("corrected")  # said before: the line after says it was not so
        att.start_step, att.restored_from = start, came_from
        att.began_again = ""
        if start == 0 and came_from is None and att.newest_checkpoint > 0:
            att.began_again = began_again(report, script)[0]
        new.append("start")
    phases = restart_phases(att.started, report, prev)
    if phases and phases != att.phases:
        att.phases = phases
    for key, kind in proto.KEPT_FACTS.items():
        value = report.get(key)
        # io_error turns null when writing works again: the record keeps the last one seen.
        # What is new is what was never seen in this attempt: said once, then kept current.
        if isinstance(value, kind) and value and value != getattr(att, key):
            if not getattr(att, key):
                new.append(key)
            setattr(att, key, value)
    return new


def unchecked_resume(att: AttemptRecord) -> dict[str, Any] | None:
    """Pure: the verdict of a resumed attempt that reported none (every resume gets one): it
    ended before its first resumed step, or before that step's check was written."""
    if att.restored_from is None or att.start_step is None or att.resume_check is not None:
        return None
    step = att.start_step + 1
    if att.max_step is None or att.max_step < step:
        why = "the attempt ended before its first resumed step"
    else:
        why = "the attempt ended before the check of its first resumed step was written"
    return {"step": step, "verdict": "unchecked", "why": why}


def restart_phases(
    started: float, report: dict[str, Any], prev: AttemptRecord | None = None
) -> dict[str, float] | None:
    """Seconds of an attempt's start (wall times; None before the restore is reported):
    ``detection`` the previous attempt's death -> the supervisor noticed it, ``relaunch`` noticed
    -> this attempt started (flash persist, backoff, spawn), ``imports`` start -> torch imported
    and the hooks installed (about 0 from a warm spare), ``to_restore`` start -> restore began
    (imports, the script's own set-up, building the model), ``restore``, ``to_first_step``
    restore done -> the first resumed step done, ``start_to_first_step``."""
    keys = ("torch_ready", "restore_began", "restore_done", "first_step_done")
    t = {k: report.get(k) for k in keys}
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in t.values() if v is not None):
        return None
    began, done, first = t["restore_began"], t["restore_done"], t["first_step_done"]
    if began is None or done is None:
        return None
    out: dict[str, float] = {}
    if prev is not None and prev.died is not None and prev.ended >= prev.died:
        out["detection"] = round(prev.ended - prev.died, 4)
        out["relaunch"] = round(started - prev.ended, 4)
    ready = t["torch_ready"]
    if ready is not None and ready <= began:
        out["imports"] = round(max(0.0, ready - started), 4)
    out["to_restore"] = round(began - started, 4)
    out["restore"] = round(done - began, 4)
    if first is not None:
        out["to_first_step"] = round(first - done, 4)
        out["start_to_first_step"] = round(first - started, 4)
    return out


def trouble_lines(att: AttemptRecord, new: list[str]) -> list[tuple[str, str]]:
    """The (level, line)s for what went wrong that ``new`` (from :func:`learn`) brings."""
    lines = []
    if "checkpointing_off" in new and att.checkpointing_off is not None:
        off = att.checkpointing_off
        lines.append(
            (
                "error",
                f"attempt {att.attempt}: zero-code checkpointing turned itself off at step {off.get('step')} "
                f"({off.get('why')}); training goes on WITHOUT checkpoints: a crash from now on loses "
                "everything after the last checkpoint",
            )
        )
    if "save_failures" in new and att.save_failures is not None:
        lines.append(
            (
                "warning",
                f"attempt {att.attempt}: background saves fail ({att.save_failures.get('last')}); "
                "training goes on and the next trigger tries again",
            )
        )
    if "io_error" in new and att.io_error is not None:
        lines.append(
            (
                "warning",
                f"attempt {att.attempt}: cannot write its {att.io_error.get('what')} "
                f"({att.io_error.get('error')}); training goes on",
            )
        )
    return lines


def trouble_summary(attempts: list[AttemptRecord]) -> str:
    """What went wrong during the run, for the exit summary ("" when nothing did)."""
    notes = []
    for att in attempts:
        if att.checkpointing_off is not None:
            notes.append(
                f"attempt {att.attempt} trained without checkpoints from step "
                f"{att.checkpointing_off.get('step')} (zero-code checkpointing off: {att.checkpointing_off.get('why')})"
            )
        if att.save_failures is not None:
            notes.append(
                f"attempt {att.attempt}: {att.save_failures.get('count')} background save(s) failed "
                f"(last: {att.save_failures.get('last')})"
            )
        if att.io_error is not None:
            notes.append(
                f"attempt {att.attempt}: could not write its {att.io_error.get('what')} "
                f"({att.io_error.get('error')})"
            )
    return "; ".join(notes)


def start_line(
    att: AttemptRecord,
    report: dict[str, Any],
    script: str,
    lost: AttemptRecord | None,
    corrected: bool = False,
) -> tuple[str, str] | None:
    """(level, line) saying where an attempt really began, once it is known; None when there is
    nothing worth a line (a first start with nothing to restore). ``lost``: the attempt before,
    its lost work already counted from where this one began. ``corrected``: the child said
    otherwise before (zero-code mode armed at a warm-up step, then stood down for the script's
    own manager, which restored): the line says the earlier one was wrong."""
    if att.start_step is None:
        return None
    if att.restored_from is not None:
        fixed = (
            "; not step 0 as said above: the script's own CheckpointManager restored after zero-code "
            "mode stood down"
            if corrected
            else ""
        )
        return (
            "info",
            f"attempt {att.attempt}: resumed at step {att.start_step} (restored from {att.restored_from}){fixed}",
        )
    if not att.began_again:
        return None
    cause, fix = began_again(report, script)
    what = ""
    if lost is not None and lost.steps_lost is not None:
        what = f"; it trains {lost.steps_lost} step(s) again (lost: {lost.steps_lost} step(s), {lost.seconds_lost or 0:.1f} s)"
    return (
        "warning",
        f"attempt {att.attempt} began again at step 0, not at the checkpoint of step "
        f"{att.newest_checkpoint}: {cause}{what}. Fix: {fix}",
    )


def predicted_start(report: dict[str, Any] | None, newest: int) -> int:
    """Where the next attempt of the same script will begin: 0 when this one did not restore
    through ``start_step()`` (the next one will not either), else the newest checkpoint."""
    if report is not None and (report.get("start_step_called") is False or report.get("start_step_early")):
        return 0
    return newest
