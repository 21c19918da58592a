"""The multi-rank round (``world > 1``, :mod:`.parts`): this rank uploads its own part of each
missing commit (blobs, part manifest), then writes its marker; rank 0 also writes the ``commit``
object of each step whose every part is marked. Functions over the :class:`.Replicator`'s state,
called from its :meth:`~.Replicator.run_round`."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from smartckpt_cli._faults import fault_fail
from smartckpt_cli.remote.parts import (
    PARTS_DIR,
    abandoned_before,
    marker_body,
    marker_name,
    missing_markers,
    record_parts,
)
from smartckpt_cli.remote.plan import LocalBlobGone, _LocalCorrupt, _writer, plan_round
from smartckpt_cli.store.journal import CheckpointRecord, JournalState

if TYPE_CHECKING:
    from smartckpt_cli.remote.replicator import Replicator

__all__ = ["round_parts"]

logger = logging.getLogger(__name__)


def round_parts(rep: Replicator) -> int:
    """One round with several ranks: this rank's parts up and marked; on rank 0 the commit
    object of every step whose parts are all marked (parts.py)."""
    rstate = rep.remote_state(may_init=rep.rank == 0)
    local = rep.store.journal.read()
    markers = set(rep.retry("part listing", lambda: rep.remote.list(PARTS_DIR)))
    remote_live = rstate.live_ids()
    newest = abandoned_before(local.records, remote_live)
    todo = [r for r in plan_round(local, rstate, rep.progress.skip).upload if r.position > newest]
    rep.progress.remote_live = remote_live
    seq = rstate.next_seq
    waiting = False
    left: list[CheckpointRecord] = []
    for rec in todo:
        if rep.stopping:
            left.append(rec)
            continue
        parts = record_parts(rec)
        mine = marker_name(rec.step, rec.id, rep.rank)
        if parts is None:  # a one-process checkpoint (written before a resize): rank 0's
            if rep.rank == 0:
                left.append(rec)
            continue
        if rep.rank < len(parts) and mine not in markers:
            try:
                with rep.uploading():
                    _upload_part(rep, rec, parts[rep.rank])
            except (LocalBlobGone, _LocalCorrupt) as err:
                if any(r.id == rec.id and r.live for r in rep.store.journal.read().records):
                    rep.progress.skip.add(rec.id)
                    logger.error("remote: step %d: this rank's part is not uploadable (%s)", rec.step, err)
                continue
            markers.add(mine)
            rep.status.parts_sent += 1
        rep.progress.marked.add(rec.id)
        if rep.rank != 0:
            continue
        if missing_markers(rec, markers):
            waiting = True
            left.append(rec)
            continue
        # IMPORTANT: the commit object goes last, after every rank's part is marked.
        rep.retry("commit", _writer(rep.journal, seq, rec))
        seq += 1
        rep.status.checkpoints_sent += 1
        rep.status.remote_steps.append(rec.step)
        rep.progress.remote_live.add(rec.id)
    _finish_round(rep, rstate, left, waiting)
    return len(left)


def _finish_round(rep: Replicator, rstate: JournalState, left: list[CheckpointRecord], waiting: bool) -> None:
    """What the round leaves for the next one and for the status file: rank 0 counts what is
    still not remote in the journal it reads again; another rank, what this round left."""
    rep.progress.waiting = waiting
    if rep.rank == 0:
        after = rep.retry("journal read", rep.journal.read)
        rep.progress.next_seq = after.next_seq
        rep.set_pending(left, after)
    else:
        rep.progress.next_seq = rstate.next_seq
        rep.status.pending, rep.status.pending_steps = len(left), [r.step for r in left]
    rep.publish_status()


def _upload_part(rep: Replicator, rec: CheckpointRecord, part: list[Any]) -> None:
    """This rank's part of ``rec``: its blobs, its part manifest, then its marker."""
    rep.upload_checkpoint(replace(rec, manifest=part[0], manifest_hash=part[1]))
    fault_fail("remote.part")  # tests: a rank killed (or failing) between its part and marker
    body = marker_body(rec, rep.rank)
    rep.retry(
        "part marker",
        lambda: rep.remote.write(f"{PARTS_DIR}/{marker_name(rec.step, rec.id, rep.rank)}", body),
    )
