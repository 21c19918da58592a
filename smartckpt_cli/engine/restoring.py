"""The restore path of :class:`~smartckpt_cli.engine.manager.CheckpointManager`: ``read`` the
newest committed checkpoint that verifies (the RAM tier's snapshot first, then the disk, then the
remote tier; several ranks agree on one), ``apply`` it to the registered objects, and what a
restore hands the steps after it: the lineage it continues, the resume check armed for the next
step, and ``smartckpt run``'s report of where the loop begins.

Apart from :mod:`.stepping` and :mod:`.saving` because it runs once, before the loop, on the
training thread with no save in flight (``read`` waits for it); ``restore()`` itself stays on the
facade. A mixin, as :mod:`.stepping` is: the state it reads is the manager's.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from smartckpt_cli.config import Settings
from smartckpt_cli.engine import ddp_layout
from smartckpt_cli.engine.cadence import StepClock
from smartckpt_cli.engine.coordinator import Coordinator
from smartckpt_cli.engine.observers import CheckpointSource
from smartckpt_cli.engine.ramtier import ENV_AREA, RamTier
from smartckpt_cli.engine.report import report
from smartckpt_cli.engine.restore import Loaded, same_lineage, warn_moments_reset
from smartckpt_cli.engine.resumecheck import ResumeCheck, expected_of, tolerance
from smartckpt_cli.engine.schedule import SaveSchedule
from smartckpt_cli.engine.writer import Persister
from smartckpt_cli.errors import CheckpointCorrupt, NoCheckpointError
from smartckpt_cli.remote.fetch import Candidate
from smartckpt_cli.state.apply import apply_checkpoint
from smartckpt_cli.state.registry import OPTIMIZER
from smartckpt_cli.store.directory import StoreDir
from smartckpt_cli.store.journal import CheckpointRecord
from smartckpt_cli.trigger.signals import Signals

__all__ = ["RestorePath"]

logger = logging.getLogger(__name__)


class RestorePath:
    """The manager's restore methods (module docstring)."""

    settings: Settings
    store: StoreDir
    _coord: Coordinator
    _source: CheckpointSource
    _ram: RamTier | None
    _objects: dict[str, tuple[str, Any]]
    _persister: Persister
    _schedule: SaveSchedule
    _signals: Signals
    _clock: StepClock
    _check: ResumeCheck
    _last_step: int
    _quiet: tuple[float, float]
    _prepare: bool
    _first_step_report: bool
    _read_began: float
    _restored_from: str | None
    last_restore: dict[str, Any] | None
    resume_limits: list[str]
    lineage: str | None
    wait: Callable[[], Any]
    _uncalm: Callable[[], None]  # calm.py

    def read(self, *, include_unhealthy: bool = False) -> Loaded | None:
        """The newest committed checkpoint that verifies, loaded but not applied (None when the
        store has none). Integrations whose objects appear at different times (a Trainer builds
        its optimizer inside ``train()``) read once and :meth:`apply` piece by piece.

        In this order: the candidates, newest first (the local journal's, with a remote tier
        the remote's too); the RAM tier's snapshot when it is as new as the newest of them and
        verifies (on every rank: no decode); else the newest candidate of the newest lineage
        that verifies (:meth:`_read_newest`), falling back to the previous one on damage."""
        self.wait()
        self._read_began = time.time()
        state = self.store.journal.read()
        every = self._source.order(state, include_unhealthy=include_unhealthy)
        loaded = self._read_ram(every[0].record.step if every else -1, include_unhealthy)
        if loaded is not None:
            self._restored_from = "ram"
            return loaded
        # Only the newest lineage: falling back into an older one would resume another run's
        # training as if it were this one.
        order = same_lineage(every)
        try:
            loaded = self._read_newest(order, state.store_id)
        except NoCheckpointError as err:
            older = [c.record.step for c in every if c not in order]
            if not older:
                raise
            raise NoCheckpointError(
                f"{err}; {len(older)} older checkpoint(s) (newest step {older[0]}) belong to another "
                "lineage, a training that began again at step 0 after them: not restored in its place "
                "(smartckpt inspect shows the lineages)"
            ) from None
        if loaded is None:
            report(start_step=0, restored_from=None, checkpoint=None, lineage=self.lineage)
        return loaded

    def _read_newest(self, order: list[Candidate], store_id: str | None) -> Loaded | None:
        """The newest of ``order`` that every rank loads (None: ``order`` is empty): each rank
        reads its part of a candidate, the coordinator tells every rank the outcome, and a
        candidate any rank failed to load is fallen back from on every rank."""
        tried: list[str] = []
        for cand in self._coord.restore_order(order):  # rank 0's order, on every rank
            loaded, failure = None, None
            try:
                loaded = self._read_candidate(cand, store_id)
            except Exception as err:  # settled below, on every rank: a fallback, or raised
                failure = err
            problem = self._coord.settle(cand.record.step if cand is not None else None, failure)
            if problem is not None:
                tried.append(problem)
                continue
            assert cand is not None and loaded is not None  # settled: this rank loaded it
            warn_moments_reset(loaded)
            self._restored_from = "remote" if cand.where == "remote" else "disk"
            return loaded
        if tried:
            raise self._coord.nothing_loads(tried, self.store.root)
        return None

    def _read_candidate(self, cand: Candidate | None, store_id: str | None) -> Loaded:
        """This rank's part of ``cand``, read and verified from the local store. One only the
        remote holds, or whose local copy fails while the remote has a copy, is downloaded
        first (its missing or damaged parts) and read again. Raises CheckpointCorrupt."""
        if cand is None:  # rank 0's candidate, not in this rank's journal
            raise CheckpointCorrupt("not in this rank's view of the journal")
        damaged = None
        if cand.where == "local":
            try:
                return self._read_local(cand.record, store_id)
            except CheckpointCorrupt as err:
                if not cand.remote_copy:
                    raise
                damaged = err
        self._source.fetch(cand, damaged)
        return self._read_local(cand.record, store_id)

    def _read_local(self, rec: CheckpointRecord, store_id: str | None) -> Loaded:
        """This rank's part of ``rec`` from the local store, verified (resharded when it was
        written at another world size)."""
        reset = self.settings.on_l2_corrupt == "reset"
        return self._coord.load(
            self.store, rec, store_id, skip_corrupt_l2=reset, workers=self.settings.n_workers
        )

    def _read_ram(self, disk_step: int, include_unhealthy: bool) -> Loaded | None:
        """The RAM tier's snapshot, verified, when it is at least as new as ``disk_step``; with
        several ranks only when every rank has verified one of the same step."""
        if self._ram is None and not os.environ.get(ENV_AREA):
            return None  # no RAM tier on any rank (the area is the same on every rank)
        # A rank whose tier is off still takes part in the agreement below (a collective).
        rec = self._ram.candidate(include_unhealthy=include_unhealthy) if self._ram is not None else None
        loaded = None
        if self._ram is not None and rec is not None and int(rec["step"]) >= disk_step:
            loaded = self._ram.load(rec)
        step = int(loaded.record.step) if loaded is not None else None
        if not self._coord.agree_on(step):
            if loaded is not None:
                logger.warning(
                    "smartckpt: the RAM snapshot of step %s is not on every rank; restoring from disk", step
                )
            return None
        return loaded

    def apply(self, loaded: Loaded, names: list[str] | None = None) -> int:
        """Load ``loaded`` (from :meth:`read`) into the registered objects, all of them or those
        ``names``; returns its step. The manager counts from that step on."""
        objects = self._objects if names is None else {n: self._objects[n] for n in names}
        apply_checkpoint(loaded, objects)
        if loaded.manifest.get("resharded_from") is None:  # same world size: bit-exact (ddp_layout.py)
            meta = loaded.manifest.get("meta", {}).get(ddp_layout.DDP_META)
            where = (self._coord.world, self._coord.rank)
            self.resume_limits = ddp_layout.restore(meta, objects, *where, int(loaded.record.step))
        if self.last_restore is not loaded.manifest:
            self._persister.remember(loaded.manifest)
            self.last_restore = loaded.manifest
            self._schedule.restored(int(loaded.record.step), time.monotonic())
            # The loop goes on from here: the optimizer pre-hook of the next step reads (and a
            # trace row names) step + 1, and the gradient hooks are armed for that step.
            self._last_step = int(loaded.record.step)
            self._signals.arm(self._signals.due(self._last_step + 1))
            self._quiet, self._prepare = (-math.inf, -math.inf), True
            self._clock.skip()
            self._uncalm()
            logger.info("restored step %d from %s", loaded.record.step, loaded.record.manifest)
            self._resumed(loaded)
        return int(loaded.record.step)

    def _resumed(self, loaded: Loaded) -> None:
        """After a restore: continue its lineage, arm the resume check for the next step, and
        tell ``smartckpt run`` where the loop begins."""
        rec = loaded.record
        lineage = rec.event.get("lineage")
        self.lineage = str(lineage) if lineage else None  # None: checkpoints from before lineages
        on_cpu = all(t.device.type == "cpu" for t in self._some_tensors())
        restored = {
            "id": rec.id,
            "step": rec.step,
            # the journal's values are rank 0's (it alone writes them): the other ranks compare
            # only what their own part's manifest holds
            "expected": expected_of(
                loaded.manifest, rec.id, self._journal_events if self._coord.leads else list
            ),
            "rtol": tolerance(on_cpu_only=on_cpu, deterministic=torch.are_deterministic_algorithms_enabled()),
        }
        if self.resume_limits:  # what this restore knows it could not carry: the line names it
            restored["known"] = list(self.resume_limits)
        if restored["expected"] is None and not self._coord.leads:
            restored["skip"] = "rank 0 alone recorded the step after this checkpoint (in the journal)"
        if loaded.manifest.get("resharded_from") is not None:
            # another world size: every rank trains on other batches than before, by design
            restored["skip"] = (
                f"resumed at another world size (from {loaded.manifest['resharded_from']} ranks)"
            )
        self._check.check(int(rec.step) + 1, restored)
        report(
            start_step=int(rec.step),
            restored_from=self._restored_from or "disk",
            checkpoint=rec.id,
            lineage=self.lineage,
            # for smartckpt run's record of a restart: the restore's phases (wall times); the
            # first resumed step's end follows from step() (_first_step_report)
            restore_began=self._read_began,
            restore_done=time.time(),
        )
        self._first_step_report = True

    def _some_tensors(self) -> list[torch.Tensor]:
        """A parameter of every registered module and optimizer: where the training runs."""
        out = []
        for kind, obj in self._objects.values():
            if kind == OPTIMIZER:
                out += [p for g in obj.param_groups for p in g["params"][:1]]
            elif kind == "module":
                mod = getattr(obj, "module", obj)  # zero-code wraps its modules
                out += list(mod.parameters())[:1] if isinstance(mod, torch.nn.Module) else []
        return out

    def _journal_events(self) -> list[dict[str, Any]]:
        try:
            return self.store.journal.read_events()[1]
        except Exception as err:  # the check goes without; the restore stands
            logger.debug("journal unreadable for the resume check: %s", err)
            return []
