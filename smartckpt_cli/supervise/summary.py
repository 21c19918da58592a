"""What ``smartckpt run`` says of a run once it ended: the summary lines, from its run record.

The one place that words the record for the exit summary, so the CLI prints lines and knows no
field of the record: the supervisor's own facts (outcome, attempts, work lost) are read here, what
the child said of its start (``began_words``, ``check_words``) in ``childreport.py``, which owns
those fields. Pure: a record in, lines (without the ``smartckpt: `` prefix) out.
"""

from __future__ import annotations

from smartckpt_cli.supervise.childreport import (
    began_words,
    check_words,
    never_stepped,
    said_how_it_began,
)
from smartckpt_cli.supervise.records import AttemptRecord, RunRecord

__all__ = ["attempt_line", "summary_lines"]


def summary_lines(rec: RunRecord) -> list[str]:
    """The run's exit summary: what it came to, each attempt when there is something to say of
    one (a restart, a run that did not finish, a start worth a word), the record's path; none
    when no attempt ran (the training had finished already)."""
    if not rec.attempts:
        return []
    data = rec.to_json()
    lines = [
        f"run {rec.run_id} {rec.outcome} (exit {rec.exit_code}): {rec.restarts} restart(s), "
        f"{rec.checkpoints_taken} checkpoint(s) taken, {data['wall_seconds']:.1f} s wall, "
        f"{data['steps_lost']} step(s) and {data['seconds_lost']:.1f} s lost"
    ]
    if rec.restarts or rec.outcome != "finished" or any(said_how_it_began(a) for a in rec.attempts):
        for i, a in enumerate(rec.attempts):
            lines.append(f"  {attempt_line(a, i + 1 < len(rec.attempts))}")
    if not rec.checkpoints_taken and never_stepped(rec.attempts):
        lines.append(
            "  no checkpoint: the training never stepped a torch.optim optimizer (zero-code "
            "checkpointing needs one; for a hand-written update, use a CheckpointManager)"
        )
    lines.append(f"run record: {rec.path()}")
    return lines


def attempt_line(a: AttemptRecord, followed: bool) -> str:
    """One attempt, in words (never a raw None); ``followed``: another attempt came after it."""
    # the step first: a cause may name a step of its own ("boom at step 20")
    at = f" at step {a.max_step}" if a.max_step is not None else " before its first step"
    end = f"finished{at}" if a.category == "done" else f"ended{at}: {a.cause or 'no cause known'}"
    line = f"attempt {a.attempt}: {began_words(a)}; {end}"
    if a.restart_from is not None:
        lost = f"{a.steps_lost} step(s)" if a.steps_lost is not None else "an unknown number of steps"
        nxt = "the next attempt began" if followed else "no attempt followed; a restart would resume"
        line += f"; lost {lost}, {a.seconds_lost or 0:.1f} s ({nxt} at step {a.restart_from})"
    return line + check_words(a)
