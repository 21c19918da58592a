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

A facade: what it does is elsewhere. The per-step path is :mod:`.stepping`, the optimizer
pre-hook :mod:`.prehook`, where saves are staged :mod:`.staging`, the save path :mod:`.saving`
(its RAM tier's side :mod:`.ramsave`), the restore path :mod:`.restoring` (all mixins over this
class's state, set up here in one helper per part of ``__init__``); one process
or several ranks is one :class:`~.coordinator.Coordinator`; the remote tier is a commit observer
and a restore source (:mod:`.observers`); the single-writer lock is the store's
(:class:`~smartckpt_cli.store.directory.WriterLock`); the save-cost average is the trigger's
(:class:`~smartckpt_cli.trigger.cost.SaveCost`, kept behind a lock by :mod:`.schedule`).
"""

from __future__ import annotations

import logging
import math
import os
import queue
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from smartckpt_cli.config import Settings, load_settings
from smartckpt_cli.engine import heartbeat
from smartckpt_cli.engine.cadence import StepClock
from smartckpt_cli.engine.calm import CalmPath
from smartckpt_cli.engine.coordinator import make_coordinator
from smartckpt_cli.engine.handover import HandOverPath
from smartckpt_cli.engine.observers import CheckpointSource, CommitObserver, LocalSource, open_tiers
from smartckpt_cli.engine.pager import Pager
from smartckpt_cli.engine.preempt import PreemptionWatch
from smartckpt_cli.engine.prehook import PreHookPath
from smartckpt_cli.engine.prestep import Boundary
from smartckpt_cli.engine.ramsave import RamSavePath
from smartckpt_cli.engine.ramtier import RamTier
from smartckpt_cli.engine.report import report
from smartckpt_cli.engine.restoring import RestorePath
from smartckpt_cli.engine.resumecheck import ResumeCheck
from smartckpt_cli.engine.runmeta import base_meta
from smartckpt_cli.engine.saverecord import EventBacklog, SaveRecord
from smartckpt_cli.engine.saving import SaveHandle, SavePath
from smartckpt_cli.engine.schedule import SaveSchedule
from smartckpt_cli.engine.snapshot import Stager
from smartckpt_cli.engine.staging import StagingPrep
from smartckpt_cli.engine.stepping import StepPath, StepResult
from smartckpt_cli.engine.unchanged import Unchanged
from smartckpt_cli.engine.writer import Persister
from smartckpt_cli.procutil import lower_priority
from smartckpt_cli.state.registry import KINDS, OPTIMIZER, RNG, adapt
from smartckpt_cli.state.rng import RNGState
from smartckpt_cli.state.wrappers import ACCELERATOR, accelerator_of
from smartckpt_cli.store.directory import StoreDir, open_store
from smartckpt_cli.store.scrub import Scrubber, ScrubBook
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


class CheckpointManager(
    StepPath, CalmPath, PreHookPath, StagingPrep, SavePath, HandOverPath, RamSavePath, RestorePath
):
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
        # In this order: the store is open (and, on rank 0, locked) before anything writes to it,
        # and the RAM tier is named after the store's id.
        self._open_store(s, create)
        self._init_trigger(s, policy)
        self._init_step_state(s)
        self._init_save_path(s)
        self._init_restore_state()
        for observer in self._observers:
            observer.on_start(self.store_id)

    def _open_store(self, s: Settings, create: bool) -> None:
        self.store: StoreDir = open_store(s.dir, s.meta_dir, create=create)
        self._lock = self.store.writer_lock()
        # One process or several ranks (coordinator.py): the leader (rank 0) holds the writer
        # lock and the journal, the others follow it. Restores look in the local store, or in
        # the remote tier too, which also hears of every commit (observers.py).
        self._coord = make_coordinator(s.distributed, self.store.root, s.rank_timeout)
        self._source: CheckpointSource = LocalSource()
        self._observers: list[CommitObserver] = []
        self._pruned_seen = 0

        def open_as_writer() -> str:
            self._lock.acquire()
            try:
                self.store.refuse_unsafe_layout()  # a folder symlinked outside: never written to
                self._source, self._observers = open_tiers(s, self.store, 0, self._coord.world)
                return self.store.ensure_journal(self._source.adopted_store_id)
            except BaseException:
                # An unreadable journal must not leave this process holding the writer lock: a
                # retry would then be refused as "already being written by" this very process.
                self._lock.release()
                raise

        self.store_id = self._coord.open(open_as_writer, self)
        if self._coord.world > 1:  # which rank this process is (launchers do not all set RANK)
            report(rank=self._coord.rank)
        if not self._coord.leads:  # several ranks: every rank ships and fetches its own part
            self._source, self._observers = open_tiers(s, self.store, self._coord.rank, self._coord.world)

    def _init_trigger(self, s: Settings, policy: Policy | None) -> None:
        """The trigger's side: the policy, its signals and when it need be asked again."""
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
        self._news: queue.SimpleQueue[str] = queue.SimpleQueue()  # "commit"/"failure" from the save thread
        self._commits_seen = 0  # commits the loop took from _news (off the fast path: _take_news)
        self._failures_seen: tuple[int, str | None] = (0, None)  # the failures' count and the newest
        self._wish: Decision | None = None  # a save asked for, waiting for a step that can take it
        self._eval_cost = 0.0  # host seconds of the evaluation in progress
        self._prepare = False  # prepare the staging buffers at the next step

    def _init_step_state(self, s: Settings) -> None:
        """What step() and the optimizer pre-hook keep from one step to the next (training thread)."""
        # The fast path of step(): nothing happens before this step and time (stepping.py).
        self._calm_step, self._calm_time, self._next_eval = -1, -math.inf, -1
        self._keep_from, self._record_until = 1 << 62, -1
        self._beating = False  # under `smartckpt run`: every step beats (heartbeat.beat_step)
        # Whether step() beats the heartbeat of `smartckpt run`; zero-code mode beats from its own
        # optimizer hook, one step ahead of the manager, and turns this off.
        self.heartbeat = True
        self._trace = TraceWriter(
            self.store.meta_root,
            on_error=lambda err: self._io_event("trace", err),
            on_recovered=lambda: self._io_event("trace", None),
        )
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
        self._precursor_refused: set[str] = set()

    def _init_save_path(self, s: Settings) -> None:
        """The registered objects and what a save runs through: staging, the RAM tier, the
        writer and the save thread, and what the save thread tells the training thread."""
        self._objects: dict[str, tuple[str, Any]] = {RNG: (RNG, RNGState())}
        self._optimizers: list[Any] = []
        self._hooks: list[Any] = []
        self._lazy_snapshot: Any = None  # the snapshot whose deferred copies are still running
        self._stager = Stager()
        # memory_budget (engine/budget.py): a save in pieces through one buffer, or None
        self._pager: Pager | None = None
        self._budgeted, self._budget_line = False, None  # planned for the state; its line, said once
        # What the next save need not copy: unchanged since the last commit (unchanged.py).
        self._unchanged = Unchanged(rotation=s.reverify_saves)
        # Under smartckpt run: the RAM tier, staging in shared memory that outlives this process
        # (ramtier.py); RAM snapshots are due from this monotonic time on.
        self._ram = RamTier.open(s, self.store_id, self._coord.rank, self._coord.world)
        self._ram_due = math.inf
        self._first_step_report = False  # report the first step after a restore (smartckpt run)
        self._read_began = 0.0  # when the last read() began (wall time)
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
        self._persister.scrub = Scrubber(ScrubBook(self.store.meta, self._coord.rank))
        self._saver = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="smartckpt-save",
            initializer=lower_priority,
            initargs=(s.background_nice,),
        )
        self._inflight: SaveHandle | None = None
        self._meta = base_meta()
        self._record = SaveRecord()  # commits, failures, skipped steps, the newest commit
        self._backlog = EventBacklog()  # journal events that wait for a disk
        # The newest committed checkpoint, the newest taken (committed or in flight: the trigger
        # schedules from it, a failure reverts it) and the saves' cost, behind one lock.
        self._schedule = SaveSchedule(time.monotonic())
        self._closed = False

    def _init_restore_state(self) -> None:
        """What the last restore left: its manifest, its limits, the lineage, the resume check."""
        self.last_restore: dict[str, Any] | None = None  # manifest of the restored checkpoint
        # Why the steps after the last restore may not be bit-exact with an uninterrupted run
        # (one line each, also logged; ddp_layout.py); empty when nothing is known to differ.
        self.resume_limits: list[str] = []
        # Checkpoints continue the lineage of the one restored; a manager that restored nothing
        # starts a new one, so a run that began again at step 0 never passes for the
        # continuation of the checkpoints before it (inspect tells them apart, restore never
        # falls back from one into another).
        self.lineage: str | None = uuid.uuid4().hex[:12]
        self._restored_from: str | None = None  # "ram" | "disk" | "remote": where the last read came from
        # The resume check (resumecheck.py): armed for the step after a save or a restore; zero-
        # code mode hands the loss of the step being updated (``update_begins``) before step().
        self._check = ResumeCheck()
        self._ahead: tuple[int, Any, Any, Any] | None = None  # (step, loss, scale, optimizer)

    # ------------------------------------------------------------------ setup

    def register(self, **objects: Any) -> None:
        """Register objects by name: modules, optimizers, schedulers, GradScalers, DataLoaders,
        or anything with ``state_dict``/``load_state_dict``. Call before ``restore``. What
        ``accelerate`` prepared is seen through (state/wrappers.py), and its Accelerator's
        gradient-accumulation counter is registered with it (``accelerator``)."""
        for name, obj in objects.items():
            self._add(name, obj, None)
        acc = accelerator_of(list(objects.values()))
        if acc is not None and ACCELERATOR not in self._objects:
            self._add(ACCELERATOR, acc, None)
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

    # ------------------------------------------------------------------ lifecycle

    @property
    def failures(self) -> list[str]:
        return self._record.failures()

    @property
    def skipped(self) -> list[int]:
        return self._record.skipped()

    def _io_event(self, what: str, err: OSError | None) -> None:
        """A write on the loop's path (the trace) that failed, or works again: one journal line
        each, when the journal can be written (the log has it either way); never raises."""
        event: dict[str, Any] = {"event": "io_error" if err else "io_ok", "what": what}
        if err is not None:
            event["error"] = f"{type(err).__name__}: {err}"[:300]
        heartbeat.trouble("IO_FAILING", err is not None)
        report(io_error={"what": what, "error": event["error"]} if err is not None else None)
        if self._coord.leads:
            self._journal_event(event)

    def record_event(self, event: dict[str, Any]) -> None:
        """An event of the training into the journal (kept until the journal can take it, never
        raises): zero-code mode says there why it turned itself off."""
        self._journal_event(dict(event))

    def close(self) -> list[str]:
        """Wait for the save in flight, stop the background threads, release the store.
        Returns the failures of background saves (also logged)."""
        if self._closed:
            return self.failures
        heartbeat.last_step(self._last_step)  # step()'s fast path does not beat: the DONE beat needs it
        try:
            with heartbeat.heartbeat_state("SAVING"):
                self.wait()
                self._journal_event()  # failures the journal could not take when they happened
                for observer in self._observers:
                    observer.on_close()
        finally:
            self._closed = True
            self._saver.shutdown(wait=True)
            self._persister.close()
            if self._ram is not None:
                self._ram.close()
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
