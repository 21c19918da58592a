"""The save path of :class:`~smartckpt_cli.engine.manager.CheckpointManager`: a snapshot on the
training thread, the persist on the background save thread, retention after each commit.

Order of calls: ``save()`` or a step's decision calls ``_save`` (training thread): it waits for
the save in flight (its staging buffers are about to be refilled), takes the snapshot (the only
time the loop waits: eager copies now, lazy ones guarded by the optimizer pre-hook) and hands it
to the save thread, which runs ``_persist``: the coordinator's persist (one process: under the
shared ``gc.lock``; several ranks: the two-phase commit), then the commit observers
(``on_commit``), the cost average (trigger/cost.py) and ``_retain``. A failure there is logged,
counted, journalled and never raised into the training thread. A preemption signal makes
``_preempted`` take a blocking save, tell the observers (``on_preempt``) and hand the signal on.

This is a mixin, as :mod:`.stepping` is: the state it reads is the manager's. The RAM tier's side
of a save (its slot, the RAM snapshot on the save thread) is :mod:`.ramsave`'s.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from smartckpt_cli.config import Settings
from smartckpt_cli.engine import ddp_layout, distributed, heartbeat
from smartckpt_cli.engine.cadence import StepClock
from smartckpt_cli.engine.coordinator import Coordinator
from smartckpt_cli.engine.observers import CommitObserver
from smartckpt_cli.engine.pager import Pager
from smartckpt_cli.engine.preempt import PreemptionWatch
from smartckpt_cli.engine.ramtier import RamTier
from smartckpt_cli.engine.report import report
from smartckpt_cli.engine.resumecheck import ResumeCheck, Values, capture, grad_sumsq
from smartckpt_cli.engine.savehandle import SaveHandle, failure_cause, peer_gone
from smartckpt_cli.engine.saverecord import EventBacklog, SaveRecord
from smartckpt_cli.engine.schedule import SaveSchedule
from smartckpt_cli.engine.snapshot import Stager, staging_specs, take_snapshot
from smartckpt_cli.engine.unchanged import Unchanged
from smartckpt_cli.engine.writer import CommitInfo, Persister
from smartckpt_cli.errors import UnsupportedValueError
from smartckpt_cli.store import ramarea
from smartckpt_cli.store.directory import StoreDir
from smartckpt_cli.store.retention import GC_LOCK, collect_garbage, prune, select_prunable
from smartckpt_cli.trigger.policies import Decision
from smartckpt_cli.trigger.reading import SignalReading
from smartckpt_cli.trigger.trace import TraceWriter

if TYPE_CHECKING:
    from smartckpt_cli.engine.stepping import StepResult

__all__ = ["SavePath"]

logger = logging.getLogger(__name__)


class SavePath:
    """The manager's save methods (module docstring)."""

    @property
    def last_commit(self) -> CommitInfo | None:
        """The newest checkpoint this manager committed (the save thread sets it)."""
        return self._record.last_commit

    settings: Settings
    store: StoreDir
    _coord: Coordinator
    _observers: list[CommitObserver]
    _persister: Persister
    _saver: ThreadPoolExecutor
    _stager: Stager
    _pager: Pager | None
    _objects: dict[str, tuple[str, Any]]
    _optimizers: list[Any]
    _meta: dict[str, Any]
    _trace: TraceWriter
    _preempt: PreemptionWatch
    _clock: StepClock
    _closed: bool
    _inflight: SaveHandle | None
    _lazy_snapshot: Any
    _record: SaveRecord
    _backlog: EventBacklog
    _unchanged: Unchanged
    _pruned_seen: int
    _last_loss: torch.Tensor | float | None
    _ram: RamTier | None
    _ram_due: float
    _prepare: bool
    _last_reading: SignalReading | None
    _quiet: tuple[float, float]
    _wish: Decision | None
    _schedule: SaveSchedule
    _check: ResumeCheck
    _ahead: tuple[int, Any, Any, Any] | None
    lineage: str | None
    _news: Any  # queue.SimpleQueue[str]: "commit" / "failure", from the save thread to the loop

    _uncalm: Callable[[], None]  # calm.py
    _hand_over: Callable[..., SaveHandle]  # handover.py
    _hand_over_checkpoint: Callable[..., SaveHandle]  # handover.py
    _plan_budget: Callable[[Any], Any]  # staging.py
    _budgeted: bool
    _settle_slot: Callable[[Any, int], None]  # ramsave.py
    _ram_end: Callable[[int], None]
    _ram_commit: Callable[[Any], None]
    _persist_ram: Callable[..., CommitInfo | None]

    def save(self, step: int, reason: str = "manual", blocking: bool = False) -> SaveHandle:
        """Save now, on the eager path: blocks for the whole snapshot copy (and for a save still in
        flight), so it is safe anywhere, also outside a training step. With ``blocking=True`` it
        also waits until the checkpoint is committed. (``step()`` takes the lazy path.)"""
        handle = self._save(step, Decision(True, reason), lazy=False)
        err = handle.error
        if isinstance(err, UnsupportedValueError):
            # A state that can never be stored (a quantized tensor): the caller asked for this save,
            # so it hears of it at once. step() records it instead, like any failed save.
            raise err
        if blocking:
            with heartbeat.heartbeat_state("SAVING"):
                handle.wait()
        return handle

    def _preempted(self, step: int, signum: int, result: StepResult) -> StepResult:
        import signal as _signal

        name = _signal.Signals(signum).name
        logger.warning("smartckpt: %s received: taking a blocking checkpoint at step %d", name, step)
        with heartbeat.heartbeat_state("SAVING"):
            handle = self._save(step, Decision(True, f"preemption ({name})", calm=False), lazy=False)
            handle.wait()
            for observer in self._observers:  # the node may not come back: get it off the node first
                observer.on_preempt()
        self._trace.flush()
        result.saved, result.handle, result.reason = True, handle, f"preemption ({name})"
        # exits through the signal unless told to continue
        self._preempt.finish(signum, step if handle.error is None else None)
        return result

    def _loss_is_finite(self) -> bool:
        loss = self._last_loss
        if loss is None:
            return True
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)  # one sync per save
        return math.isfinite(value)

    def _save(
        self,
        step: int,
        decision: Decision,
        *,
        lazy: bool,
        objects: dict[str, tuple[str, Any]] | None = None,
        ram_only: bool = False,
    ) -> SaveHandle:
        if self._closed:
            raise RuntimeError("CheckpointManager is closed")
        t0 = time.perf_counter()
        self.wait()  # one save in flight: its staging buffers are about to be refilled
        if self.settings.memory_budget and not self._budgeted and objects is None:
            self._plan_first_budget()
        # The RAM tier's free slot (ramtier.py): the snapshot's staging buffers are its memory.
        ram = self._ram.begin() if self._ram is not None else None
        if ram_only and ram is None:
            return SaveHandle(step, None)  # nothing to take it into (a slot being read): skipped
        self._stager.use(ram[1] if ram is not None else None)
        try:
            snap = self._take(step, decision, lazy=lazy, objects=objects, ram=ram, ram_only=ram_only)
        except Exception as err:  # a state_dict() that raises: a failed save, not a failed step
            self._stager.use(None)
            if ram is not None:
                self._ram_end(ram[0])
            self._save_failed(step, err)
            return SaveHandle.failed(step, err)
        if ram is not None:
            self._settle_slot(snap, ram[0])
        self._stager.use(None)
        healthy = self._label(snap, decision)
        next_step = self._values_ahead(step)
        if ram_only:
            handle = self._hand_over(snap, t0, ram_only=True, next_step=next_step)
            if next_step is None:  # taken at step(step + 1), then written into the RAM record
                self._check.expect(step + 1, None)
            return handle
        return self._hand_over_checkpoint(snap, step, t0, healthy, next_step)

    def _plan_first_budget(self) -> None:
        try:  # a save before the first step: what the budget allows (staging.py)
            self._plan_budget(
                staging_specs(self._objects, precision=self.settings.precision, rules=self.settings.tiers)
            )
        except Exception as err:  # the snapshot raises it again, as a failed save
            logger.debug("memory budget not planned: %s", err)

    def _take(
        self,
        step: int,
        decision: Decision,
        *,
        lazy: bool,
        objects: dict[str, tuple[str, Any]] | None,
        ram: tuple[int, dict[str, torch.Tensor]] | None,
        ram_only: bool,
    ) -> Any:
        """The snapshot (snapshot.py): of ``objects`` (a precursor's boundary) or of the
        registered objects, into the RAM slot ``ram`` when there is one, else into the pager."""
        return take_snapshot(
            self._objects if objects is None else objects,
            stager=self._stager,
            step=step,
            reason=decision.reason,
            score=decision.score,
            precision=self.settings.precision,
            rules=self.settings.tiers,
            meta=self._meta,
            lazy_params=self._guarded_params() if lazy else None,
            trained=self._guarded_params(),
            unchanged=self._unchanged if objects is None else None,
            slot=(ram[0], self._ram.layout) if ram is not None and self._ram is not None else None,
            ram_only=ram_only,
            pager=self._pager if ram is None else None,
        )

    def _label(self, snap: Any, decision: Decision) -> bool:
        """The snapshot's health, calm and metadata; whether its loss was finite."""
        healthy = self._loss_is_finite()
        snap.health = "ok" if healthy else "nonfinite-loss"
        snap.calm = decision.calm and healthy
        snap.meta = {**snap.meta, "signals": self._last_reading.meta() if self._last_reading else None}
        if ddp := ddp_layout.record(self._objects):  # DDP's gradient buckets (ddp_layout.py)
            snap.meta[ddp_layout.DDP_META] = ddp
        if self.lineage is not None:
            snap.meta["lineage"] = self.lineage
        return healthy

    def _values_ahead(self, step: int) -> Values | None:
        # The resume check's expectation (resumecheck.py): zero-code mode saves from the pre-hook
        # of the next step, whose loss and gradients exist already: they go with the checkpoint
        # (a RAM snapshot's too).
        ahead = self._ahead
        if ahead is not None and ahead[0] == step + 1:
            return capture(step + 1, ahead[1], ahead[2], grad_sumsq(ahead[3]))
        return None

    def _guarded_params(self) -> set[int]:
        return {
            distributed.local_tensor(p).untyped_storage().data_ptr()
            for opt in self._optimizers
            for g in opt.param_groups
            for p in g["params"]
        }

    def _persist(self, snap: Any, snap_time: float, next_step: Values | None = None) -> CommitInfo:
        try:
            return self._persist_snapshot(snap, snap_time, next_step)
        finally:
            snap.release()  # a save in pieces that stopped early: the loop never waits on it

    def _persist_snapshot(self, snap: Any, snap_time: float, next_step: Values | None) -> CommitInfo:
        if next_step is not None:  # CUDA: long read back by now (the snapshot copy came after it)
            snap.meta = {**snap.meta, "next_step": {"step": next_step.step, **next_step.read()}}
        # in the RAM tier first (with the next step's values: a restore from RAM checks them
        # too): a crash while the disk is written loses nothing
        self._ram_commit(snap)
        area = os.environ.get(ramarea.ENV_AREA)
        if area:  # smartckpt run may still be writing the dead attempt's RAM snapshot: after it
            ramarea.flash_wait(area)
        try:
            info = self._coord.persist(self._persister, snap, lambda: self.store.lock(GC_LOCK, shared=True))
        except Exception as err:
            self._save_failed(snap.step, err)
            raise  # held by the handle (SaveHandle.error); wait() never raises it
        self._record.newest(info)
        # what the next save may reference (engine/unchanged.py), and what changed behind its back
        if snap.fingerprints:
            self._unchanged.committed(snap.fingerprints, info.entries)
        for key in info.changed:
            self._unchanged.changed(key, snap.step)
        for key in info.restage:  # its blob is damaged: the next save copies it and writes it again
            self._unchanged.forget(key)
        repaired = self._persister.scrubbed.get("repaired") if self._persister.scrub is not None else None
        if repaired:
            logger.warning(
                "step %d: %d reused blob(s) failed their hash (bit rot) and were written again from "
                "the live state: %s",
                snap.step,
                len(repaired),
                ", ".join(repaired[:5]),
            )
            self._journal_event({"event": "blob_repaired", "step": snap.step, "blobs": repaired[:100]})
        self._journal_event()  # what could not be written while the disk was full (if any)
        heartbeat.trouble("SAVE_FAILING", False)  # saves work again (smartckpt run's status line)
        for observer in self._observers:
            try:
                observer.on_commit(info)
            except Exception as err:  # the commit stands whatever an observer does
                logger.warning("after the commit of step %d: %s: %s", snap.step, type(observer).__name__, err)
        self._record.committed(info)
        self._news.put("commit")  # the loop asks its policy again at its next step
        self._schedule.committed(
            snap.step,
            snap_time,
            healthy=info.health == "ok",  # non-finite weights found while writing: not counted
            wait=snap.blocking_seconds + snap.guard_seconds,
            total=info.seconds,
        )
        try:
            self._retain()
        except Exception as err:  # the checkpoint is committed whatever retention does
            logger.warning("retention after step %d failed: %s", snap.step, err)
        return info

    def _save_failed(self, step: int, err: BaseException) -> str:
        """Record a failed save, whatever raised: ``failures`` (``close()`` returns them), one
        ``save_failed`` journal line with its cause, one log line per distinct cause (the rest
        at debug level), and the schedule moved back so the next trigger tries again."""
        msg = f"save of step {step} failed: {type(err).__name__}: {err}"
        if self._coord.world > 1 and peer_gone(err):
            # Another rank died while this save was being committed: the job ends with it, and
            # the checkpoint never existed. Said once; not a failed save (nothing to retry, no
            # journal line, no count).
            logger.warning(
                "the commit of step %d was interrupted: another rank went away (%s: %.200s)",
                step,
                type(err).__name__,
                err,
            )
            self._schedule.failed()
            report(commit_interrupted={"step": step, "error": f"{type(err).__name__}: {err}"[:300]})
            return msg
        cause = failure_cause(err)
        seen, count = self._record.failed(msg, cause)
        self._news.put("failure")
        self._schedule.failed()
        if seen == 0:
            logger.error("%s (training continues; the next trigger tries again)", msg)
        else:
            logger.debug("%s (the same cause, %d time(s) before)", msg, seen)
        # smartckpt run's status line: the flag at once (a mapping: it gets through a full disk),
        # the details when the report can be written.
        heartbeat.trouble("SAVE_FAILING", True)
        report(save_failures={"count": count, "last": msg[:300], "step": step})
        if self._coord.leads:  # one line per failed save, whichever rank failed
            self._journal_event(
                {"event": "save_failed", "step": step, "error": msg[:500], "cause": cause, "repeat": seen}
            )
        return msg

    def _journal_event(self, event: dict[str, Any] | None = None) -> None:
        """Append ``event`` (a failure, an I/O problem) to the journal after any that could not
        be written before (engine/saverecord.py's EventBacklog); never raises."""
        if event is not None:
            self._backlog.add(event)
        self._backlog.flush(self.store.journal)

    def _retain(self) -> None:
        leader = self._coord.collects_garbage()  # the lowest rank of every disk
        if not (leader or self._coord.leads):
            return  # nothing to do here: no journal read per rank per save (it grows with the ranks)
        state = self.store.journal.read()
        doomed = select_prunable(state.records, self.settings.keep_last)
        if doomed and self._coord.leads:  # one rank prunes the journal
            prune(self.store.storage, self.store.journal, doomed, why=f"keep_last={self.settings.keep_last}")
        pruned = sum(r.pruned for r in state.records)  # rank 0 may have pruned since the last look
        if leader and (doomed or pruned > self._pruned_seen):
            self._pruned_seen = pruned
            collect_garbage(self.store.storage, self.store.blobs, self.store.journal)

    def wait(self) -> CommitInfo | None:
        """Wait for the save in flight, if any; returns its CommitInfo (None if it failed)."""
        handle, self._inflight = self._inflight, None
        return handle.wait() if handle is not None else None
