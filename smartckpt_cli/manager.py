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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from smartckpt_cli.apply import apply_checkpoint
from smartckpt_cli.config import Settings, load_settings
from smartckpt_cli.errors import (
    CheckpointCorrupt,
    NoCheckpointError,
    SmartckptError,
    StoreLockedError,
)
from smartckpt_cli.registry import adapt
from smartckpt_cli.restore import candidates, load_checkpoint
from smartckpt_cli.retention import GC_LOCK, collect_garbage, prune, select_prunable
from smartckpt_cli.rng import RNGState
from smartckpt_cli.snapshot import Stager, take_snapshot
from smartckpt_cli.storage.local import file_lock
from smartckpt_cli.store_dir import StoreDir, open_store
from smartckpt_cli.trigger import IntervalPolicy, Policy, TriggerContext
from smartckpt_cli.writer import CommitInfo, Persister, base_meta

__all__ = ["CheckpointManager", "SaveHandle", "StepResult"]

logger = logging.getLogger(__name__)

WRITER_LOCK = "writer.lock"


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
class StepResult:
    saved: bool = False
    reason: str = ""
    handle: SaveHandle | None = None
    failures: int = 0  # background saves that failed so far
    last_error: str | None = None


@dataclass
class _Stats:
    failures: list[str] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    commits: int = 0


