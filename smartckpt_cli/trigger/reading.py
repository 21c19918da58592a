"""One evaluation of the training signals, as the trigger sees it: plain numbers, no torch.

:mod:`smartckpt_cli.trigger.signals` produces these on the device side; the trigger (pure), the trace and
``smartckpt simulate`` only read them, so they need nothing heavier than this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["SignalReading"]


@dataclass(frozen=True)
class SignalReading:
    step: int
    loss: float | None  # median-filtered loss at this evaluation
    curvature: float | None  # None until three evaluations exist
    grad_var: float | None
    raw_loss: float | None = None  # the newest step's loss, unfiltered
    update: float | None = None  # norm of the update planned at this step (planned.py)
    memory: float | None = None  # fraction of the tightest memory ceiling in use (memory.py)

    def meta(self) -> dict[str, Any]:
        """The signals that led to a checkpoint, for its manifest."""
        out: dict[str, Any] = {
            "step": self.step,
            "loss": self.loss,
            "curvature": self.curvature,
            "grad_var": self.grad_var,
        }
        if self.memory is not None:
            out["memory"] = self.memory
        return out
