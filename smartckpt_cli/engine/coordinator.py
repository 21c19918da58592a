"""One process or several ranks, behind one interface: the manager and its step path call a
:class:`Coordinator` and never ask how many ranks there are.

As in torch.distributed.checkpoint, one process is the trivial case (:class:`SingleProcess`);
:class:`Ranks` carries out the same calls over the training's ``torch.distributed`` world (the
collectives are in :mod:`.distributed`, the two-phase commit and the restore agreement in
:mod:`.multirank`). Every rank has its own store directory view (shared or node-local disks: a
disk id tells them apart, see :func:`.distributed.dir_id`). With ``distributed: off`` every rank
of a multi-rank job is a :class:`SingleProcess` of its own (each then needs its own store); there
is no other mode.

Order of calls, and who makes them (every rank makes every call, in the same order, unless it
says otherwise; the collectives of several ranks would hang otherwise):

1. ``make_coordinator(settings, root)`` (all ranks, training thread) in the manager's
   ``__init__``;
2. ``open(open_store, owner)`` (all ranks): the *leader* (rank 0) runs ``open_store`` (writer
   lock, journal) and every rank gets its store id, or the same error;
3. per step (training thread): ``agree_to_save(proposal)`` at every step the step path looks at
   (``step >= next_point`` among them); several ranks run their one small collective there, only
   at the agreed *decision steps*, so every rank reaches it at the same step. It returns the save
   every rank takes, and the preemption signal any rank received: a signal on one rank makes
   every rank take the blocking save. One process answers at once. ``hooks_may_save``: whether
   the evaluation and a save before the update may run in the optimizer pre-hook (one process
   only: no collective may run in a hook);
4. per save (background save thread, all ranks): ``persist(persister, snap, hold_gc)`` (``hold_gc()``: the store's ``gc.lock``, shared, for the whole save), then
   ``leads`` (the leader prunes the journal and journals a failed save) and
   ``collects_garbage()`` (the lowest rank of each disk);
5. restore (training thread, all ranks), plain calls that return what the manager's ``read``
   does next (engine/restoring.py): ``restore_order(candidates)`` the candidates every rank tries,
   in rank 0's order; for each, ``load(store, record, ...)`` reads this rank's part and
   ``settle(step, failure)`` answers with every rank's outcome (None: every rank loaded it, apply
   it; else the problem for which every rank falls back to the next); ``nothing_loads(tried,
   where)`` is the error when none did. ``agree_on(value)`` before them: the RAM tier's snapshot.
   ``restore(order, load, where)`` makes the same calls for a caller that has a loader.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from smartckpt_cli import errors
from smartckpt_cli._faults import fault_fail
from smartckpt_cli.engine import distributed
from smartckpt_cli.engine.cadence import decide_gap
from smartckpt_cli.engine.multirank import load_part, persist_distributed, restore_order, settle_restore
from smartckpt_cli.engine.reshard import load_resharded
from smartckpt_cli.engine.restore import Loaded, load_checkpoint, warn_moments_reset
from smartckpt_cli.engine.snapshot import Snapshot
from smartckpt_cli.engine.writer import CommitInfo, Persister
from smartckpt_cli.errors import CheckpointCorrupt, NoCheckpointError, SmartckptError
from smartckpt_cli.remote.fetch import Candidate
from smartckpt_cli.store.directory import StoreDir
from smartckpt_cli.store.journal import CheckpointRecord
from smartckpt_cli.trigger.policies import Decision

# Holds the store's gc.lock shared while a save writes, so garbage collection never takes its
# blobs for garbage (store/retention.py).
GcHold = Callable[[], AbstractContextManager[Any]]

__all__ = [
    "NO",
    "Coordinator",
    "Proposal",
    "Ranks",
    "SingleProcess",
    "Verdict",
    "make_coordinator",
    "restore_with",
]

logger = logging.getLogger(__name__)

NO = Decision(False)  # no save


@dataclass(frozen=True, slots=True)
class Proposal:
    """What this rank brings to a step's agreement (made at the steps the step path looks at)."""

    step: int
    decision: Decision  # this rank's policy answer (a pending wish included)
    wish: Decision | None  # a save asked for earlier, not taken yet
    can_save: bool  # this rank can snapshot this step (zero-code mode records the boundary)
    busy: bool  # a save is still being written and ``inflight="skip"``
    signal: int | None  # a preemption signal this rank received and has not acted on
    step_seconds: float = 0.0  # the step time (spacing of the decision steps)
    quiet_step: float = math.inf  # the policy's next step of interest
    spacing: int = 0  # this rank's own evaluation spacing
    ram: bool = False  # a RAM snapshot is due by this rank's clock (rank 0's decides for all)


