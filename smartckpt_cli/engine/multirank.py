"""Multi-rank save (two-phase commit) and restore (agreement on one step).

Save, on the background thread of every rank (:func:`persist_distributed`):

1. every rank hashes its staged entries and all ranks exchange the digests and their disk ids
   (``<dir>/dir.id``); an entry identical to one of a lower rank on the same disk is not written
   again, the part manifest records ``{"ref": owner}`` (replicated DDP state is written once);
2. every rank writes its blobs and its *part* manifest (``manifests/<step>-<id>-r<rank>.json``),
   durable, under the shared ``gc.lock``;
3. every rank reports durable or failed; rank 0 appends the journal ``commit`` line, naming
   ``world_size`` and every part (manifest, hash, disk id), only when all reported durable;
4. rank 0 tells every rank whether it committed.

Every rank makes every collective even when its own write failed, so a failed rank means "no
commit" on all ranks, never a hang.

Restore (:func:`restore_distributed`): rank 0 lists the candidates; for each, every rank loads and
verifies its own part (resolving refs through the owner's part) and all ranks exchange verdicts;
the first step every rank can load is the one all ranks apply. A rank that cannot load its part
(missing node-local disk, damage) makes all ranks fall back together, and the log says which rank
and why.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

from smartckpt_cli._faults import fault_fail
from smartckpt_cli.engine.distributed import Comm, entry_owner, part_rel
from smartckpt_cli.engine.restore import Loaded, load_checkpoint, read_manifest
from smartckpt_cli.engine.snapshot import Snapshot
from smartckpt_cli.engine.writer import CommitInfo, Persister, Written
from smartckpt_cli.errors import CheckpointCorrupt, SmartckptError, StateMismatchError
from smartckpt_cli.state.precision import tensor_bytes
from smartckpt_cli.store import codec
from smartckpt_cli.store.blobs import BlobStore
from smartckpt_cli.store.journal import CheckpointRecord
from smartckpt_cli.store.storage.base import Storage

__all__ = ["NotCommitted", "RankFailed", "persist_distributed", "restore_distributed"]

logger = logging.getLogger(__name__)


class NotCommitted(SmartckptError):
    """A multi-rank save in which some rank's part did not become durable."""


class RankFailed(SmartckptError):
    """One rank's error, raised on every rank (it names the rank and the error)."""


def _digest(item: Any) -> str:
    # The key is compared separately; dtype, shape and transform make equal bytes equal entries.
    head = f"{item.dtype}|{item.shape}|{item.plan.transform}|{item.plan.tier}|"
    return head + codec.raw_hash(tensor_bytes(item.tensor.contiguous()))


