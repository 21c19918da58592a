"""What ``smartckpt run`` gives the supervisor and what it shows back: :class:`RunOptions` (the
command and its settings, from the CLI) and :class:`RunState` (the live view the supervisor keeps
current and the CLI renders as a panel or as log lines), and :data:`Emit`, how it reports events.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from smartckpt_cli.config import Settings
from smartckpt_cli.hooks import _smartckpt_protocol as proto
from smartckpt_cli.supervise.monitor import Usage

__all__ = ["Emit", "RunOptions", "RunState", "trouble_text"]

Emit = Callable[[str, str], None]  # (level, message): level is a logging level's name, lower case


@dataclass
class RunOptions:
    command: list[str]  # the full child command (``python train.py ...`` already expanded)
    settings: Settings
    sources: dict[str, str] = field(default_factory=dict)  # load_settings' sources
    run_id: str | None = None
    first_attempt: int = 0
    resume_finished: bool = False  # start the command even when its last run finished
    poll: float = 0.2
    # Where the child's output goes: None = inherited (straight to our stdout/stderr); a callable
    # gets each line (stdout and stderr merged), so a live panel can print above itself.
    output: Callable[[str], None] | None = None


@dataclass
class RunState:
    """What the CLI shows; updated in place by the supervisor."""

    run_id: str = ""
    command: str = ""
    attempt: int = 0
    restarts: int = 0
    pid: int | None = None
    phase: str = "starting"  # starting | running | stopping | restarting | finished
    step: int | None = None
    total: int | None = None  # the steps the training takes in all, when the child said
    rate: float | None = None  # steps per second, lately (pace.Pace)
    loss: float | None = None
    child_state: str = ""
    heartbeat: bool = False
    hooks_live: bool = False
    checkpoint_step: int | None = None
    checkpoint_seen: float | None = None  # wall time the supervisor first saw that checkpoint
    checkpoints_taken: int = 0
    hang_timeout: float | None = None
    trouble: int = 0  # the protocol's trouble flags, of any rank's heartbeat
    trouble_detail: dict[int, str] = field(default_factory=dict)  # flag -> why, once reported
    usage: Usage = field(default_factory=Usage)
    started: float = field(default_factory=time.time)


def trouble_text(st: RunState) -> str | None:
    """What goes wrong now, for the status line and the panel: each trouble flag a heartbeat
    carries, with the child's reason where its report gave one; None when all is well."""
    parts = []
    for flag, name in proto.TROUBLE_NAMES.items():
        if st.trouble & flag:
            why = st.trouble_detail.get(flag)
            parts.append(f"{name} ({why})" if why else name)
    return "; ".join(parts) or None