@dataclass(frozen=True, slots=True)
class Verdict:
    """What every rank does at this step."""

    decision: Decision  # the save every rank takes (``save=False``: none)
    signum: int | None  # a preemption signal: every rank takes the blocking save and hands it on
    wish: Decision | None  # the wish that stays pending
    skipped: bool = False  # a save was asked for while the previous one is still being written
    spacing: int | None = None  # the agreed evaluation spacing (``agreed``: from this step on)
    agreed: bool = False  # the ranks agreed at this step (``spacing`` holds)
    ram: bool = False  # take a RAM snapshot alone at this step (no checkpoint is taken)


@runtime_checkable
class Coordinator(Protocol):
    """One process or several ranks (module docstring: the order of calls and who makes them)."""

    rank: int
    world: int
    hooks_may_save: bool

    @property
    def leads(self) -> bool:
        """This rank writes the journal (rank 0)."""
        ...

    @property
    def next_point(self) -> float:
        """The next step at which :meth:`agree_to_save` must be called (inf: whenever)."""
        ...

    def open(self, open_store: Callable[[], str], owner: Any) -> str: ...

    def agree_to_save(self, p: Proposal) -> Verdict: ...

    def persist(self, persister: Persister, snap: Snapshot, hold_gc: GcHold) -> CommitInfo: ...

    def collects_garbage(self) -> bool: ...

    def load(
        self,
        store: StoreDir,
        record: CheckpointRecord,
        store_id: str | None,
        *,
        skip_corrupt_l2: bool,
        workers: int,
    ) -> Loaded: ...

    def restore_order(self, order: Sequence[Candidate]) -> list[Candidate | None]:
        """The candidates (newest first, each with a ``.record``) every rank tries, in rank 0's
        order; None where rank 0's candidate is not in this rank's view of the journal."""
        ...

    def settle(self, step: int | None, failure: BaseException | None) -> str | None:
        """Every rank's outcome on the candidate of ``step`` each has just tried to load
        (``failure``: this rank's, None when it loaded): None when every rank loaded it, else the
        problem for which every rank falls back to the next one. Raises what no fallback cures."""
        ...

    def nothing_loads(self, tried: list[str], where: Path) -> NoCheckpointError:
        """The error when none of the candidates loaded (``tried``: their problems, newest first)."""
        ...

    def agree_on(self, value: Any) -> bool:
        """Whether every rank holds the same ``value``, and not None (the RAM tier's restore:
        every rank verified a RAM snapshot of the same step)."""
        ...


class SingleProcess:
    """One process: every call answers at once, no collective."""

    rank = 0
    world = 1
    hooks_may_save = True
    leads = True
    next_point = math.inf

    def open(self, open_store: Callable[[], str], owner: Any) -> str:
        return open_store()

    def agree_to_save(self, p: Proposal) -> Verdict:
        v = self._agree(p)
        if p.ram and p.can_save and not v.decision.save and v.signum is None:
            return replace(v, ram=True)
        return v

    def _agree(self, p: Proposal) -> Verdict:
        signum = p.signal if p.can_save else None
        if p.decision.save and not p.can_save:
            return Verdict(NO, signum, p.decision)  # taken at the next step that can
        if p.decision.save and p.busy:
            logger.info("step %d: save skipped, the previous one is still being written", p.step)
            return Verdict(NO, signum, None, skipped=True)
        return Verdict(p.decision, signum, p.wish)

    def persist(self, persister: Persister, snap: Snapshot, hold_gc: GcHold) -> CommitInfo:
        with hold_gc():
            return persister.persist(snap)

    def collects_garbage(self) -> bool:
        return True

    def load(
        self,
        store: StoreDir,
        record: CheckpointRecord,
        store_id: str | None,
        *,
        skip_corrupt_l2: bool,
        workers: int,
    ) -> Loaded:
        if distributed.needs_reshard(record, 1):
            return _resharded(store, record, store_id, 0, 1, skip_corrupt_l2)
        return load_checkpoint(
            store.storage, store.blobs, record, store_id, skip_corrupt_l2=skip_corrupt_l2, workers=workers
        )

    def agree_on(self, value: Any) -> bool:
        return value is not None

    def restore_order(self, order: Sequence[Candidate]) -> list[Candidate | None]:
        return list(order)

    def settle(self, step: int | None, failure: BaseException | None) -> str | None:
        """A damaged candidate is fallen back from; anything else is raised as it is."""
        if failure is None:
            return None
        if not isinstance(failure, CheckpointCorrupt):
            raise failure
        logger.warning(
            "checkpoint of step %s is unusable (%s); falling back to the previous one", step, failure
        )
        return str(failure)

    def nothing_loads(self, tried: list[str], where: Path) -> NoCheckpointError:
        return NoCheckpointError(
            f"no checkpoint in {where} verifies ({len(tried)} tried); newest problem: {tried[0]}"
        )

    def restore(self, order: Sequence[Any], load: Callable[[Any], Loaded], where: Path) -> Loaded | None:
        """The first of ``order`` (candidates with a ``.record``, newest first) that loads."""
        return restore_with(self, order, load, where)


