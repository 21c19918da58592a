"""Multi-rank checkpoints on the remote: one *part* per rank, and the rule that makes a step exist.

Under torchrun every rank runs its own uploader for its own part (its blobs, then its part
manifest), and when the part is whole on the remote it writes an immutable *marker* object,
``parts/<step>-<id>-r<rank>.json``, named so no two writers ever collide. Rank 0's uploader writes
the remote ``commit`` object of a step (the local commit line: ``world_size`` and every ``parts``
entry) only once it lists a marker for **every** rank of that step: the local two-phase rule, over
the object store. Replicated content is content-addressed, so a blob already on the remote (another
rank's, an earlier step's) is not sent again.

Commits stay in journal order: a step is committed remotely only when no step after it (in the
local journal) is committed remotely yet; an older step whose part never made it is abandoned.
Rank 0's retention collects the parts (manifests, markers, blobs) of abandoned steps: every
uncommitted part except those of local checkpoints that can still be committed
(:func:`still_pending`); a part of a previous run's journal (a restart onto wiped disks) is
abandoned too.

This module is pure: names and decisions, no I/O.
"""

from __future__ import annotations

import json
from typing import Any

from smartckpt_cli.store.journal import CheckpointRecord
from smartckpt_cli.store.names import marker, parse_marker

__all__ = [
    "PARTS_DIR",
    "abandoned_before",
    "marker_body",
    "marker_name",
    "missing_markers",
    "part_cid",
    "record_parts",
    "status_name",
    "still_pending",
]

PARTS_DIR = "parts"
STATUS_BASE = "remote-status"


def record_parts(rec: CheckpointRecord) -> list[list[Any]] | None:
    """``[[manifest, hash, dir id], ...]`` of a multi-rank commit (names checked when the journal
    was read), None for one process."""
    if not rec.parts:
        return None
    return [[p.manifest, p.manifest_hash, p.dir_id] for p in rec.parts]


def marker_name(step: int, cid: str, rank: int) -> str:
    return marker(step, cid, rank)


def marker_body(rec: CheckpointRecord, rank: int) -> bytes:
    parts = record_parts(rec) or []
    rel, mhash = (parts[rank][0], parts[rank][1]) if rank < len(parts) else (rec.manifest, rec.manifest_hash)
    body = {"step": rec.step, "id": rec.id, "rank": rank, "manifest": rel, "manifest_hash": mhash}
    return (json.dumps(body, sort_keys=True) + "\n").encode()


def missing_markers(rec: CheckpointRecord, markers: set[str]) -> list[int]:
    """The ranks of ``rec`` whose part is not marked complete on the remote."""
    parts = record_parts(rec) or [[rec.manifest]]
    return [r for r in range(len(parts)) if marker_name(rec.step, rec.id, r) not in markers]


def abandoned_before(local: list[CheckpointRecord], remote_live: set[str]) -> int:
    """The local journal position of the newest checkpoint the remote holds (-1: none). Local
    checkpoints at or before it that the remote lacks are never committed there any more."""
    return max((r.position for r in local if r.id in remote_live), default=-1)


def still_pending(local: list[CheckpointRecord], remote_ids: set[str], remote_live: set[str]) -> set[str]:
    """The ids of local checkpoints whose parts may still be uploaded and committed: after the
    newest one the remote holds, and not on the remote (``remote_ids``: committed ever, pruned
    ones included). Every other uncommitted part on the remote is abandoned."""
    newest = abandoned_before(local, remote_live)
    return {r.id for r in local if r.position > newest and r.id not in remote_ids}


def part_cid(name: str) -> str | None:
    """The checkpoint id in a part manifest's or marker's file name (``<step>-<id>-r<rank>.json``),
    None for any other name (store/names.py: such a name is never ours)."""
    parsed = parse_marker(name)
    return None if parsed is None else parsed[1]


def status_name(rank: int) -> str:
    """The uploader's status file in meta_dir: rank 0's keeps the one-process name."""
    return f"{STATUS_BASE}.json" if rank == 0 else f"{STATUS_BASE}-r{rank}.json"
