"""What one upload round must do, and the errors it raises: the pure :func:`plan_round` (which
local commits the remote lacks, which remote checkpoints were rolled back locally), shared by the
one-process round (:mod:`.replicator`) and the multi-rank round (:mod:`.part_round`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from smartckpt_cli.remote.check import upload_lag
from smartckpt_cli.store.commit import replicated
from smartckpt_cli.store.journal import CheckpointRecord, Journal, JournalState

__all__ = ["LocalBlobGone", "RemoteMismatch", "RoundPlan", "plan_round"]


@dataclass
class RoundProgress:
    """What one upload round leaves the next, and the status file reads: owned by the uploader
    thread (rounds run one at a time under ``remote.lock``); the status file is written from it
    under the replicator's ``status_lock``."""

    skip: set[str] = field(default_factory=set)  # local checkpoints found damaged: never shipped
    remote_live: set[str] = field(default_factory=set)  # remote live ids as last read
    marked: set[str] = field(default_factory=set)  # ids whose part of this rank is marked remotely
    waiting: bool = False  # rank 0: the last round waited for another rank's part
    next_seq: int = -1  # the remote journal's next sequence number after our last round
    first_seen: dict[str, float] = field(default_factory=dict)  # pending id -> when first seen


class RemoteMismatch(Exception):
    """The remote holds another store's checkpoints: never mix them."""


@dataclass
class RoundPlan:
    upload: list[CheckpointRecord] = field(default_factory=list)  # oldest first
    withdraw: list[CheckpointRecord] = field(default_factory=list)  # rolled back locally


def plan_round(local: JournalState, remote: JournalState, skip: set[str] | None = None) -> RoundPlan:
    """Pure: what one round must do to bring the remote up to the local journal."""
    bad = skip or set()
    remote_live = remote.live_ids()
    upload = [r for r in upload_lag(local.records, remote_live) if r.id not in bad]
    rolled_back = {r.id for r in local.records if r.rolled_back}
    withdraw = [r for r in remote.live() if r.id in rolled_back]
    return RoundPlan(upload, withdraw)


class LocalBlobGone(Exception):
    """A blob vanished locally mid-upload (local retention pruned its checkpoint)."""


class _LocalCorrupt(Exception):
    pass


def _writer(journal: Journal, seq: int, rec: CheckpointRecord) -> Callable[[], str]:
    return lambda: journal.append(replicated(rec.event), seq=seq, tag=rec.id)  # store/commit.py
