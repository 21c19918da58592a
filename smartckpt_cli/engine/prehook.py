"""The optimizer step pre-hook of :class:`~smartckpt_cli.engine.manager.CheckpointManager`: what
``opt.step()`` runs before the update (step 1 of the order in :mod:`.stepping`).

Apart from :mod:`.stepping` because it runs inside the user's ``optimizer.step()``, not in
``mgr.step()``: the lazy snapshot's guard, the gradient statistics of an evaluation step and,
when the policy can save before the update (one process), the evaluation itself and the save of
the previous step, whose parameters and moments are still untouched. Nothing here may raise into
the user's optimizer. Zero-code mode's own optimizer hooks say here when an update begins and
ends (``update_begins``, ``update_done``): the loss of the step being updated goes with a save of
the step before it. A mixin, as :mod:`.stepping` is: the state it reads is the manager's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from smartckpt_cli.config import Settings
from smartckpt_cli.engine.coordinator import Coordinator
from smartckpt_cli.engine.prestep import Boundary
from smartckpt_cli.engine.resumecheck import ResumeCheck
from smartckpt_cli.trigger.policies import Decision, Policy, TriggerContext
from smartckpt_cli.trigger.reading import SignalReading
from smartckpt_cli.trigger.signals import Signals

if TYPE_CHECKING:
    from smartckpt_cli.engine.saving import SaveHandle

__all__ = ["PreHookPath"]

logger = logging.getLogger(__name__)


class PreHookPath:
    """The manager's optimizer pre-hook (module docstring)."""

    settings: Settings
    policy: Policy
    _precursor: bool
    _signals: Signals
    _eval_cost: float
    _coord: Coordinator
    _boundary: Boundary
    _pre_reading: SignalReading | None
    _pre_hooks: int
    _pre_saved: tuple[SaveHandle, str] | None
    _precursor_refused: set[str]  # what is said once: a refused precursor, a failed evaluation
    _optimizers: list[Any]
    _objects: dict[str, tuple[str, Any]]
    _lazy_snapshot: Any
    _inflight: SaveHandle | None
    _last_step: int
    _last_reading: SignalReading | None
    _next_eval: int
    _check: ResumeCheck
    _ahead: tuple[int, Any, Any, Any] | None  # (step, loss, scale, optimizer): zero-code's update
    _take_check: Callable[[int, Any, Any], None]  # stepping.py
    _launch: Callable[[int], None]  # stepping.py
    _context: Callable[[int, SignalReading | None], TriggerContext]  # stepping.py
    _save: Callable[..., SaveHandle]
    _save_failed: Callable[[int, BaseException], str]

    def _before_optimizer_step(self, optimizer: Any, *_: Any) -> None:
        # The lazy snapshot's guard: parameters and moments may only change once copied.
        snap = self._lazy_snapshot
        if snap is not None:
            snap.guard()
            if snap.copied.is_set():
                self._lazy_snapshot = None
        step = self._last_step + 1
        if step == self._check.step and optimizer is self._optimizers[0]:
            self._check.grads(optimizer)  # the step after a save or a restore (resumecheck.py)
        if step < self._next_eval or not self._signals.due(step):
            return  # a step that does not evaluate: nothing else to do here
        # Gradient statistics for the evaluation, reduced on the device.
        t0 = time.monotonic()
        self._signals.collect_grads(optimizer, self._loss_scale())
        self._pre_hooks += 1
        self._eval_cost += time.monotonic() - t0
        # After the last optimizer's statistics: evaluate here, before any update runs, when
        # the policy can save before it. Several ranks evaluate in step(): rank 0 decides for all
        # at a decision step, and no collective may run in a hook.
        if self._coord.hooks_may_save and self._precursor and self._pre_hooks == len(self._optimizers):
            try:
                self._before_update(step)
                if step == self._check.step:  # it saved: the expectation is this step's
                    self._check.grads(self._optimizers[0])
            except Exception as err:  # never break the user's optimizer.step()
                self._save_failed(self._last_step, err)

    def _before_update(self, step: int) -> None:
        """The evaluation of ``step`` and the policy's save before the update: the checkpoint of
        the previous step, whose parameters and moments are untouched. The reading is needed
        now: on CUDA this waits for the readback (the backward and the reductions queued before
        it), once per evaluation — the precursor's one host sync."""
        t0 = time.monotonic()
        self._launch(step)
        t1 = time.monotonic()
        reading = self._pre_reading = self._signals.poll(wait=True)
        t2 = time.monotonic()
        ask = getattr(self.policy, "before_update", None)
        if ask is None or reading is None:
            return
        decision: Decision = ask(self._context(step, reading))
        self._eval_cost += (t1 - t0) + (time.monotonic() - t2)  # the wait is not its cost
        if not decision.save:
            return
        busy = self._inflight is not None and not self._inflight.done() and self.settings.inflight == "skip"
        prev = self._last_step
        objects = self._boundary.objects(self._objects) if self._boundary.step == prev else None
        if objects is None or busy:
            why = self._boundary.why_not if objects is None else None
            if why is not None and why not in self._precursor_refused:
                self._precursor_refused.add(why)
                logger.warning(
                    "no save before the update of step %d: %s; the alarm is taken at the step boundary",
                    step,
                    why,
                )
            return  # the alarm stays pending: step() takes it, after the update
        self._last_reading = reading
        handle = self._save(prev, decision, lazy=False, objects=objects)
        self._pre_saved = (handle, decision.reason)
        logger.info("step %d: saved before the update of step %d (%s)", prev, step, decision.reason)

    def _loss_scale(self) -> torch.Tensor | None:
        """The current scale of a registered, enabled GradScaler (a device tensor: no sync)."""
        for kind, obj in self._objects.values():
            if kind == "state" and isinstance(obj, torch.amp.GradScaler) and obj.is_enabled():
                scale = getattr(obj, "_scale", None)
                return scale if isinstance(scale, torch.Tensor) else None
        return None

    def wants_loss_before_update(self, step: int) -> bool:
        """Whether :meth:`update_begins` for ``step`` matters beyond a save of ``step - 1``:
        the resume check compares ``step``'s values (a restore or a save came just before)."""
        return self._check.step == step

    def update_begins(self, step: int, loss: Any, loss_scale: Any, optimizer: Any) -> None:
        """Zero-code mode, in the pre-hook of ``optimizer`` (the first to step) at ``step``: the
        loss of ``step`` is known before its update. A save of ``step - 1`` taken before
        :meth:`update_done` (the post-hook of ``step``) records it with the checkpoint, a
        precursor save included; after a restore it is checked."""
        self._ahead = (step, loss, loss_scale, optimizer)
        if self._check.step == step and self._check.restored is not None:
            self._check.grads(optimizer)
            self._take_check(step, loss, loss_scale)

    def update_done(self) -> None:
        """The update :meth:`update_begins` announced is done: its loss no longer goes with a save."""
        self._ahead = None
