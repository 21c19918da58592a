"""The remote side of ``inspect``, ``verify`` and ``prune``, and remote retention.

Verifying a remote checkpoint is what verifying a local one is: its commit object names its
manifest and the manifest's hash; every blob the manifest names must exist and re-hash to its
name. Pruning writes the ``prune`` object first, then removes manifests, then every blob no
remaining checkpoint references, so a crash halfway leaves checkpoints already marked gone.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from smartckpt_cli.errors import SmartckptError
from smartckpt_cli.remote.backend import Remote, display_url
from smartckpt_cli.remote.fetch import manifest_blob_ids
from smartckpt_cli.remote.parts import PARTS_DIR, marker_name, missing_markers, part_cid, status_name
from smartckpt_cli.remote.rjournal import RemoteJournal, RemoteState
from smartckpt_cli.store import codec
from smartckpt_cli.store.journal import CheckpointRecord, decode_manifest
from smartckpt_cli.store.names import blob_rel, is_blob_id, is_manifest_file
from smartckpt_cli.store.retention import select_prunable

__all__ = [
    "REMOTE_LOCK",
    "STATUS_FILE",
    "RemoteCheck",
    "RemoteUnavailable",
    "connect",
    "list_blobs",
    "merge_status",
    "prune_remote",
    "read_status",
    "remote_summary",
    "remove_unreferenced",
    "upload_lag",
    "verify_remote",
]

logger = logging.getLogger(__name__)

STATUS_FILE = "remote-status.json"  # in meta_dir, written by the uploader, read by inspect and run
# In meta_dir: held by the uploader for each round and by `prune --remote`, so blobs are never
# collected remotely while an upload that will reference them is in flight.
REMOTE_LOCK = "remote.lock"


def list_blobs(remote: Remote) -> set[str]:
    """The blob ids on the remote: names that are blob ids, in the folder of their first two
    digits. Anything else under ``blobs/`` is not ours: never counted, never removed."""
    fans = [f for f in remote.list("blobs") if len(f) == 2 and all(c in "0123456789abcdef" for c in f)]
    return {n for fan in fans for n in remote.list(f"blobs/{fan}") if is_blob_id(n) and n[:2] == fan}


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


@dataclass
class RemoteCheck:
    step: int
    id: str
    ok: bool
    problem: str | None = None
    blobs: int = 0
    bytes: int = 0


def _check_one(remote: Remote, rec: CheckpointRecord, workers: int) -> RemoteCheck:
    """Every manifest of ``rec`` (each rank's part of a multi-rank checkpoint) and every blob they
    name: present, and re-hashing to its name."""
    out = RemoteCheck(rec.step, rec.id, ok=False)
    if rec.invalid is not None:
        out.problem = rec.invalid
        return out
    parts = (
        [(p.manifest, p.manifest_hash) for p in rec.parts]
        if rec.parts
        else [(rec.manifest, rec.manifest_hash)]
    )
    multi = len(parts) > 1
    ids: dict[str, None] = {}
    for rank, (rel, mhash) in enumerate(parts):
        who = f"rank {rank}'s " if multi else ""
        try:
            data = remote.get(rel)
        except FileNotFoundError:
            out.problem = f"{who}manifest {rel} is missing"
            return out
        if codec.blob_id(data) != mhash:
            out.problem = f"{who}manifest {rel} does not match its commit"
            return out
        try:
            manifest = decode_manifest(data, rel)
        except ValueError as err:
            out.problem = str(err)
            return out
        ids.update(dict.fromkeys(manifest_blob_ids(manifest)))

    def one(bid: str) -> tuple[str | None, int]:
        try:
            blob = remote.get(blob_rel(bid))
        except FileNotFoundError:
            return f"missing blob {bid}", 0
        return (None if codec.blob_id(blob) == bid else f"hash mismatch in blob {bid}"), len(blob)

    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="smartckpt-rverify") as pool:
        results = list(pool.map(one, list(ids)))
    problems = [p for p, _ in results if p]
    out.blobs, out.bytes = len(ids), sum(n for _, n in results)
    out.ok = not problems
    out.problem = (
        "; ".join(problems[:3]) + (f" (+{len(problems) - 3} more)" if len(problems) > 3 else "") or None
    )
    return out


def verify_remote(
    remote: Remote,
    state: RemoteState,
    *,
    step: int | None = None,
    all_checkpoints: bool = False,
    workers: int = 8,
) -> list[RemoteCheck]:
    """Re-hash remote checkpoints: the newest live one, ``step``'s, or every live one."""
    live = sorted(state.live(), key=lambda r: r.position, reverse=True)
    if step is not None:
        chosen = [r for r in live if r.step == step]
    elif all_checkpoints:
        chosen = live
    else:
        chosen = live[:1]
    return [_check_one(remote, r, workers) for r in chosen]


def _manifests_of(rec: CheckpointRecord) -> list[str]:
    """Every manifest of a checkpoint: its own, and each rank's part of a multi-rank one (checked
    names; none for an invalid commit object)."""
    return rec.manifests()


def remove_unreferenced(
    remote: Remote,
    state: RemoteState,
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

    kept = [r for r in state.records if not r.pruned]
    kept_manifests = {m for r in kept for m in _manifests_of(r)}
    referenced: set[str] = set()
    for rel in sorted(kept_manifests):
        referenced.update(_blobs_of(remote, manifests, rel))
    if keep_pending:
        named = kept_manifests | {m for r in state.records for m in _manifests_of(r)}
        referenced.update(_keep_or_abandon_parts(remote, manifests, named, pending_ids))
    _remove_pruned_manifests(remote, state, kept_manifests, manifests)
    removed = 0
    for bid in sorted(known_blobs - referenced):
        remote.remove(blob_rel(bid))
        known_blobs.discard(bid)
        removed += 1
    return removed


def _blobs_of(remote: Remote, manifests: dict[str, dict[str, Any]], rel: str) -> list[str]:
    """The blobs manifest ``rel`` names, read once into ``manifests`` (a gone or damaged one: none)."""
    if rel not in manifests:
        try:
            manifests[rel] = decode_manifest(remote.get(rel), rel)
        except (FileNotFoundError, ValueError):
            manifests[rel] = {}
    return manifest_blob_ids(manifests[rel])


def _keep_or_abandon_parts(
    remote: Remote, manifests: dict[str, dict[str, Any]], named: set[str], pending_ids: set[str] | None
) -> set[str]:
    """The blobs of the part manifests no commit names yet that are kept (see
    :func:`remove_unreferenced`); the abandoned ones lose their manifest and markers here."""
    referenced: set[str] = set()
    abandoned: set[str] = set()
    for name in remote.list("manifests"):
        rel = f"manifests/{name}"
        if rel in named or not is_manifest_file(name):
            continue
        cid = part_cid(name)
        if pending_ids is not None and cid is not None and cid not in pending_ids:
            abandoned.add(cid)
            remote.remove(rel)  # before its blobs: a manifest never names a missing blob
            manifests.pop(rel, None)
            continue
        referenced.update(_blobs_of(remote, manifests, rel))
    if abandoned:
        for name in remote.list(PARTS_DIR):
            if part_cid(name) in abandoned:
                remote.remove(f"{PARTS_DIR}/{name}")
        logger.info("remote: collected the uncommitted parts of %d abandoned checkpoint(s)", len(abandoned))
    return referenced


def _remove_pruned_manifests(
    remote: Remote, state: RemoteState, kept_manifests: set[str], manifests: dict[str, dict[str, Any]]
) -> None:
    """The manifests (every rank's part) and part markers of pruned checkpoints; a manifest a kept
    checkpoint also names stays."""
    for rec in state.records:
        if not rec.pruned:
            continue
        for rank, rel in enumerate(_manifests_of(rec)):
            if rel not in kept_manifests:
                remote.remove(rel)
                manifests.pop(rel, None)
            if rec.parts:
                remote.remove(f"{PARTS_DIR}/{marker_name(rec.step, rec.id, rank)}")


@dataclass
class PrunePlan:
    keep: list[CheckpointRecord] = field(default_factory=list)
    remove: list[CheckpointRecord] = field(default_factory=list)
    blobs_removed: int = 0


def prune_remote(
    remote: Remote,
    journal: RemoteJournal,
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
    journal.write(
        state.next_seq,
        {"event": "prune", "ids": [r.id for r in doomed], "steps": [r.step for r in doomed], "why": why},
    )
    state = journal.read()
    multi = bool(remote.list(PARTS_DIR))  # a multi-rank remote: keep the parts of pending steps
    plan.blobs_removed = remove_unreferenced(remote, state, list_blobs(remote), {}, keep_pending=multi)
    if say is not None:
        say(f"remote: pruned {len(doomed)} checkpoint(s), {plan.blobs_removed} blob(s)")
    return plan


class RemoteUnavailable(SmartckptError):
    """The remote cannot be reached or read (exit 1: the operation failed)."""


def connect(url: str) -> tuple[Remote, RemoteJournal, RemoteState]:
    """Open ``url`` and read its journal, for the CLI; one-line errors."""
    from smartckpt_cli.remote.backend import open_remote

    remote = open_remote(url)
    journal = RemoteJournal(remote)
    try:
        state = journal.read()
    except SmartckptError:
        raise
    except Exception as err:
        raise RemoteUnavailable(
            f"remote {display_url(url)} unreachable: {type(err).__name__}: {str(err)[:200]}"
        ) from None
    return remote, journal, state


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


def _rank_lag(remote: Remote, lag: list[CheckpointRecord]) -> list[dict[str, Any]]:
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
