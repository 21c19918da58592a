"""What the training child says it did (``report.<pid>.json``; the contract is
``hooks/_smartckpt_protocol.py``'s), turned into the attempt's record and the lines ``smartckpt
run`` prints. The supervisor never guesses where a script began from the store: a script that
does not call ``start_step()`` begins again at step 0 whatever checkpoints exist, and only the
child knows whether it restored.

Pure: the supervisor reads the files (``RunDir.reports``) and prints what these return.

The one reader of the report and of the facts the attempt's record keeps from it: what each
fact is for comes from its declaration (``proto.FACTS``: its use, its kind, the phases a wall
time ends, the cause a value says), so a new fact is an entry there plus, when the record keeps
it, its ``AttemptRecord`` field. The supervisor, the summary and the CLI read those fields
through the functions here (``tests/test_child_protocol.py`` scans for any other reader).
"""

from __future__ import annotations

import os
from typing import Any

from smartckpt_cli.hooks import _smartckpt_protocol as proto
from smartckpt_cli.supervise.records import AttemptRecord

__all__ = [
    "began_again",
    "began_at",
    "began_words",
    "check_words",
    "lead_report",
    "learn",
    "never_stepped",
    "predicted_start",
    "restart_phases",
    "said_how_it_began",
    "script_name",
    "settle_resume_check",
    "start_line",
    "stepped",
    "trouble_detail",
    "trouble_lines",
    "trouble_summary",
]


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


def _causes(report: dict[str, Any]) -> list[proto.Fact]:
    """The CAUSE facts whose value in ``report`` says the script does not resume, in order."""
    said = proto.taken(report, proto.CAUSE)
    return [proto.FACTS[name] for name, value in said.items() if value == proto.FACTS[name].when]


def began_again(report: dict[str, Any], script: str) -> tuple[str, str]:
    """(why a script began at step 0 although a checkpoint existed, the fix)."""
    for fact in _causes(report):
        return fact.why.format(script=script), fact.fix
    return "nothing was restored", "see the child's output above for why"


def learn(
    att: AttemptRecord, report: dict[str, Any], script: str, prev: AttemptRecord | None = None
) -> list[str]:
    """Take what ``report`` says into ``att``; returns what is new: ``"start"`` (where it began
    is known now; ``"corrected"`` too when it said otherwise before) and each of the protocol's
    KEPT facts said for the first time in this attempt."""
    new = _learn_start(att, report, script)
    phases = restart_phases(att.started, report, prev)
    if phases and phases != att.phases:
        att.phases = phases
    for key, value in proto.taken(report, proto.KEPT).items():
        # io_error turns null when writing works again: the record keeps the last one seen.
        # What is new is what was never seen in this attempt: said once, then kept current.
        if value and value != getattr(att, key):
            if not getattr(att, key):
                new.append(key)
            setattr(att, key, value)
    return new


def _learn_start(att: AttemptRecord, report: dict[str, Any], script: str) -> list[str]:
    """The START facts into ``att``, all together, once the first (the step) is said: taken when
    first said, and again when the child corrects itself (zero-code mode stood down for the
    script's own manager, which then restored): the record holds what happened."""
    names = proto.of_use(proto.START)
    said = proto.taken(report, proto.START)
    start = [said.get(name) for name in names]
    if names[0] not in said or [getattr(att, name) for name in names] == start:
        return []
    new = ["corrected"] if att.start_step is not None else []  # the line after says it was not so
    for name, value in zip(names, start, strict=True):
        setattr(att, name, value)
    att.began_again = ""
    if att.start_step == 0 and att.restored_from is None and att.newest_checkpoint > 0:
        att.began_again = began_again(report, script)[0]
    return [*new, "start"]


def began_at(att: AttemptRecord) -> int | None:
    """The step the child said its attempt began at; None until it says."""
    return att.start_step


def stepped(report: dict[str, Any]) -> bool:
    """Whether ``report`` says the first step is done (a flash persist behind it may start)."""
    marks = proto.taken(report, proto.PHASE)
    return any(proto.FACTS[name].stepped for name in marks)


def settle_resume_check(att: AttemptRecord) -> None:
    """An ended attempt that resumed gets a resume check's verdict, reported or not."""
    att.resume_check = att.resume_check or unchecked_resume(att)


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
    restore done -> the first resumed step done, ``start_to_first_step``. Which wall time ends
    which phase, measured from what, is each PHASE fact's declaration (``proto.FACTS``)."""
    marks: dict[str, float] = proto.taken(report, proto.PHASE)
    names = list(marks)
    if any(proto.FACTS[name].needed and name not in marks for name in proto.of_use(proto.PHASE)):
        return None
    out: dict[str, float] = {}
    if prev is not None and prev.died is not None and prev.ended >= prev.died:
        out["detection"] = round(prev.ended - prev.died, 4)
        out["relaunch"] = round(started - prev.ended, 4)
    for i, name in enumerate(names):
        fact, at = proto.FACTS[name], marks[name]
        if not fact.needed and names[i + 1 :] and at > marks[names[i + 1]]:
            continue  # out of order: said after the mark that follows it
        for phase, since in fact.phases:
            if not since:
                out[phase] = round(max(0.0, at - started), 4)  # before the start: a warm spare's
            elif since in marks:
                out[phase] = round(at - marks[since], 4)
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
    if report is not None and _causes(report):
        return 0
    return newest


def trouble_detail(att: AttemptRecord, detail: dict[int, str]) -> None:
    """The reasons behind the heartbeat's trouble flags, for the status line: ``detail`` (the
    view's, filled in place) from what the child reported."""
    detail.clear()
    if att.checkpointing_off is not None:
        detail[proto.CHECKPOINTING_OFF] = (
            f"since step {att.checkpointing_off.get('step')}: {att.checkpointing_off.get('why')}"
        )
    if att.save_failures is not None:
        detail[proto.SAVE_FAILING] = (
            f"{att.save_failures.get('count')} failed, last: {att.save_failures.get('last')}"
        )
    if att.io_error is not None:
        detail[proto.IO_FAILING] = f"{att.io_error.get('what')}: {att.io_error.get('error')}"


# ---------------------------------------------------------------- the run's summary (summary.py)


def said_how_it_began(att: AttemptRecord) -> bool:
    """Whether the child said something of its start worth the summary's attempt lines: it
    began again at step 0 although a checkpoint existed, or its resume was checked."""
    return bool(att.began_again or att.resume_check)


def began_words(att: AttemptRecord) -> str:
    """Where an attempt began, in words (never a raw None)."""
    if att.start_step is None:
        return "began at an unreported step"
    if att.restored_from is not None:
        return f"resumed at step {att.start_step} (restored from {att.restored_from})"
    if att.began_again:
        return f"began again at step 0 ({att.began_again})"
    return f"began at step {att.start_step}"


def check_words(att: AttemptRecord) -> str:
    """The resume check's verdict, as the attempt line ends with it ("" without one)."""
    check = att.resume_check
    return f"; resume check at step {check.get('step')}: {check.get('verdict')}" if check else ""


def never_stepped(attempts: list[AttemptRecord]) -> bool:
    """Whether a child said its training never stepped a torch.optim optimizer."""
    return any(a.no_optimizer for a in attempts)
