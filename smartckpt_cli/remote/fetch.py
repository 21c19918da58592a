"""Restore from the remote tier: which checkpoint to try in which order (pure), and the
download of exactly what the local copy lacks.

Order (:func:`restore_order`): the local journal is the node's own truth, so its live
checkpoints are tried newest first, each repaired from the remote when its local copy fails.
Storage checkpoints the local journal has never heard of (a wiped disk, a replaced node) come
before them when their step is newer than everything local, after them otherwise. A checkpoint
the local journal pruned or rolled back is never taken from the remote.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from smartckpt_cli.errors import CheckpointCorrupt
from smartckpt_cli.store import codec
from smartckpt_cli.store.blobs import BlobStore
from smartckpt_cli.store.journal import CheckpointRecord, decode_manifest
from smartckpt_cli.store.storage.base import Storage

__all__ = ["Candidate", "Fetched", "fetch_checkpoint", "fetch_part", "manifest_blob_ids", "restore_order"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Candidate:
    record: CheckpointRecord
    where: str  # "local": try the local copy first | "remote": only the remote has it
    remote_copy: bool  # the remote holds a committed copy (to repair from)


def restore_order(
    local_live: list[CheckpointRecord],
    local_known: set[str],
    remote_live: list[CheckpointRecord],
) -> list[Candidate]:
    """Pure. ``local_live`` and ``remote_live`` newest first (each in its journal's order);
    ``local_known``: every id the local journal mentions, whatever its state."""
    remote_ids = {r.id for r in remote_live}
    newest_local = max((r.step for r in local_live), default=-1)
    only_remote = [r for r in remote_live if r.id not in local_known]
    ahead = [Candidate(r, "remote", True) for r in only_remote if r.step > newest_local]
    behind = [Candidate(r, "remote", True) for r in only_remote if r.step <= newest_local]
    local = [Candidate(r, "local", r.id in remote_ids) for r in local_live]
    return ahead + local + behind


def manifest_blob_ids(manifest: dict[str, Any]) -> list[str]:
    """Every blob a manifest references, in order, once each."""
    seen: dict[str, None] = {}
    for entry in manifest.get("entries", {}).values():
        for stream in (entry.get("data"), entry.get("patch")):
            for chunk in (stream or {}).get("chunks", []):
                seen[chunk[0]] = None
    return list(seen)


@dataclass
class Fetched:
    manifest: bool = False  # the manifest was downloaded
    blobs: int = 0  # blobs downloaded
    bytes: int = 0  # bytes downloaded
    kept: int = 0  # blobs that were already sound locally


def fetch_checkpoint(
    remote: Storage,
    storage: Storage,
    blobs: BlobStore,
    record: CheckpointRecord,
    *,
    workers: int = 4,
    only: set[str] | None = None,
) -> Fetched:
    """Make the local copy of ``record`` whole: download its manifest and every blob that is
    missing or fails its hash locally, and nothing else (``only``: the blobs of these entry keys).
    Raises CheckpointCorrupt when the remote copy is incomplete or damaged too, or when its commit
    object names things outside the format (nothing is fetched then)."""
    if record.invalid is not None:
        raise CheckpointCorrupt(record.invalid, tier="L1")
    done = Fetched()
    try:
        data = storage.read(record.manifest)
        local_ok = codec.blob_id(data) == record.manifest_hash
    except OSError:
        local_ok = False
    if not local_ok:
        try:
            data = remote.read(record.manifest)
        except FileNotFoundError as err:
            raise CheckpointCorrupt(f"step {record.step}: remote manifest is missing", tier="L1") from err
        if codec.blob_id(data) != record.manifest_hash:
            raise CheckpointCorrupt(f"step {record.step}: remote manifest hash mismatch", tier="L1")
        storage.write(record.manifest, data)
        done.manifest, done.bytes = True, len(data)
    try:
        manifest = decode_manifest(data, record.manifest)
    except ValueError as err:
        raise CheckpointCorrupt(f"step {record.step}: {err}", tier="L1") from err
    if only is not None:
        manifest = {"entries": {k: v for k, v in manifest.get("entries", {}).items() if k in only}}

    def one(bid: str) -> int:
        if blobs.verify(bid) is None:
            return -1
        try:
            blob = remote.read(blobs.rel(bid))
        except FileNotFoundError as err:
            raise CheckpointCorrupt(f"step {record.step}: remote blob {bid} is missing") from err
        if codec.blob_id(blob) != bid:
            raise CheckpointCorrupt(f"step {record.step}: remote blob {bid} hash mismatch")
        storage.write(blobs.rel(bid), blob)  # temp name, fsync, rename over a damaged copy
        return len(blob)

    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="smartckpt-fetch") as pool:
        for n in pool.map(one, manifest_blob_ids(manifest)):
            if n < 0:
                done.kept += 1
            else:
                done.blobs += 1
                done.bytes += n
    return done


def fetch_part(
    remote: Storage,
    storage: Storage,
    blobs: BlobStore,
    record: CheckpointRecord,
    rank: int,
    world: int,
    *,
    workers: int = 4,
) -> Fetched:
    """The local copy of what ``rank`` of ``world`` reads of a multi-rank checkpoint: at the same
    world size its own part, and of the lower rank that wrote an entry for it (``ref``) that
    entry only; at another world size (elastic resume) every part, which resharding reads."""
    if record.invalid is not None:
        raise CheckpointCorrupt(record.invalid, tier="L1")
    parts = (
        [[p.manifest, p.manifest_hash] for p in record.parts]
        if record.parts
        else [[record.manifest, record.manifest_hash]]
    )
    total = Fetched()

    def add(got: Fetched) -> None:
        total.manifest = total.manifest or got.manifest
        total.blobs, total.bytes, total.kept = (
            total.blobs + got.blobs,
            total.bytes + got.bytes,
            total.kept + got.kept,
        )

    def of(r: int) -> CheckpointRecord:
        return replace(record, manifest=parts[r][0], manifest_hash=parts[r][1])

    if record.world_size != world or rank >= len(parts):
        for r in range(len(parts)):
            add(fetch_checkpoint(remote, storage, blobs, of(r), workers=workers))
        return total
    add(fetch_checkpoint(remote, storage, blobs, of(rank), workers=workers))
    try:
        manifest = decode_manifest(storage.read(parts[rank][0]), parts[rank][0])
    except ValueError as err:
        raise CheckpointCorrupt(f"step {record.step}: {err}", tier="L1") from err
    refs: dict[int, set[str]] = {}
    for key, entry in manifest.get("entries", {}).items():
        if entry.get("ref") is not None:
            refs.setdefault(int(entry["ref"]), set()).add(key)
    for owner, keys in sorted(refs.items()):
        if owner >= len(parts):
            raise CheckpointCorrupt(f"step {record.step}: an entry refers to rank {owner}, which has no part")
        add(fetch_checkpoint(remote, storage, blobs, of(owner), workers=workers, only=keys))
    return total