def persist_distributed(
    p: Persister, snap: Snapshot, comm: Comm, dir_id: str, hold_gc: Callable[[], AbstractContextManager[Any]]
) -> tuple[CommitInfo, list[str]]:
    """Write this rank's part and take part in the commit; returns (CommitInfo, every rank's disk
    id). Raises :class:`NotCommitted` (or this rank's own write error) when nothing was committed."""
    t0 = time.perf_counter()
    digests: dict[str, str] | None = None
    try:
        snap.wait_ready()
        digests = dict(zip([i.plan.key for i in snap.items], p.pool.map(_digest, snap.items), strict=True))
    except Exception as err:  # still take part in the exchange: the other ranks must not wait
        logger.error("step %d: staging this rank's state failed: %s", snap.step, err)
    first = comm.gather({"digests": digests, "dir": dir_id, "cid": uuid.uuid4().hex[:12]}, commit=True)
    lost = [r for r, g in enumerate(first) if g["digests"] is None]
    if lost:
        raise NotCommitted(
            f"save of step {snap.step} not committed: rank(s) {lost} could not stage their state"
        )
    cid = first[0]["cid"]
    dirs = [g["dir"] for g in first]
    all_digests = [g["digests"] for g in first]
    own, refs = [], {}
    for item in snap.items:
        owner = entry_owner(comm.rank, item.plan.key, all_digests, dirs)
        if owner == comm.rank:
            own.append(item)
        else:
            refs[item.plan.key] = {"tier": item.plan.tier, "ref": owner}
    rel = part_rel(snap.step, cid, comm.rank)
    error: BaseException | None = None
    written: Written | None = None
    manifest_bytes = b""
    # Taken after the digest exchange: a rank collecting garbage (exclusive) finishes before any
    # rank can be inside this save waiting on a collective while holding the lock shared.
    with hold_gc():
        try:
            fault_fail("rank.write")
            written = p.write_entries(snap, own)
            written.entries.update(refs)
            manifest_bytes = p.write_manifest(
                snap, cid, rel, written, extra={"rank": comm.rank, "world_size": comm.world}
            )
            verdict: dict[str, Any] = {
                "ok": True,
                "part": [rel, codec.blob_id(manifest_bytes), dir_id],
                "bytes": [written.bytes_new, written.bytes_total],
                "health": written.health,
            }
        except Exception as err:
            error = err
            verdict = {"ok": False, "error": f"{type(err).__name__}: {err}"[:300]}
        verdicts = comm.gather(verdict, commit=True)
        outcome: str | None = None
        if comm.rank == 0:
            outcome = _commit_on_rank0(p, snap, cid, verdicts, manifest_bytes, written)
        outcome = comm.broadcast(outcome, commit=True)
    if error is not None:
        raise error
    if outcome is not None:
        raise NotCommitted(f"save of step {snap.step} not committed: {outcome}")
    assert written is not None
    info = CommitInfo(
        snap.step,
        cid,
        rel,
        written.bytes_new,
        written.bytes_total,
        written.bytes_raw,
        time.perf_counter() - t0,
        _health(verdicts),
    )
    return info, dirs


def _health(verdicts: list[dict[str, Any]]) -> str:
    bad = [v["health"] for v in verdicts if v.get("health", "ok") != "ok"]
    return bad[0] if bad else "ok"


def _commit_on_rank0(
    p: Persister,
    snap: Snapshot,
    cid: str,
    verdicts: list[dict[str, Any]],
    manifest_bytes: bytes,
    written: Written | None,
) -> str | None:
    """The commit point of a multi-rank save; returns why it did not commit, or None."""
    failed = [(r, v["error"]) for r, v in enumerate(verdicts) if not v["ok"]]
    if failed:
        return "; ".join(f"rank {r}: {e}" for r, e in failed)
    assert written is not None
    total = Written(
        {},
        sum(v["bytes"][0] for v in verdicts),
        sum(v["bytes"][1] for v in verdicts),
        written.bytes_raw,
        _health(verdicts),
    )
    parts = [v["part"] for v in verdicts]
    try:
        p.commit(
            snap, cid, parts[0][0], manifest_bytes, total, extra={"world_size": len(verdicts), "parts": parts}
        )
    except Exception as err:
        return f"rank 0 could not append the commit line: {type(err).__name__}: {err}"
    return None


# ---------------------------------------------------------------------- restore


