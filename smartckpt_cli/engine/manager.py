"""CheckpointManager: the glue users touch.

Typical use::

    mgr = CheckpointManager("ckpt")
    mgr.register(model=model, optimizer=opt, scheduler=sched, data=loader)
    start = mgr.restore()
    for step in range(start, total):
        ...
        mgr.step(step + 1, loss=loss)
    mgr.close()

Threads: the training thread calls every method; it blocks only in ``take_snapshot`` (one copy
of the state into reusable staging buffers). A single background thread runs the persist of one
snapshot at a time (encoding fans out to a small worker pool), then retention. A background
failure never raises in the training thread: it is logged, counted, journalled, returned by
``step()`` and reported by ``close()``.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from smartckpt_cli.config import Settings, load_settings
from smartckpt_cli.engine import distributed, heartbeat
from smartckpt_cli.engine.cadence import StepClock
from smartckpt_cli.engine.multirank import load_part, persist_distributed, restore_distributed
from smartckpt_cli.engine.preempt import PreemptionWatch
from smartckpt_cli.engine.prestep import Boundary
from smartckpt_cli.engine.restore import Loaded, candidates, load_checkpoint
from smartckpt_cli.engine.snapshot import Stager, take_snapshot
from smartckpt_cli.engine.stepping import StepPath, StepResult
from smartckpt_cli.engine.writer import CommitInfo, Persister, base_meta
from smartckpt_cli.errors import (
    CheckpointCorrupt,
    NoCheckpointError,
    SmartckptError,
    StateMismatchError,
)
from smartckpt_cli.procutil import lower_priority
from smartckpt_cli.state.apply import apply_checkpoint
from smartckpt_cli.state.registry import KINDS, OPTIMIZER, RNG, adapt
from smartckpt_cli.state.rng import RNGState
from smartckpt_cli.store.directory import StoreDir, open_store
from smartckpt_cli.store.retention import GC_LOCK, collect_garbage, prune, select_prunable
from smartckpt_cli.store.storage.local import file_lock
from smartckpt_cli.trigger.cost import SaveCost
from smartckpt_cli.trigger.memory import MemoryProbe
from smartckpt_cli.trigger.policies import Decision, Policy, make_policy
from smartckpt_cli.trigger.reading import SignalReading
from smartckpt_cli.trigger.signals import Signals
from smartckpt_cli.trigger.trace import TraceWriter

__all__ = ["CheckpointManager", "SaveHandle", "StepResult"]

logger = logging.getLogger(__name__)

# Who is told as each CheckpointManager is built, and how many were: under `smartckpt run` the
# agent stands zero-code mode down when the script builds its own manager (two managers cannot
# write one store). The agent registers itself here; the engine never imports the agent.
_created: list[Callable[[Any], None]] = []
_built = 0


def on_manager_created(fn: Callable[[Any], None]) -> None:
    """Call ``fn(manager)`` for every CheckpointManager built from now on (once per ``fn``)."""
    if fn not in _created:
        _created.append(fn)


def managers_built() -> int:
    """How many CheckpointManagers this process has built."""
    return _built


def _announce(manager: Any) -> None:
    global _built
    _built += 1
    for fn in list(_created):
        fn(manager)


class SaveHandle:
    """A save in progress. ``wait()`` returns its :class:`CommitInfo` (None when it failed or
    was skipped); ``error`` holds the failure."""

    def __init__(self, step: int, future: Future[CommitInfo] | None, snapshot: Any = None) -> None:
        self.step = step
        self._future = future
        self._snapshot = snapshot
        self.blocking_seconds = 0.0  # time save() itself blocked the caller (the eager copies)
        self.lazy = bool(snapshot is not None and snapshot.lazy)

    @property
    def loop_wait_seconds(self) -> float:
        """What the training loop waited for this checkpoint: the eager part of the snapshot plus
        what the optimizer pre-hook waited for the lazy copies."""
        guard = self._snapshot.guard_seconds if self._snapshot is not None else 0.0
        return self.blocking_seconds + guard

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def wait(self, timeout: float | None = None) -> CommitInfo | None:
        if self._future is None:
            return None
        try:
            return self._future.result(timeout)
        except SmartckptError:
            return None
        except OSError:
            return None

    @property
    def error(self) -> BaseException | None:
        if self._future is None or not self._future.done():
            return None
        return self._future.exception()


@dataclass
class _Stats:
    failures: list[str] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    commits: int = 0


class CheckpointManager(StepPath):
    """Checkpoints registered objects into a store directory (see module docstring).

    Arguments left as ``None`` come from the settings: ``./smartckpt.yaml`` (or ``config``),
    then ``SMARTCKPT_*`` environment variables; explicit arguments win.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        meta_dir: str | os.PathLike[str] | None = None,
        keep_last: int | None = None,
        precision: str | None = None,
        policy: Policy | None = None,
        *,
        config: str | os.PathLike[str] | Settings | None = None,
        create: bool = True,
        **settings: Any,
    ) -> None:
        _announce(self)  # under `smartckpt run`, a user's manager turns zero-code mode off
        overrides = {
            "dir": os.fspath(directory) if directory is not None else None,
            "meta_dir": os.fspath(meta_dir) if meta_dir is not None else None,
            "keep_last": keep_last,
            "precision": precision,
            **settings,
        }
        if isinstance(config, Settings):
            self.settings = config
        else:
            self.settings, _ = load_settings(config, overrides)
        s = self.settings
        self.store: StoreDir = open_store(s.dir, s.meta_dir, create=create)
        self._lock = self.store.writer_lock()  # taken by the writing rank (rank 0) below
        # Several ranks: rank 0 holds the writer lock and the journal; the others follow it.
        self._comm = distributed.detect(s.distributed)
        self._rank = self._comm.rank if self._comm is not None else 0
        self._dir_id = distributed.dir_id(self.store.root) if self._comm is not None else ""
        self._dirs: list[str] = []  # every rank's disk id, learnt at the first save
        self._pruned_seen = 0
        self._remote: Any = None  # the remote tier (smartckpt_cli/remote/tier.py), when configured
        if s.remote and self._comm is not None:
            # Every rank has the same settings, so every rank refuses the same way.
            raise SmartckptError(
                "remote= with several ranks is not supported yet: each rank's part would need its "
                "own uploader; leave remote unset under torchrun"
            )
        opened: str | BaseException = ""
        if self._rank == 0:
            try:
                self._lock.acquire()
                if s.remote:
                    from smartckpt_cli.remote.tier import RemoteTier

                    self._remote = RemoteTier.open(s, self.store)
                opened = self.store.ensure_journal(self._remote and self._remote.adopted_store_id)
            except BaseException as err:
                # An unreadable journal must not leave this process holding the writer lock: a
                # retry would then be refused as "already being written by" this very process.
                self._lock.release()
                opened = err
        if self._comm is not None:
            shared = self._comm.broadcast(opened if isinstance(opened, str) else f"rank 0: {opened}")
            if not isinstance(opened, BaseException) and shared.startswith("rank 0: "):
                raise SmartckptError(shared)  # every rank fails the same way, none waits forever
            opened = shared if self._rank != 0 else opened
            distributed.guard_destroy(self)
        if isinstance(opened, BaseException):
            raise opened
        self.store_id = opened
        self.policy: Policy = policy or make_policy(s)
        # Whether the policy may save before the optimizer update: only then is a boundary
        # captured and, on CUDA, the pre-hook's reading waited for (a host sync).
        self._precursor = bool(getattr(self.policy, "precursor", hasattr(self.policy, "before_update")))
        self._signals = Signals(window=s.loss_window, eval_every=s.eval_every)
        self._memory = MemoryProbe()
        # The per-step fast path (module docstring of cadence.py): the policy is asked again only
        # at a reading, a pending wish or signal, after a commit, or from the step/time below.
        self._clock = StepClock()
        self._quiet: tuple[float, float] = (-math.inf, -math.inf)
        self._quiet_commits = -1
        self._wish: Decision | None = None  # a save asked for, waiting for a step that can take it
        self._eval_cost = 0.0  # host seconds of the evaluation in progress
        self._prepare = False  # prepare the staging buffers at the next step
        # Several ranks: the next agreed decision step, what the collective costs, and whether
        # this rank's memory needs a save (sent at the next decision step).
        self._point = 0
        self._decide_cost = 0.0
        self._urgent = False
        # The fast path of step(): nothing happens before this step and time (stepping.py).
        self._calm_step, self._calm_time, self._next_eval = -1, -math.inf, -1
        self._keep_from, self._record_until = 1 << 62, -1
        self._beating = False  # under `smartckpt run`: every step beats (heartbeat.beat_step)
        # Whether step() beats the heartbeat of `smartckpt run`; zero-code mode beats from its own
        # optimizer hook, one step ahead of the manager, and turns this off.
        self.heartbeat = True
        self._trace = TraceWriter(self.store.meta_root)
        self._preempt = PreemptionWatch(s.signal_names, usr_continue=s.usr_continue)
        self._last_step = 0
        self._last_loss: torch.Tensor | float | None = None
        self._last_reading: SignalReading | None = None
        # Evaluation in the optimizer pre-hook (one process): its reading waits for step(), and
        # a policy's save before the update needs the boundary states (prestep.py).
        self._boundary = Boundary()
        self._pre_reading: SignalReading | None = None
        self._pre_hooks = 0  # optimizer pre-hooks seen since the last step()
        self._pre_saved: tuple[SaveHandle, str] | None = None
        # Smoothed costs of recent saves, fed to the policy (trigger/cost.py).
        self._cost = SaveCost()
        self._objects: dict[str, tuple[str, Any]] = {"rng": ("rng", RNGState())}
        self._optimizers: list[Any] = []
        self._hooks: list[Any] = []
        self._lazy_snapshot: Any = None  # the snapshot whose deferred copies are still running
        self._stager = Stager()
        self._persister = Persister(
            self.store.storage,
            self.store.blobs,
            self.store.journal,
            self.store_id,
            level=s.compression_level,
            chunk_bytes=s.chunk_mb << 20,
            workers=s.n_workers,
            nice=s.background_nice,
        )
        self._saver = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="smartckpt-save",
            initializer=lower_priority,
            initargs=(s.background_nice,),
        )
        self._inflight: SaveHandle | None = None
        self._meta = base_meta()
        self._stats = _Stats()
        self._stats_lock = threading.Lock()
        # (step, monotonic time) of the newest committed checkpoint, and of the newest one taken
        # (committed or in flight): the trigger schedules from the latter, a failure reverts it.
        self._committed: tuple[int | None, float] = (None, time.monotonic())
        self._scheduled: tuple[int | None, float] = self._committed
        self._closed = False
        self.last_commit: CommitInfo | None = None
        self.last_restore: dict[str, Any] | None = None  # manifest of the restored checkpoint
        if self._remote is not None:
            self._remote.start(self.store_id, s.background_nice)

    # ------------------------------------------------------------------ setup

    def register(self, **objects: Any) -> None:
        """Register objects by name: modules, optimizers, schedulers, GradScalers, DataLoaders,
        or anything with ``state_dict``/``load_state_dict``. Call before ``restore``."""
        for name, obj in objects.items():
            self._add(name, obj, None)
        self._registered()

    def register_as(self, name: str, obj: Any, *, kind: str | None = None) -> None:
        """Register one object under ``name``, as :meth:`register` does, or, with ``kind`` (one of
        :data:`smartckpt_cli.state.registry.KINDS`), as that kind and as it is: a wrapper with
        ``state_dict``/``load_state_dict`` that keeps the kind of what it wraps (the checks made
        on restore and the tiers follow the kind). Zero-code mode registers its boundary records
        this way. The name ``"rng"`` takes only an object of kind ``"rng"`` (it replaces the
        process RNG state the manager registers itself). Registering a name again replaces what
        it named; an optimizer gets its step pre-hook once however often it is registered.
        :meth:`names` lists what is registered."""
        self._add(name, obj, kind)
        self._registered()

    def names(self) -> list[str]:
        """The registered names in registration order, ``"rng"`` (always there) first."""
        return list(self._objects)

    def _add(self, name: str, obj: Any, kind: str | None) -> None:
        if kind is not None and kind not in KINDS:
            raise ValueError(f"unknown kind {kind!r}: one of {', '.join(KINDS)}")
        if (name == RNG) != (kind == RNG) or "/" in name:
            raise ValueError(f"'{name}' cannot be used as a name ('rng' is reserved, no '/')")
        if kind is None:
            kind, obj = adapt(obj)
        self._objects[name] = (kind, obj)
        if kind == OPTIMIZER and all(o is not obj for o in self._optimizers):
            self._optimizers.append(obj)
            self._hooks.append(obj.register_step_pre_hook(self._before_optimizer_step))
            self._signals.watch(obj)

    def _registered(self) -> None:
        self._signals.arm(self._signals.due(self._last_step + 1))
        self._preempt.install()
        self._prepare = True  # at the first step, when the optimizer's moments exist
        self._uncalm()

    def install_signal_handlers(self) -> bool:
        """Install the preemption handlers again, on top of handlers a framework installed after
        ``register`` (Lightning does at fit start); the signal is still handed on to those after
        the blocking save, so their own SLURM requeue runs. False outside the main thread."""
        return self._preempt.reinstall()

    def remove_signal_handlers(self) -> None:
        """Take the preemption handlers off until :meth:`install_signal_handlers` (a framework that
        only installs its own where none is installed yet, as Lightning does, must see none)."""
        self._preempt.uninstall()

    def registered(self, name: str) -> Any:
        """The object registered under ``name`` as smartckpt sees it (a DataLoader comes back as
        its :class:`~smartckpt_cli.state.data.LoaderState`, with ``epochs`` and ``batches``)."""
        return self._objects[name][1]

    # ------------------------------------------------------------------ restore

    def restore(self, *, include_unhealthy: bool = False) -> int:
        """Load the newest committed checkpoint that verifies into the registered objects (in
        place, RNG included) and return its step; 0 when the store has none. A checkpoint whose
        L1 (or L3) fails verification is skipped for the previous one, with a warning saying why.
        A corrupt L2 does the same, unless ``on_l2_corrupt="reset"``: then L1 is restored and the
        optimizer moments start over, with a loud warning."""
        with heartbeat.heartbeat_state("RESTORING"):
            return self._restore(include_unhealthy)

    def _restore(self, include_unhealthy: bool) -> int:
        loaded = self.read(include_unhealthy=include_unhealthy)
        return self.apply(loaded) if loaded is not None else 0

    def read(self, *, include_unhealthy: bool = False) -> Loaded | None:
        """The newest committed checkpoint that verifies, loaded but not applied (None when the
        store has none). Integrations whose objects appear at different times (a Trainer builds
        its optimizer inside ``train()``) read once and :meth:`apply` piece by piece."""
        self.wait()
        state = self.store.journal.read()
        tried: list[str] = []
        reset = self.settings.on_l2_corrupt == "reset"
        if self._comm is not None:
            return self._restore_ranks(state, include_unhealthy, reset)

        def load(rec: Any) -> Any:
            return load_checkpoint(
                self.store.storage,
                self.store.blobs,
                rec,
                state.store_id,
                skip_corrupt_l2=reset,
                workers=self.settings.n_workers,
            )

        # With a remote tier: remote-only checkpoints too, and a failing local copy is repaired.
        order: list[Any] = (
            self._remote.order(state, include_unhealthy=include_unhealthy)
            if self._remote is not None
            else candidates(state.records, include_unhealthy=include_unhealthy)
        )
        for item in order:
            rec = item if self._remote is None else item.record
            mismatch = distributed.world_mismatch(rec.step, distributed.record_world(rec.event), 1)
            if mismatch is not None:
                raise StateMismatchError(mismatch)
            try:
                loaded = load(rec) if self._remote is None else self._remote.load(item, load)
            except CheckpointCorrupt as err:
                logger.warning(
                    "checkpoint of step %d is unusable (%s); falling back to the previous one", rec.step, err
                )
                tried.append(str(err))
                continue
            if "L2" in loaded.skipped_tiers:
                logger.warning(
                    "OPTIMIZER MOMENTS OF STEP %d ARE CORRUPT: restoring weights and hyperparameters "
                    "and re-initialising the optimizer state (on_l2_corrupt=reset)",
                    rec.step,
                )
            return loaded
        if tried:
            raise NoCheckpointError(
                f"no checkpoint in {self.store.root} verifies ({len(tried)} tried); newest problem: {tried[0]}"
            )
        return None

    def apply(self, loaded: Loaded, names: list[str] | None = None) -> int:
        """Load ``loaded`` (from :meth:`read`) into the registered objects, all of them or those
        ``names``; returns its step. The manager counts from that step on."""
        objects = self._objects if names is None else {n: self._objects[n] for n in names}
        apply_checkpoint(loaded, objects)
        if self.last_restore is not loaded.manifest:
            self._persister.remember(loaded.manifest)
            self.last_restore = loaded.manifest
            self._committed = self._scheduled = (loaded.record.step, time.monotonic())
            self._quiet, self._prepare = (-math.inf, -math.inf), True
            self._clock.skip()
            self._uncalm()
            logger.info("restored step %d from %s", loaded.record.step, loaded.record.manifest)
        return int(loaded.record.step)

    def _restore_ranks(self, state: Any, include_unhealthy: bool, reset: bool) -> Loaded | None:
        """Every rank loads the same step: the newest that verifies on all of them."""
        assert self._comm is not None
        comm = self._comm

        def load(rec: Any) -> Any:
            return load_part(
                self.store.storage,
                self.store.blobs,
                rec,
                self.store_id,
                comm.rank,
                self._dir_id,
                skip_corrupt_l2=reset,
                workers=self.settings.n_workers,
            )

        recs = candidates(state.records, include_unhealthy=include_unhealthy)
        try:
            loaded = restore_distributed(comm, recs, load)
        except CheckpointCorrupt as err:
            raise NoCheckpointError(f"{self.store.root}: {err}") from None
        return loaded

    # ------------------------------------------------------------------ saving

    def save(self, step: int, reason: str = "manual", blocking: bool = False) -> SaveHandle:
        """Save now, on the eager path: blocks for the whole snapshot copy (and for a save still in
        flight), so it is safe anywhere, also outside a training step. With ``blocking=True`` it
        also waits until the checkpoint is committed. (``step()`` takes the lazy path.)"""
        handle = self._save(step, Decision(True, reason), lazy=False)
        if blocking:
            with heartbeat.heartbeat_state("SAVING"):
                handle.wait()
        return handle

    def _preempted(self, step: int, signum: int, result: StepResult) -> StepResult:
        import signal as _signal

        name = _signal.Signals(signum).name
        logger.warning("%s received: taking a blocking checkpoint at step %d", name, step)
        with heartbeat.heartbeat_state("SAVING"):
            handle = self._save(step, Decision(True, f"preemption ({name})", calm=False), lazy=False)
            handle.wait()
            if self._remote is not None:  # the node may not come back: get it off the node first
                self._remote.drain(self.settings.remote_close_wait)
        self._trace.flush()
        result.saved, result.handle, result.reason = True, handle, f"preemption ({name})"
        self._preempt.finish(signum)  # exits through the signal unless told to continue
        return result

    def _loss_is_finite(self) -> bool:
        loss = self._last_loss
        if loss is None:
            return True
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)  # one sync per save
        return math.isfinite(value)

    def _save(
        self, step: int, decision: Decision, *, lazy: bool, objects: dict[str, tuple[str, Any]] | None = None
    ) -> SaveHandle:
        if self._closed:
            raise RuntimeError("CheckpointManager is closed")
        t0 = time.perf_counter()
        self.wait()  # one save in flight: its staging buffers are about to be refilled
        snap = take_snapshot(
            self._objects if objects is None else objects,
            stager=self._stager,
            step=step,
            reason=decision.reason,
            score=decision.score,
            precision=self.settings.precision,
            rules=self.settings.tiers,
            meta=self._meta,
            lazy_params=self._guarded_params() if lazy else None,
        )
        healthy = self._loss_is_finite()
        snap.health = "ok" if healthy else "nonfinite-loss"
        snap.calm = decision.calm and healthy
        snap.meta = {**snap.meta, "signals": _reading_meta(self._last_reading)}
        snap_time = time.monotonic()
        self._trace.flush()
        if healthy:
            self._scheduled = (step, snap_time)
        if snap.lazy:
            self._lazy_snapshot = snap
        # The schedule moved: ask the policy at the next step; that step's time is not a step's.
        self._quiet, self._wish = (-math.inf, -math.inf), None
        self._clock.skip()
        self._uncalm()
        future = self._saver.submit(self._persist, snap, snap_time)
        handle = SaveHandle(step, future, snap)
        handle.blocking_seconds = snap.blocking_seconds = time.perf_counter() - t0
        self._inflight = handle
        return handle

    def _guarded_params(self) -> set[int]:
        return {
            distributed.local_tensor(p).untyped_storage().data_ptr()
            for opt in self._optimizers
            for g in opt.param_groups
            for p in g["params"]
        }

    def _persist(self, snap: Any, snap_time: float) -> CommitInfo:
        try:
            if self._comm is not None:
                info, self._dirs = persist_distributed(
                    self._persister, snap, self._comm, self._dir_id, self.store.meta_root / GC_LOCK
                )
            else:
                with file_lock(self.store.meta_root / GC_LOCK, shared=True):
                    info = self._persister.persist(snap)
        except Exception as err:
            msg = f"save of step {snap.step} failed: {type(err).__name__}: {err}"
            logger.error("%s (training continues; the next trigger tries again)", msg)
            with self._stats_lock:
                self._stats.failures.append(msg)
                self._scheduled = self._committed
            try:
                if self._rank == 0:  # one line per failed save, whichever rank failed
                    self.store.journal.append({"event": "save_failed", "step": snap.step, "error": msg[:500]})
            except OSError:
                pass
            raise
        self.last_commit = info
        if self._remote is not None:
            self._remote.wake()
        with self._stats_lock:
            self._stats.commits += 1
            if info.health == "ok":
                self._committed = (snap.step, snap_time)
            else:  # non-finite weights found while writing: it does not count against the budget
                self._scheduled = self._committed
            self._cost.add(snap.blocking_seconds + snap.guard_seconds, info.seconds)
        try:
            self._retain()
        except (OSError, SmartckptError) as err:
            logger.warning("retention after step %d failed: %s", snap.step, err)
        return info

    def _retain(self) -> None:
        state = self.store.journal.read()
        doomed = select_prunable(state.records, self.settings.keep_last)
        if doomed and self._rank == 0:  # one rank prunes the journal
            prune(self.store.storage, self.store.journal, doomed, why=f"keep_last={self.settings.keep_last}")
        # The lowest rank of every disk collects that disk's garbage (node-local dirs included).
        leader = self._comm is None or self._rank in distributed.dir_leaders(self._dirs)
        pruned = sum(r.pruned for r in state.records)  # rank 0 may have pruned since the last look
        if leader and (doomed or pruned > self._pruned_seen):
            self._pruned_seen = pruned
            collect_garbage(self.store.storage, self.store.blobs, self.store.journal, self.store.meta_root)

    # ------------------------------------------------------------------ lifecycle

    def wait(self) -> CommitInfo | None:
        """Wait for the save in flight, if any; returns its CommitInfo (None if it failed)."""
        handle, self._inflight = self._inflight, None
        return handle.wait() if handle is not None else None

    @property
    def failures(self) -> list[str]:
        with self._stats_lock:
            return list(self._stats.failures)

    @property
    def skipped(self) -> list[int]:
        with self._stats_lock:
            return list(self._stats.skipped)

    def close(self) -> list[str]:
        """Wait for the save in flight, stop the background threads, release the store.
        Returns the failures of background saves (also logged)."""
        if self._closed:
            return self.failures
        heartbeat.last_step(self._last_step)  # step()'s fast path does not beat: the DONE beat needs it
        try:
            with heartbeat.heartbeat_state("SAVING"):
                self.wait()
                if self._remote is not None:
                    self._remote.close(self.settings.remote_close_wait)
        finally:
            self._closed = True
            self._saver.shutdown(wait=True)
            self._persister.close()
            self._trace.flush()
            self._memory.close()
            late = self._preempt.take()
            if late is None:
                self._preempt.uninstall()
            for hook in self._hooks:
                hook.remove()
            self._hooks.clear()
            self._signals.unwatch()
            self._lock.release()
        failures = self.failures
        if failures:
            logger.error(
                "%d background save(s) failed during this run; last: %s", len(failures), failures[-1]
            )
        if late is not None:
            # A signal after the last step (several ranks act on one at their next decision
            # step, up to a second later) is never swallowed: handed on as usual.
            logger.warning("a preemption signal arrived after the last step: no checkpoint was taken for it")
            self._preempt.finish(late)
        return failures

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def directory(self) -> Path:
        return self.store.root


def _reading_meta(r: SignalReading | None) -> dict[str, Any] | None:
    """The signals that led to a checkpoint, for its manifest."""
    if r is None:
        return None
    out = {"step": r.step, "loss": r.loss, "curvature": r.curvature, "grad_var": r.grad_var}
    if r.memory is not None:
        out["memory"] = r.memory
    return out
