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

A facade: what it does is elsewhere. The per-step path and the optimizer pre-hook are
:mod:`.stepping`, the save path :mod:`.saving` (both mixins over this class's state); one process
or several ranks is one :class:`~.coordinator.Coordinator`; the remote tier is a commit observer
and a restore source (:mod:`.observers`); the single-writer lock is the store's
(:class:`~smartckpt_cli.store.directory.WriterLock`); the save-cost average is the trigger's
(:class:`~smartckpt_cli.trigger.cost.SaveCost`, kept behind a lock by :mod:`.schedule`).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from smartckpt_cli.config import Settings, load_settings
from smartckpt_cli.engine import ddp_layout, heartbeat
from smartckpt_cli.engine.cadence import StepClock
from smartckpt_cli.engine.coordinator import make_coordinator
from smartckpt_cli.engine.observers import CheckpointSource, CommitObserver, LocalSource, open_tiers
from smartckpt_cli.engine.pager import Pager
from smartckpt_cli.engine.preempt import PreemptionWatch
from smartckpt_cli.engine.prestep import Boundary
from smartckpt_cli.engine.ramtier import ENV_AREA, RamTier
from smartckpt_cli.engine.report import report
from smartckpt_cli.engine.restore import Loaded, same_lineage
from smartckpt_cli.engine.resumecheck import ResumeCheck, expected_of, tolerance
from smartckpt_cli.engine.runmeta import base_meta
from smartckpt_cli.engine.saving import SaveHandle, SavePath, SaveStats
from smartckpt_cli.engine.schedule import SaveSchedule
from smartckpt_cli.engine.snapshot import Stager
from smartckpt_cli.engine.stepping import StepPath, StepResult
from smartckpt_cli.engine.unchanged import Unchanged
from smartckpt_cli.engine.writer import CommitInfo, Persister
from smartckpt_cli.errors import NoCheckpointError
from smartckpt_cli.procutil import lower_priority
from smartckpt_cli.state.apply import apply_checkpoint
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


class CheckpointManager(StepPath, SavePath):
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
        # Smoothed costs of recent saves, fed to the policy (trigger/cost.py).
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
        self._stats = SaveStats()
        self._stats_lock = threading.Lock()
        self._unjournalled: list[dict[str, Any]] = []  # events the journal could not take yet
        # The newest committed checkpoint, the newest taken (committed or in flight: the trigger
        # schedules from it, a failure reverts it) and the saves' cost, behind one lock.
        self._schedule = SaveSchedule(time.monotonic())
        self._closed = False
        self.last_commit: CommitInfo | None = None
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
        for observer in self._observers:
            observer.on_start(self.store_id)

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

    def read(self, *, include_unhealthy: bool = False) -> Loaded | None:
        """The newest committed checkpoint that verifies, loaded but not applied (None when the
        store has none). Integrations whose objects appear at different times (a Trainer builds
        its optimizer inside ``train()``) read once and :meth:`apply` piece by piece."""
        self.wait()
        self._read_began = time.time()
        state = self.store.journal.read()
        reset = self.settings.on_l2_corrupt == "reset"
        # The RAM tier first (no decode): its snapshot when it is as new as the disk's newest
        # and every chunk verifies (on every rank), else the disk, then the remote, as before.
        every = self._source.order(state, include_unhealthy=include_unhealthy)
        loaded_ram = self._read_ram(every[0].record.step if every else -1, include_unhealthy)
        if loaded_ram is not None:
            self._restored_from = "ram"
            return loaded_ram

        def read_part(rec: Any) -> Loaded:
            return self._coord.load(
                self.store, rec, state.store_id, skip_corrupt_l2=reset, workers=self.settings.n_workers
            )

        # The newest candidate that verifies (several ranks: on every rank); a local copy that
        # fails is repaired from the remote tier when there is one. Only the newest lineage:
        # falling back into an older one would resume another run's training as if it were this.
        order = same_lineage(every)
        where: dict[str, str] = {}

        def load(cand: Any) -> Loaded:
            got = self._source.load(cand, read_part)
            where[got.record.id] = "remote" if getattr(cand, "where", "local") == "remote" else "disk"
            return got

        try:
            loaded = self._coord.restore(order, load, self.store.root)
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
        else:
            self._restored_from = where.get(loaded.record.id, "disk")
        return loaded

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

    # ------------------------------------------------------------------ lifecycle

    @property
    def failures(self) -> list[str]:
        with self._stats_lock:
            return list(self._stats.failures)

    @property
    def skipped(self) -> list[int]:
        with self._stats_lock:
            return list(self._stats.skipped)

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
                if self._unjournalled:
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
