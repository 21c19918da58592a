"""The RAM tier's side of a save of :class:`~smartckpt_cli.engine.manager.CheckpointManager`: a
snapshot taken into the tier's free slot keeps it or gives it back (training thread), and on the
save thread becomes the RAM snapshot once its copies are done, hashed and recorded (ramtier.py).

Apart from :mod:`.saving` because it is the one part of a save that may fail without failing the
save: the RAM tier stands down and the disk save goes on; and a RAM snapshot alone (its own
cadence) writes nothing to disk. A mixin, as :mod:`.saving` is: the state it reads is the
manager's.
"""

from __future__ import annotations

from typing import Any

from smartckpt_cli.engine.ramtier import RamTier
from smartckpt_cli.engine.resumecheck import Values
from smartckpt_cli.engine.snapshot import Stager
from smartckpt_cli.engine.unchanged import Unchanged
from smartckpt_cli.engine.writer import CommitInfo, Persister

__all__ = ["RamSavePath"]


class RamSavePath:
    """The manager's RAM-tier save methods (module docstring)."""

    _ram: RamTier | None
    _stager: Stager
    _prepare: bool
    _persister: Persister
    _unchanged: Unchanged

    def _settle_slot(self, snap: Any, slot: int) -> None:
        """Training thread, after the snapshot: it keeps the slot, or gives it back."""
        if self._stager.missed:  # an entry without its place in the slot: not a RAM snapshot
            self._ram_end(slot)
            self._prepare = True  # the state changed shape: the slots are laid out again
        else:
            snap.ram_slot = slot
            # private buffers a snapshot that missed the slot left (a slot being read):
            # freed, so the state is held once beyond training, in the slot
            self._stager.forget_except(set())

    def _ram_end(self, slot: int) -> None:
        assert self._ram is not None
        self._ram.end(slot)

    def _ram_commit(self, snap: Any) -> None:
        """Save thread: the snapshot becomes the RAM snapshot once its copies are done (hashed,
        recorded; ramtier.py). A failure is said once and the RAM tier stands down: the disk
        save goes on."""
        if snap.ram_slot is None or self._ram is None:
            return
        try:
            snap.wait_ready()
            self._ram.commit(snap, snap.ram_slot, self._persister.pool)
            staged = {it.plan.key for it in snap.staged}
            self._unchanged.ram_committed((snap.ram_slot, self._ram.layout), snap.fingerprints, staged)
        except Exception as err:
            self._ram.stand_down(
                f"the RAM snapshot of step {snap.step} failed ({type(err).__name__}: {err}): the RAM tier "
                "stands down, restarts restore from disk"
            )
        finally:
            self._ram_end(snap.ram_slot)

    def _persist_ram(self, snap: Any, next_step: Values | None = None) -> CommitInfo | None:
        """Save thread: a RAM snapshot alone (``_hand_over``); its failure is said, never raised."""
        if next_step is not None:
            snap.meta = {**snap.meta, "next_step": {"step": next_step.step, **next_step.read()}}
        self._ram_commit(snap)
        return None
