"""What the child says it did (``report.<pid>.json``), heard while its attempt runs and once it
ended (:class:`Hearing`).

``childreport.py`` reads and words a report (pure); this module is where the supervisor acts on
it, and it is separate from ``supervisor.py``'s loop because it belongs to one attempt: the
attempt's record, the previous attempt's lost work when the child began elsewhere than expected,
the go of a flash persist waiting for the first step, the view's trouble detail, and the lines
said once each.

Order of calls (the supervisor, main thread): one :class:`Hearing` per attempt, made when its child
starts; :meth:`Hearing.hear` at polls of the attempt and once after it ended; ``report`` read
after that.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from smartckpt_cli.supervise.child import RunDir
from smartckpt_cli.supervise.childreport import (
    began_at,
    lead_report,
    learn,
    start_line,
    stepped,
    trouble_detail,
    trouble_lines,
)
from smartckpt_cli.supervise.records import AttemptRecord
from smartckpt_cli.supervise.restarts import record_lost
from smartckpt_cli.supervise.runstate import Emit, RunState

__all__ = ["Hearing"]


@dataclass
class Hearing:
    """One attempt's child, heard: its report into the record, the view and the log."""

    att: AttemptRecord
    files: RunDir
    state: RunState
    emit: Emit
    script: str  # the script's name, as the lines say it
    first_step: threading.Event  # set once the child did its first step (a flash persist waits)
    save_record: Callable[[], None]
    prev: AttemptRecord | None  # the attempt before this one, None for the first
    prev_seen: dict[int, float]  # when a heartbeat first showed each of prev's steps
    report: dict[str, Any] | None = None  # what the child said it did; None until it says

    def hear(self) -> None:
        """What the child says it did (report.<pid>.json): into the record, and said once."""
        att, prev = self.att, self.prev
        report = lead_report(self.files.reports())
        if report is None:
            return
        self.report = report
        new = learn(att, report, self.script, prev)
        if stepped(report):
            self.first_step.set()
        trouble_detail(att, self.state.trouble_detail)
        for level, text in trouble_lines(att, new):
            self.emit(level, text)
        began = began_at(att)
        if "start" not in new or began is None:
            return
        if prev is not None and prev.restart_from != began:
            # the restart began elsewhere than expected: what the dead attempt lost is counted again
            prev.restart_from = began
            record_lost(prev, self.prev_seen)
            self.save_record()
        said = start_line(att, report, self.script, prev, corrected="corrected" in new)
        if said is not None:
            self.emit(*said)