class CheckpointManager:
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
        self._lock_fd: int | None = None
        self._acquire_writer_lock()
        try:
            self.store_id = self.store.ensure_journal()
        except BaseException:
            # An unreadable journal must not leave this process holding the writer lock: a
            # retry would then be refused as "already being written by" this very process.
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None
            raise
        self.policy: Policy = policy or IntervalPolicy(
            s.every_steps, s.every_seconds, s.max_interval, s.max_interval_steps
        )
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
        )
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="smartckpt-save")
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

    # ------------------------------------------------------------------ setup

    def _acquire_writer_lock(self) -> None:
        import fcntl

        path = self.store.meta_root / WRITER_LOCK
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise StoreLockedError(
                f"checkpoint store {self.store.root} is already being written by {holder}; "
                "use another directory or stop that run"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}".encode(), 0)
        self._lock_fd = fd

    def register(self, **objects: Any) -> None:
        """Register objects by name: modules, optimizers, schedulers, GradScalers, DataLoaders,
        or anything with ``state_dict``/``load_state_dict``. Call before ``restore``."""
        for name, obj in objects.items():
            if name == "rng" or "/" in name:
                raise ValueError(f"'{name}' cannot be used as a name ('rng' is reserved, no '/')")
            kind, adapted = adapt(obj)
            self._objects[name] = (kind, adapted)
            if kind == "optimizer" and all(o is not obj for o in self._optimizers):
                self._optimizers.append(obj)
                # The lazy snapshot's guard: parameters and moments may only change once copied.
                self._hooks.append(obj.register_step_pre_hook(self._before_optimizer_step))

    def _before_optimizer_step(self, *_: Any) -> None:
        snap = self._lazy_snapshot
        if snap is not None:
            snap.guard()
            if snap.copied.is_set():
                self._lazy_snapshot = None

    def registered(self, name: str) -> Any:
        """The object registered under ``name`` as smartckpt sees it (a DataLoader comes back as
        its :class:`~smartckpt_cli.data.LoaderState`, with ``epochs`` and ``batches``)."""
        return self._objects[name][1]

    # ------------------------------------------------------------------ restore

    def restore(self, *, include_unhealthy: bool = False) -> int:
        """Load the newest committed checkpoint that verifies into the registered objects (in
        place, RNG included) and return its step; 0 when the store has none. A checkpoint whose
        L1 (or L3) fails verification is skipped for the previous one, with a warning saying why.
        A corrupt L2 does the same, unless ``on_l2_corrupt="reset"``: then L1 is restored and the
        optimizer moments start over, with a loud warning."""
        self.wait()
        state = self.store.journal.read()
        tried: list[str] = []
        reset = self.settings.on_l2_corrupt == "reset"
        for rec in candidates(state.records, include_unhealthy=include_unhealthy):
            try:
                loaded = load_checkpoint(
                    self.store.storage,
                    self.store.blobs,
                    rec,
                    state.store_id,
                    skip_corrupt_l2=reset,
                    workers=self.settings.n_workers,
                )
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
            apply_checkpoint(loaded, self._objects)
            self._persister.remember(loaded.manifest)
            self.last_restore = loaded.manifest
            self._committed = self._scheduled = (rec.step, time.monotonic())
            logger.info("restored step %d from %s", rec.step, rec.manifest)
            return rec.step
        if tried:
            raise NoCheckpointError(
                f"no checkpoint in {self.store.root} verifies ({len(tried)} tried); newest problem: {tried[0]}"
            )
        return 0

    # ------------------------------------------------------------------ saving

    def step(self, step: int, loss: torch.Tensor | float | None = None) -> StepResult:
        """Tell the manager a training step finished; it saves when the policy says so."""
        loss_value = None
        if loss is not None:
            loss_value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        ctx = TriggerContext(step, time.monotonic(), *self._scheduled, loss_value)
        decision = self.policy.should_save(ctx)
        result = StepResult()
        if decision.save:
            if self._inflight is not None and not self._inflight.done() and self.settings.inflight == "skip":
                with self._stats_lock:
                    self._stats.skipped.append(step)
                logger.info("step %d: save skipped, the previous one is still being written", step)
            else:
                healthy = loss_value is None or math.isfinite(loss_value)
                result.handle = self._save(
                    step, decision.reason, decision.score, healthy=healthy, lazy=bool(self._optimizers)
                )
                result.saved = True
                result.reason = decision.reason
        with self._stats_lock:
            result.failures = len(self._stats.failures)
            result.last_error = self._stats.failures[-1] if self._stats.failures else None
        return result

    def save(self, step: int, reason: str = "manual", blocking: bool = False) -> SaveHandle:
        """Save now, on the eager path: blocks for the whole snapshot copy (and for a save still in
        flight), so it is safe anywhere, also outside a training step. With ``blocking=True`` it
        also waits until the checkpoint is committed. (``step()`` takes the lazy path.)"""
        handle = self._save(step, reason, None, healthy=True, lazy=False)
        if blocking:
            handle.wait()
        return handle

    def _save(self, step: int, reason: str, score: float | None, *, healthy: bool, lazy: bool) -> SaveHandle:
        if self._closed:
            raise RuntimeError("CheckpointManager is closed")
        t0 = time.perf_counter()
        self.wait()  # one save in flight: its staging buffers are about to be refilled
        snap = take_snapshot(
            self._objects,
            stager=self._stager,
            step=step,
            reason=reason,
            score=score,
            precision=self.settings.precision,
            rules=self.settings.tiers,
            meta=self._meta,
            lazy_params=self._guarded_params() if lazy else None,
        )
        snap.health = "ok" if healthy else "nonfinite-loss"
        snap_time = time.monotonic()
        if healthy:
            self._scheduled = (step, snap_time)
        if snap.lazy:
            self._lazy_snapshot = snap
        future = self._saver.submit(self._persist, snap, snap_time)
        handle = SaveHandle(step, future, snap)
        handle.blocking_seconds = time.perf_counter() - t0
        self._inflight = handle
        return handle

    def _guarded_params(self) -> set[int]:
        return {
            p.untyped_storage().data_ptr()
            for opt in self._optimizers
            for g in opt.param_groups
            for p in g["params"]
        }

    def _persist(self, snap: Any, snap_time: float) -> CommitInfo:
        try:
            with file_lock(self.store.meta_root / GC_LOCK, shared=True):
                info = self._persister.persist(snap)
        except Exception as err:
            msg = f"save of step {snap.step} failed: {type(err).__name__}: {err}"
            logger.error("%s (training continues; the next trigger tries again)", msg)
            with self._stats_lock:
                self._stats.failures.append(msg)
                self._scheduled = self._committed
            try:
                self.store.journal.append({"event": "save_failed", "step": snap.step, "error": msg[:500]})
            except OSError:
                pass
            raise
        self.last_commit = info
        with self._stats_lock:
            self._stats.commits += 1
            if snap.health == "ok":
                self._committed = (snap.step, snap_time)
        try:
            self._retain()
        except (OSError, SmartckptError) as err:
            logger.warning("retention after step %d failed: %s", snap.step, err)
        return info

    def _retain(self) -> None:
        state = self.store.journal.read()
        doomed = select_prunable(state.records, self.settings.keep_last)
        if doomed:
            prune(self.store.storage, self.store.journal, doomed, why=f"keep_last={self.settings.keep_last}")
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
        try:
            self.wait()
        finally:
            self._closed = True
            self._saver.shutdown(wait=True)
            self._persister.close()
            for hook in self._hooks:
                hook.remove()
            self._hooks.clear()
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None
        failures = self.failures
        if failures:
            logger.error(
                "%d background save(s) failed during this run; last: %s", len(failures), failures[-1]
            )
        return failures

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def directory(self) -> Path:
        return self.store.root
