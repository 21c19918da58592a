"""``smartckpt prune``: keep the newest N checkpoints, remove the rest and their unshared blobs.

Deciding (:func:`plan_prune`) is pure. Doing (:func:`carry_out`) is safe while a training run
writes to the same store:

1. the newest checkpoint that verifies is found first (outside any lock: verifying is slow);
2. ``gc.lock`` is taken exclusively. A save in flight holds it shared from its first blob to its
   commit line, so taking it waits for that save to commit, and no new save starts writing until
   we are done: no blob of a checkpoint being written can be taken for garbage;
3. the journal is read again and the plan made again from it (the run may have committed or
   pruned meanwhile), with the verified checkpoint still protected;
4. the ``prune`` line is appended (under ``journal.lock``, like every append), then the manifests
   are removed, then unreferenced blobs (``retention.collect_garbage_locked``).

The journal line comes before any removal, so a crash halfway leaves checkpoints marked gone,
never ones that look whole but are not. Rolled-back checkpoints are never pruned here (a rollback
can be undone) and do not count towards N.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from smartckpt_cli.errors import CheckpointCorrupt, JournalError, StoreLockedError, UsageError
from smartckpt_cli.store.checkpoints import candidates
from smartckpt_cli.store.directory import StoreDir
from smartckpt_cli.store.journal import CheckpointRecord, JournalState
from smartckpt_cli.store.retention import GC_LOCK, collect_garbage_locked, prune

__all__ = ["PrunePlan", "PruneResult", "carry_out", "newest_verified", "plan_prune"]

logger = logging.getLogger(__name__)


@dataclass
class PrunePlan:
    keep: list[CheckpointRecord]  # newest first
    remove: list[CheckpointRecord]  # newest first
    protected: str | None  # id of the newest verified checkpoint (kept whatever N says)


@dataclass
class PruneResult:
    plan: PrunePlan
    dry_run: bool
    bytes_freed: int  # measured when carried out; the estimate for a dry run
    newest_verified: CheckpointRecord | None
    unverified: list[str]  # newer checkpoints that failed verification, and why


def plan_prune(records: list[CheckpointRecord], keep: int, protect: str | None) -> PrunePlan:
    """Pure: keep the ``keep`` newest live checkpoints (journal order, any health) and the one
    with id ``protect``; remove every other live one. Rolled-back and pruned ones are left alone."""
    if keep < 1:
        raise UsageError("--keep must be at least 1 (the newest verified checkpoint is always kept)")
    live = sorted((r for r in records if r.live), key=lambda r: r.position, reverse=True)
    kept = [r for i, r in enumerate(live) if i < keep or r.id == protect]
    gone = [r for r in live if r not in kept]
    return PrunePlan(kept, gone, protect)


def newest_verified(
    store: StoreDir, state: JournalState, *, progress: Callable[[int, int], None] | None = None
) -> tuple[CheckpointRecord | None, list[str]]:
    """The newest live healthy checkpoint that verifies completely (what a resume would load),
    and the reasons newer ones were passed over."""
    from smartckpt_cli.ops.verify import verify

    skipped: list[str] = []
    for rec in candidates(state.records):
        try:
            report = verify(store, step=rec.step, progress=progress)
        except UsageError:  # pruned by the running job since the journal was read
            continue
        result = next((r for r in report.results if r.id == rec.id), None)
        if result is not None and result.ok and result.note is None:
            return rec, skipped
        skipped.append(f"step {rec.step} ({rec.id}): {result.problem if result else 'not found'}")
    return None, skipped


def _unique_bytes(store: StoreDir, state: JournalState, doomed: list[CheckpointRecord]) -> int:
    """Encoded bytes referenced only by ``doomed`` among the checkpoints still on disk."""
    from smartckpt_cli.ops.catalog import blob_sizes
    from smartckpt_cli.store.checkpoints import read_manifest

    gone = {r.id for r in doomed}
    doomed_blobs: dict[str, int] = {}
    kept_blobs: set[str] = set()
    for rec in state.records:
        if rec.pruned:
            continue
        try:
            sizes = blob_sizes(read_manifest(store.storage, rec, state.store_id))
        except Exception:  # an unreadable manifest: estimate without it
            continue
        if rec.id in gone:
            doomed_blobs.update(sizes)
        else:
            kept_blobs |= set(sizes)
    return sum(n for bid, n in doomed_blobs.items() if bid not in kept_blobs)


def carry_out(
    store: StoreDir,
    keep: int,
    *,
    dry_run: bool = False,
    lock_timeout: float = 300.0,
    progress: Callable[[int, int], None] | None = None,
) -> PruneResult:
    """Plan and (unless ``dry_run``) carry out a prune; see the module docstring for the order."""
    if keep < 1:
        raise UsageError("--keep must be at least 1 (the newest verified checkpoint is always kept)")
    for attempt in range(3):
        try:
            return _carry_out(store, keep, dry_run=dry_run, lock_timeout=lock_timeout, progress=progress)
        except _Superseded:
            # A running job pruned the checkpoint just verified (its own keep_last) before we
            # got the lock: verify the new newest one and plan again.
            logger.info("the verified checkpoint was pruned meanwhile; trying again (%d)", attempt + 1)
    raise UsageError("the store changes faster than prune can verify it; try again or stop the run")


class _Superseded(Exception):
    pass


def _carry_out(
    store: StoreDir,
    keep: int,
    *,
    dry_run: bool,
    lock_timeout: float,
    progress: Callable[[int, int], None] | None,
) -> PruneResult:
    state = store.journal.read()
    if state.problems:
        raise JournalError(
            f"the journal has damaged lines ({state.problems[0]}); run 'smartckpt verify' and "
            "repair or move the store before pruning"
        )
    verified, unverified = newest_verified(store, state, progress=progress)
    if verified is None:
        raise CheckpointCorrupt(
            "no checkpoint verifies; refusing to prune anything"
            + (f" ({unverified[0]})" if unverified else " (the store has no live healthy checkpoint)")
        )
    plan = plan_prune(state.records, keep, verified.id)
    if dry_run:
        return PruneResult(plan, True, _unique_bytes(store, state, plan.remove), verified, unverified)
    deadline = time.monotonic() + lock_timeout
    while True:
        try:
            with store.lock(GC_LOCK, blocking=False):
                state = store.journal.read()
                if not any(r.id == verified.id and r.live for r in state.records):
                    raise _Superseded()
                plan = plan_prune(state.records, keep, verified.id)
                prune(store.storage, store.journal, plan.remove, why=f"smartckpt prune --keep {keep}")
                freed = collect_garbage_locked(store.storage, store.blobs, store.journal)
                return PruneResult(plan, False, freed, verified, unverified)
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise StoreLockedError(
                    f"a save into {store.root} has held gc.lock for {lock_timeout:.0f} s; nothing "
                    "was pruned, try again"
                ) from None
            time.sleep(0.1)