class Ranks:
    """Several ranks over ``torch.distributed`` (:class:`.distributed.Comm`): rank 0 holds the
    writer lock and the journal and its trigger decides for all; any rank's preemption signal
    and memory alarm reach every rank at the next decision step."""

    hooks_may_save = False

    def __init__(self, comm: distributed.Comm, dir_id: str) -> None:
        self.comm = comm
        self.rank, self.world = comm.rank, comm.world
        self.dir_id = dir_id  # this rank's disk
        self._gc = False  # this rank collects its disk's garbage (learnt at the first save)
        self._point = 0  # the next agreed decision step
        self._decide_cost = 0.0  # what the collective costs (smoothed)
        self._urgent = False  # this rank's memory needs a save (sent at the next decision step)

    @property
    def leads(self) -> bool:
        return self.rank == 0

    @property
    def next_point(self) -> float:
        return float(self._point)

    def open(self, open_store: Callable[[], str], owner: Any) -> str:
        opened: str | BaseException = ""
        if self.rank == 0:
            try:
                opened = open_store()
            except BaseException as err:
                opened = err
        kind = type(opened).__name__ if isinstance(opened, SmartckptError) else "SmartckptError"
        shared = self.comm.broadcast(opened if isinstance(opened, str) else (kind, f"rank 0: {opened}"))
        if not isinstance(opened, BaseException) and not isinstance(shared, str):
            # every rank fails the same way (the same class: a refused start stops every rank
            # with smartckpt run's exit code 5), none waits forever
            cls = getattr(errors, shared[0], SmartckptError)
            raise (cls if isinstance(cls, type) and issubclass(cls, SmartckptError) else SmartckptError)(
                shared[1]
            )
        distributed.guard_destroy(owner)
        if isinstance(opened, BaseException):
            raise opened
        return opened if self.rank == 0 else str(shared)

    def agree_to_save(self, p: Proposal) -> Verdict:
        """Rank 0's wish, any rank's signal and memory alarm, agreed at the decision steps only
        (the next one is set by the collective itself, so every rank knows it); in between,
        wishes and signals wait."""
        wish = p.wish
        if p.decision.save:
            if self.rank == 0:
                wish = p.decision
            elif p.decision.reason == "memory pressure":
                self._urgent = True
        if p.step < self._point:
            return Verdict(NO, None, wish)
        want = self.rank == 0 and wish is not None and not p.busy
        ram = self.rank == 0 and p.ram
        gap = decide_gap(p.step, p.step_seconds, self._decide_cost, p.quiet_step) if self.rank == 0 else 1
        t0 = time.monotonic()
        code, signum, gap, urgent, blocked, every = self.comm.decide(
            1 if want else 2 if ram else 0, p.signal or 0, gap, self._urgent, not p.can_save, p.spacing
        )
        save = code == 1
        took = time.monotonic() - t0
        self._decide_cost = took if self._decide_cost == 0.0 else 0.8 * self._decide_cost + 0.2 * took
        # After a save or a signal the state of the schedule changes: agree again at the next step.
        self._point = p.step + (1 if blocked or save or urgent or signum else gap)
        spacing = every or None
        if blocked:  # some rank cannot snapshot this step: every rank waits for the next one
            return Verdict(NO, None, wish, spacing=spacing, agreed=True)
        if signum:
            return Verdict(NO, signum, wish, spacing=spacing, agreed=True)
        if not (save or urgent):
            return Verdict(NO, None, wish, spacing=spacing, agreed=True, ram=code == 2)
        chosen = wish if save and wish is not None else None
        if chosen is None:
            chosen = Decision(True, "rank 0 trigger" if save else "memory pressure", calm=p.decision.calm)
        self._urgent = False
        return Verdict(chosen, None, None, spacing=spacing, agreed=True)

    def persist(self, persister: Persister, snap: Snapshot, hold_gc: GcHold) -> CommitInfo:
        info, self._gc = persist_distributed(persister, snap, self.comm, self.dir_id, hold_gc)
        return info

    def collects_garbage(self) -> bool:
        """The lowest rank of every disk collects that disk's garbage (node-local dirs included)."""
        return self._gc

    def load(
        self,
        store: StoreDir,
        record: CheckpointRecord,
        store_id: str | None,
        *,
        skip_corrupt_l2: bool,
        workers: int,
    ) -> Loaded:
        fault_fail("rank.restore")  # crash tests: a rank whose load fails (_faults.py)
        if distributed.needs_reshard(record, self.world):
            return _resharded(store, record, store_id, self.rank, self.world, skip_corrupt_l2)
        return load_part(
            store.storage,
            store.blobs,
            record,
            store_id,
            self.rank,
            self.dir_id,
            skip_corrupt_l2=skip_corrupt_l2,
            workers=workers,
        )

    def agree_on(self, value: Any) -> bool:
        heard = self.comm.to_root(value)
        same = (
            None
            if heard is None
            else [heard[0] is not None and all(v == heard[0] for v in heard)] * self.world
        )
        return bool(self.comm.from_root(same))

    def restore_order(self, order: Sequence[Candidate]) -> list[Candidate | None]:
        """Rank 0's candidates, as this rank's (every rank loads the same step)."""
        by_id = {item.record.id: item for item in order}
        return [by_id.get(cid) for cid in restore_order(self.comm, list(by_id))]

    def settle(self, step: int | None, failure: BaseException | None) -> str | None:
        return settle_restore(self.comm, step, failure)

    def nothing_loads(self, tried: list[str], where: Path) -> NoCheckpointError:
        return NoCheckpointError(
            f"{where}: no checkpoint loads on every rank ({len(tried)} tried); newest problem: {tried[0]}"
        )

    def restore(self, order: Sequence[Any], load: Callable[[Any], Loaded], where: Path) -> Loaded | None:
        """Every rank loads the same step: the newest that verifies on all of them."""
        return restore_with(self, order, load, where)


