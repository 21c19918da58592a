"""What to keep: retention is decided purely from the journal, then carried out.

Order (writer thread, after a commit): ``select_prunable`` → journal ``prune`` line → remove the
manifests → ``collect_garbage`` removes blobs no remaining manifest references, manifests the
journal never committed and temporary files of dead writers. The journal line comes first, so a
crash halfway leaves checkpoints that are already marked gone, never ones that look whole but
are not. Garbage collection holds ``gc.lock`` exclusively; a save in flight holds it shared, so
blobs of a checkpoint being written are never taken for garbage.
"""

from __future__ import annotations

import logging

from smartckpt_cli._faults import fault_point
from smartckpt_cli.errors import JournalError
from smartckpt_cli.store.blobs import BlobStore
from smartckpt_cli.store.gc import sweep
from smartckpt_cli.store.journal import CheckpointRecord, Journal
from smartckpt_cli.store.names import is_manifest_file, is_temporary
from smartckpt_cli.store.storage.base import Storage
from smartckpt_cli.store.unjournalled import repair_command, say_once, survey

__all__ = ["GC_LOCK", "collect_garbage", "collect_garbage_locked", "prune", "select_prunable"]

logger = logging.getLogger(__name__)

GC_LOCK = "gc.lock"


def select_prunable(records: list[CheckpointRecord], keep_last: int) -> list[CheckpointRecord]:
    """Healthy live checkpoints beyond the newest ``keep_last``, except the newest *calm* one:
    saves taken while the trigger saw a risk (a precursor of a spike) must not evict the last
    known-good state. Unhealthy checkpoints never count towards ``keep_last``, so they can never
    push a healthy one out; they go once a newer healthy one exists. Rolled-back checkpoints are
    kept: a rollback can be undone. A checkpoint whose commit line names things outside the
    format (``invalid``) is never pruned: it names nothing that may be removed, and it stays
    visible as damage."""
    records = [r for r in records if r.invalid is None]
    live = sorted((r for r in records if r.live and r.health == "ok"), key=lambda r: r.position)
    keep = max(1, keep_last)
    calm = [r for r in live if r.calm]
    known_good = calm[-1] if calm else None
    unhealthy = [r for r in records if r.live and r.health != "ok"]
    newest_ok = live[-1].position if live else -1
    return [r for r in live[:-keep] if r is not known_good] + [r for r in unhealthy if r.position < newest_ok]


def prune(storage: Storage, journal: Journal, doomed: list[CheckpointRecord], *, why: str) -> None:
    if not doomed:
        return
    journal.append(
        {"event": "prune", "ids": [r.id for r in doomed], "steps": [r.step for r in doomed], "why": why}
    )
    fault_point("prune.in_progress")
    for rec in doomed:
        for rel in rec.manifests():  # checked names only; none for an invalid line
            storage.remove(rel)


def collect_garbage(storage: Storage, blobs: BlobStore, journal: Journal) -> int:
    """Remove unreferenced blobs, uncommitted manifests and dead temp files; returns bytes freed.
    Holds ``gc.lock`` (in the journal's directory) exclusively."""
    with journal.storage.lock(GC_LOCK):
        return collect_garbage_locked(storage, blobs, journal)


def collect_garbage_locked(storage: Storage, blobs: BlobStore, journal: Journal) -> int:
    """:func:`collect_garbage` for a caller that already holds ``gc.lock`` exclusively: what
    to keep decided here, removed by the one sweep (:mod:`.gc`)."""
    found = survey(storage, journal)
    if found.state is None:
        raise JournalError(f"garbage collection stopped: the journal {found.look.path} cannot be read")
    kept = [r for r in found.state.records if not r.pruned]
    # A multi-rank commit names one part manifest per rank; those on this disk are kept too.
    # Manifests no journal line names are the leftovers of interrupted commits, unless the journal
    # lost lines or they are another store's: then they are evidence, kept with their blobs.
    kept_manifests = {m for r in kept for m in r.manifests()} | found.kept
    root = getattr(storage, "root", journal.path.parent)
    for finding in found.findings:
        say_once(finding.line(str(root), repair_command(root, journal.path.parent)))
    # Only files the format makes are ever removed: a note or a stray file in manifests/ is not ours.
    uncommitted = [f"manifests/{n}" for n in storage.list("manifests") if is_manifest_file(n)]
    freed = sweep(storage, kept_manifests, uncommitted, blobs.all_ids(), sizes=True).freed
    for name in storage.leftovers("manifests"):
        if is_temporary(name) and is_manifest_file(name.split(".tmp.", 1)[0]):
            storage.remove(f"manifests/{name}")
    for rel in blobs.leftovers():
        storage.remove(rel)
    return freed
