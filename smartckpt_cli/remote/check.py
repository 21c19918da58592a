"""The remote side of ``inspect``, ``verify`` and ``prune``, and remote retention.

Verifying the replica is verifying a store (``ops/verify.py`` over :func:`reach`: the same
checks, the same lines). Pruning writes the ``prune`` object first, then removes manifests, then every blob no
remaining checkpoint references, so a crash halfway leaves checkpoints already marked gone.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from smartckpt_cli.errors import SmartckptError
from smartckpt_cli.remote.parts import PARTS_DIR, marker_name, missing_markers, part_cid, status_name
from smartckpt_cli.remote.replica import display_url, open_remote, replica_journal
from smartckpt_cli.store.blobs import BlobStore
from smartckpt_cli.store.directory import StoreDir, open_repository
from smartckpt_cli.store.gc import sweep
from smartckpt_cli.store.journal import CheckpointRecord, Journal, JournalState
from smartckpt_cli.store.names import is_manifest_file
from smartckpt_cli.store.retention import select_prunable
from smartckpt_cli.store.storage import Storage

__all__ = [
    "REMOTE_LOCK",
    "STATUS_FILE",
    "RemoteUnavailable",
    "connect",
    "list_blobs",
    "merge_status",
    "prune_remote",
    "reach",
    "read_status",
    "remote_summary",
    "remove_unreferenced",
    "upload_lag",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

STATUS_FILE = "remote-status.json"  # in meta_dir, written by the uploader, read by inspect and run
# In meta_dir: held by the uploader for each round and by `prune --remote`, so blobs are never
# collected remotely while an upload that will reference them is in flight.
REMOTE_LOCK = "remote.lock"


def list_blobs(remote: Storage) -> set[str]:
    """The blob ids on the remote: names that are blob ids, in the folder of their first two
    digits (:meth:`BlobStore.all_ids`). Anything else under ``blobs/`` is not ours."""
    return set(BlobStore(remote).all_ids())


def upload_lag(local: Iterable[CheckpointRecord], remote_live_ids: set[str]) -> list[CheckpointRecord]:
    """Pure: live local checkpoints the remote does not hold yet, oldest first. A checkpoint whose
    commit line is invalid names nothing that could be shipped: never."""
    return sorted(
        (r for r in local if r.live and r.invalid is None and r.id not in remote_live_ids),
        key=lambda r: r.position,
    )


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _status(data: dict[str, Any] | None) -> dict[str, Any] | None:
    """A status file as it may be shown: the fields smartckpt writes, each of its type (a file
    anyone could have written is never trusted further); None when it is not one."""
    if data is None:
        return None
    out: dict[str, Any] = {}
    for key, value in data.items():
        want = _STATUS_FIELDS.get(key)
        if want is None:
            continue
        if want is int and isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62:
            out[key] = value
        elif want is float and isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
            out[key] = float(value)
        elif want is str and isinstance(value, str):
            out[key] = display_url(value)[:300] if key == "remote" else value[:300]
        elif want is list and isinstance(value, list):
            out[key] = [v for v in value if isinstance(v, int) and not isinstance(v, bool)][:100]
        elif want is bool and isinstance(value, bool | str | None):
            out[key] = value
    world = out.get("world", 1)
    out["world"] = world if 1 <= world <= _STATUS_RANKS else 1
    return out


_STATUS_RANKS = 1 << 16  # a status file claiming more ranks than this is not believed

_STATUS_FIELDS: dict[str, type] = {
    "remote": str,
    "rank": int,
    "world": int,
    "part_pending": int,
    "part_pending_steps": list,
    "lag_seconds": float,
    "pending": int,
    "pending_steps": list,
    "remote_steps": list,
    "last_error": str,
    "failures_in_row": int,
    "bytes_sent": int,
    "blobs_sent": int,
    "blobs_deduped": int,
    "checkpoints_sent": int,
    "parts_sent": int,
    "last_upload_seconds": float,
    "disabled": bool,
    "pid": int,
    "updated": float,
}


def read_status(meta_root: Path) -> dict[str, Any] | None:
    """The uploader's status. With several ranks (each writes its own file, parts.status_name)
    rank 0's, plus ``ranks`` (each rank's lag) and the slowest rank's lag (:func:`merge_status`).
    Every field is checked for its type first (:func:`_status`); a world size beyond reason
    reads as one process."""
    head = _status(_read_json(meta_root / STATUS_FILE))
    if head is None or head["world"] <= 1:
        return head
    ranks = [head] + [_status(_read_json(meta_root / status_name(r))) for r in range(1, head["world"])]
    return merge_status(ranks)


def merge_status(ranks: list[dict[str, Any] | None]) -> dict[str, Any]:
    """Pure: one view of every rank's status (index = rank; None: that rank wrote none yet).
    ``pending`` stays rank 0's (steps the remote has not committed); per rank, ``pending`` is the
    checkpoints whose part of that rank is not up yet; ``slowest_rank`` is the rank furthest
    behind (most such checkpoints, then the oldest), ``lag_seconds`` its lag."""
    head = dict(ranks[0] or {})
    rows = []
    for r, st in enumerate(ranks):
        st = st or {}
        rows.append(
            {
                "rank": r,
                "pending": int(st.get("part_pending", st.get("pending", 0))) if st else None,
                "pending_steps": list(st.get("part_pending_steps", st.get("pending_steps")) or []),
                "lag_seconds": float(st.get("lag_seconds") or 0.0),
                "bytes_sent": int(st.get("bytes_sent") or 0),
                "last_error": st.get("last_error"),
            }
        )
    slowest = max(
        rows, key=lambda x: ((x["pending"] if x["pending"] is not None else 1 << 30), x["lag_seconds"])
    )
    head["ranks"] = rows
    head["slowest_rank"] = slowest["rank"]
    head["lag_seconds"] = slowest["lag_seconds"]
    if not head.get("last_error"):
        errors = [f"rank {x['rank']}: {x['last_error']}" for x in rows if x["last_error"]]
        head["last_error"] = errors[0] if errors else None
    return head


def _manifests_of(rec: CheckpointRecord) -> list[str]:
    """Every manifest of a checkpoint: its own, and each rank's part of a multi-rank one (checked
    names; none for an invalid commit object)."""
    return rec.manifests()


def remove_unreferenced(
    remote: Storage,
    state: JournalState,
    known_blobs: set[str],
    manifests: dict[str, dict[str, Any]],
    *,
    keep_pending: bool = False,
    pending_ids: set[str] | None = None,
) -> int:
    """Remove manifests (every rank's part) and part markers of pruned checkpoints, and blobs no
    kept checkpoint references on any rank. Returns the blobs removed. ``manifests`` caches parsed
    remote manifests (they never change). ``keep_pending`` (several ranks): a part manifest no
    commit names yet belongs to a step still waiting for another rank's part; its blobs are kept.
    ``pending_ids`` (rank 0's uploader, which knows the local journal): only the uncommitted parts
    of these checkpoints are kept; every other uncommitted part is abandoned, and its manifest,
    its markers and the blobs only it references are removed. Without it (``prune --remote``,
    which cannot tell a running upload from a dead one) every uncommitted part is kept.
    Callers hold remote.lock exclusively, so no rank is between its dedup decision and its
    manifest."""

    kept_manifests = {m for r in state.records if not r.pruned for m in _manifests_of(r)}
    keep, remove = set(kept_manifests), {m for r in state.records if r.pruned for m in _manifests_of(r)}
    markers = [
        f"{PARTS_DIR}/{marker_name(r.step, r.id, rank)}"
        for r in state.records
        if r.pruned and r.parts
        for rank in range(len(r.parts))
    ]
    if keep_pending:
        waiting, abandoned = _uncommitted_parts(remote, kept_manifests | remove, pending_ids)
        keep |= waiting
        remove |= {rel for rels in abandoned.values() for rel in rels}
        markers += [f"{PARTS_DIR}/{n}" for n in remote.list(PARTS_DIR) if part_cid(n) in abandoned]
        if abandoned:
            logger.info(
                "remote: collected the uncommitted parts of %d abandoned checkpoint(s)", len(abandoned)
            )
    for rel in markers:  # before the parts they mark
        remote.remove(rel)
    swept = sweep(remote, keep, remove, known_blobs, cache=manifests)  # store/gc.py: the one sweep
    known_blobs.difference_update(swept.blobs)
    return len(swept.blobs)


def _uncommitted_parts(
    remote: Storage, named: set[str], pending_ids: set[str] | None
) -> tuple[set[str], dict[str, list[str]]]:
    """The part manifests no commit names yet: those kept (their step may still be committed),
    and those abandoned, by checkpoint id (see :func:`remove_unreferenced`)."""
    waiting: set[str] = set()
    abandoned: dict[str, list[str]] = {}
    for name in remote.list("manifests"):
        rel = f"manifests/{name}"
        if rel in named or not is_manifest_file(name):
            continue
        cid = part_cid(name)
        if pending_ids is not None and cid is not None and cid not in pending_ids:
            abandoned.setdefault(cid, []).append(rel)
        else:
            waiting.add(rel)
    return waiting, abandoned


@dataclass
class PrunePlan:
    keep: list[CheckpointRecord] = field(default_factory=list)
    remove: list[CheckpointRecord] = field(default_factory=list)
    blobs_removed: int = 0


def prune_remote(
    remote: Storage,
    journal: Journal,
    keep_last: int,
    *,
    dry_run: bool = False,
    why: str = "",
    say: Callable[[str], None] | None = None,
) -> PrunePlan:
    """Apply ``keep_last`` to the remote: a ``prune`` object, then the files it frees."""
    state = journal.read()
    doomed = select_prunable(state.records, keep_last)
    plan = PrunePlan(
        keep=[r for r in state.live() if r not in doomed],
        remove=doomed,
    )
    if dry_run or not doomed:
        return plan
    journal.append(
        {"event": "prune", "ids": [r.id for r in doomed], "steps": [r.step for r in doomed], "why": why},
        seq=state.next_seq,
    )
    state = journal.read()
    multi = bool(remote.list(PARTS_DIR))  # a multi-rank remote: keep the parts of pending steps
    plan.blobs_removed = remove_unreferenced(remote, state, list_blobs(remote), {}, keep_pending=multi)
    if say is not None:
        say(f"remote: pruned {len(doomed)} checkpoint(s), {plan.blobs_removed} blob(s)")
    return plan


class RemoteUnavailable(SmartckptError):
    """The remote cannot be reached or read (exit 1: the operation failed)."""


def _reading(url: str, fn: Callable[[], T]) -> T:
    """``fn()``, with whatever the remote raises said in one line (RemoteUnavailable)."""
    try:
        return fn()
    except SmartckptError:
        raise
    except Exception as err:
        raise RemoteUnavailable(
            f"remote {display_url(url)} unreachable: {type(err).__name__}: {str(err)[:200]}"
        ) from None


def reach(url: str) -> StoreDir:
    """The replica at ``url`` as a store (``verify``/``inspect`` read it with the local code),
    its journal read once here so that an unreachable remote is one line; a replica with no
    journal yet reads as empty."""

    def opened() -> StoreDir:
        store = open_repository(url, must_exist=False)
        store.journal.read()
        return store

    return _reading(url, opened)


def connect(url: str) -> tuple[Storage, Journal, JournalState]:
    """Open ``url`` and read its journal, for the CLI; one-line errors."""
    remote = open_remote(url)
    journal = replica_journal(remote)
    return remote, journal, _reading(url, journal.read)


def remote_summary(local: Iterable[CheckpointRecord], local_store_id: str | None, url: str) -> dict[str, Any]:
    """What ``inspect --remote`` shows: the remote's live checkpoints and the upload lag."""

    remote, _, state = connect(url)
    local = list(local)
    lag = upload_lag(local, state.live_ids())
    ranks = _rank_lag(remote, lag)
    return {
        **({"ranks": ranks} if ranks else {}),
        "remote": display_url(url),
        "store_id": state.store_id,
        "same_store": state.store_id in (None, local_store_id),
        "live_steps": [r.step for r in sorted(state.live(), key=lambda r: r.position)],
        "pending": len(lag),
        "pending_steps": [r.step for r in lag],
        "journal_problems": state.problems,
    }


def _rank_lag(remote: Storage, lag: list[CheckpointRecord]) -> list[dict[str, Any]]:
    """Per rank, the pending multi-rank checkpoints whose part that rank has not marked on the
    remote yet (its upload lag as the remote sees it); empty for one process."""
    world = max((len(r.parts or ()) for r in lag), default=0)
    if world <= 1:
        return []
    markers = set(remote.list(PARTS_DIR))
    steps: list[list[int]] = [[] for _ in range(world)]
    for rec in lag:
        for r in missing_markers(rec, markers):
            if r < world:
                steps[r].append(rec.step)
    return [{"rank": r, "pending": len(s), "pending_steps": s} for r, s in enumerate(steps)]