def restore_with(
    coord: Coordinator, order: Sequence[Any], load: Callable[[Any], Loaded], where: Path
) -> Loaded | None:
    """The newest of ``order`` (candidates with a ``.record``, newest first) that every rank can
    load with ``load`` (candidate -> this rank's part), for a caller that has a loader; the
    manager's ``read`` makes the same calls in line (engine/restoring.py)."""
    tried: list[str] = []
    for item in coord.restore_order(order):
        loaded, failure = None, None
        try:
            if item is None:
                raise CheckpointCorrupt("not in this rank's view of the journal")
            loaded = load(item)
        except Exception as err:  # settled below: on every rank, a fallback or raised
            failure = err
        problem = coord.settle(item.record.step if item is not None else None, failure)
        if problem is not None:
            tried.append(problem)
            continue
        assert loaded is not None  # settled: this rank loaded it
        warn_moments_reset(loaded)
        return loaded
    if tried:
        raise coord.nothing_loads(tried, where)
    return None


def _resharded(
    store: StoreDir, record: CheckpointRecord, store_id: str | None, rank: int, world: int, skip_l2: bool
) -> Loaded:
    """A checkpoint of another world size, read for ``rank`` of ``world`` (elastic resume)."""
    loaded, report = load_resharded(
        store.storage, store.blobs, record, store_id, rank, world, skip_corrupt_l2=skip_l2
    )
    if rank == 0:  # a warning: the world changed, and with it the RNG of new ranks and the data order
        logger.warning("%s", report.line())
    else:
        logger.info(
            "rank %d read %.1f MB of %.1f MB stored (old parts %s)",
            rank,
            report.bytes_read / 1e6,
            report.bytes_stored / 1e6,
            sorted(report.parts_read),
        )
    return loaded


def make_coordinator(setting: str, root: Path, timeout: float | None = None) -> Coordinator:
    """The coordinator of this process: :class:`Ranks` in a multi-rank ``torch.distributed``
    world (``setting``: the ``distributed`` setting, ``auto`` or ``off``), else
    :class:`SingleProcess`. A remote tier works with either (remote/parts.py: each rank uploads
    its own part, rank 0 commits the step once every part is remote)."""
    comm = distributed.detect(setting, timeout)
    if comm is None:
        return SingleProcess()
    return Ranks(comm, distributed.dir_id(root))