def load_part(
    storage: Storage,
    blobs: BlobStore,
    record: CheckpointRecord,
    store_id: str | None,
    rank: int,
    dir_id: str,
    *,
    skip_corrupt_l2: bool,
    workers: int,
) -> Loaded:
    """Load and verify ``rank``'s part of a multi-rank checkpoint (refs resolved)."""
    if record.invalid is not None:
        raise CheckpointCorrupt(record.invalid, tier="L1")
    parts = record.parts or ()
    if rank >= len(parts):
        raise CheckpointCorrupt(f"step {record.step}: no part for rank {rank}", tier="L1")
    rel, mhash, part_dir = parts[rank].manifest, parts[rank].manifest_hash, parts[rank].dir_id
    if part_dir != dir_id and not storage.exists(rel):
        # Written to another disk and not here: a part fetched from the remote tier is here.
        raise CheckpointCorrupt(
            f"step {record.step}: the part of rank {rank} was written to another disk "
            f"(dir id {part_dir}; this rank's dir is {dir_id})",
            tier="L1",
        )
    mine = replace(record, manifest=rel, manifest_hash=mhash)
    manifest = read_manifest(storage, mine, store_id)
    owners: dict[int, dict[str, Any]] = {}
    for key, entry in list(manifest["entries"].items()):
        owner = entry.get("ref")
        if owner is None:
            continue
        if owner not in owners:
            if owner >= len(parts):
                raise CheckpointCorrupt(
                    f"step {record.step}: entry {key} refers to rank {owner}, which has no part", tier="L1"
                )
            owned = parts[owner]
            owners[owner] = read_manifest(
                storage, replace(record, manifest=owned.manifest, manifest_hash=owned.manifest_hash), store_id
            )
        try:
            manifest["entries"][key] = owners[owner]["entries"][key]
        except KeyError:
            raise CheckpointCorrupt(
                f"step {record.step}: entry {key} refers to rank {owner}, whose part lacks it", tier="L1"
            ) from None
    return load_checkpoint(
        storage, blobs, mine, store_id, skip_corrupt_l2=skip_corrupt_l2, workers=workers, manifest=manifest
    )


def restore_distributed(
    comm: Comm,
    records: list[CheckpointRecord],
    load: Any,
) -> Loaded | None:
    """The newest of ``records`` (rank 0's list, newest first) that every rank can load; ``load``
    (record -> Loaded) loads this rank's part, resharded when the checkpoint was written at another
    world size. Returns None when there is none; raises StateMismatchError on every rank when any
    rank's state cannot be carried, and RankFailed on every rank when any rank's load raised
    anything else (a MemoryError in an elastic read, a bug): one rank failing alone would leave
    the others waiting in the next collective until its timeout."""
    ids = comm.broadcast([r.id for r in records])
    by_id = {r.id: r for r in records}
    tried: list[str] = []
    for cid in ids:
        rec = by_id.get(cid)
        verdict: list[str] | None = None
        loaded: Loaded | None = None
        if rec is None:
            verdict = ["corrupt", "not in this rank's view of the journal"]
        else:
            try:
                fault_fail("rank.restore")
                loaded = load(rec)
            except CheckpointCorrupt as err:
                verdict = ["corrupt", str(err)]
            except StateMismatchError as err:
                verdict = ["refused", str(err)]
            except Exception as err:  # whatever it is, every rank hears of it at once
                verdict = ["error", f"{type(err).__name__}: {str(err)[:300]}"]
                logger.error("rank %d: restoring step %d failed", comm.rank, rec.step, exc_info=err)
        verdicts = comm.gather(verdict)
        failed = [(r, v[1]) for r, v in enumerate(verdicts) if v is not None and v[0] == "error"]
        if failed:
            step_name = rec.step if rec is not None else "?"
            raise RankFailed(
                "; ".join(f"rank {r}: {why}" for r, why in failed)
                + f" (restoring step {step_name}); every rank stops"
            )
        refused = [(r, v[1]) for r, v in enumerate(verdicts) if v is not None and v[0] == "refused"]
        if refused:
            r, why = refused[0]
            raise StateMismatchError(why if r == comm.rank else f"rank {r}: {why}")
        bad = [(r, v[1]) for r, v in enumerate(verdicts) if v is not None]
        if not bad:
            return loaded
        step = rec.step if rec is not None else "?"
        msg = "; ".join(f"rank {r}: {v}" for r, v in bad)
        tried.append(msg)
        if comm.rank == 0:
            logger.warning(
                "checkpoint of step %s cannot be loaded on every rank (%s); all %d ranks fall back "
                "to the previous one together",
                step,
                msg,
                comm.world,
            )
    if tried:
        raise CheckpointCorrupt(
            f"no checkpoint loads on every rank ({len(tried)} tried); newest problem: {tried[0]}", tier="L1"
        )
    return None
