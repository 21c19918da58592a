"""What a trigger policy sees and what it answers: :class:`TriggerContext` (built by the manager,
and by ``simulate`` from a trace, once per ``mgr.step``) and :class:`Decision`. Plain frozen
values, so that every policy stays pure (policies.py describes the order of calls).
"""

from __future__ import annotations

from dataclasses import dataclass

from smartckpt_cli.trigger.reading import SignalReading

__all__ = ["Decision", "TriggerContext"]


@dataclass(frozen=True)
class TriggerContext:
    step: int
    now: float  # seconds, monotonic
    last_save_step: int | None  # newest checkpoint taken (committed or in flight)
    last_save_time: float  # when it was taken (or when the run started)
    loss: float | None = None
    reading: SignalReading | None = None  # only on evaluation steps
    save_cost: float = 0.0  # seconds the loop loses per save (recent, smoothed)
    save_total: float = 0.0  # seconds from a save's start to its commit (recent, smoothed)
    mtbf: float | None = None  # mean time between failures, seconds


@dataclass(frozen=True)
class Decision:
    save: bool
    reason: str = ""
    score: float | None = None
    calm: bool = True  # taken while the signals looked calm: a known-good candidate
