"""Multi-rank save (two-phase commit) and restore (agreement on one step).

Save, on the background thread of every rank (:func:`persist_distributed`):

1. every rank hashes its staged entries and sends rank 0 one short hash per entry and its disk id
   (``<dir>/dir.id``); rank 0 plans (:func:`.distributed.plan_refs`) and sends each rank its own
   plan: the checkpoint id, which of its entries a lower rank on the same disk holds identically
   (not written again: the part manifest records ``{"ref": owner}``, so replicated DDP state is
   written once per disk), and whether it collects that disk's garbage;
2. every rank writes its blobs and its *part* manifest (``manifests/<step>-<id>-r<rank>.json``),
   durable, under the shared ``gc.lock``;
3. every rank reports durable or failed to rank 0, which appends the journal ``commit`` line,
   naming ``world_size`` and every part (manifest, hash, disk id), only when all reported durable;
4. rank 0 tells every rank whether it committed.

Four exchanges, each through rank 0: a rank sends and receives the same few messages per save at
any world size, and only its own entries' hashes and plan (rank 0 handles one message per rank
per exchange). Every rank makes every exchange even when its own write failed, so a failed rank
means "no commit" on all ranks, never a hang.

Restore, on the training thread of every rank, in the manager's ``read`` (engine/restoring.py):
rank 0 lists the candidates (:func:`restore_order`); for each, every rank loads and verifies its
own part (:func:`load_part`, resolving refs through the owner's part) and sends its verdict to
rank 0, which tells every rank the outcome (:func:`settle_restore`); the first step every rank can load is the one all ranks apply. A rank that cannot load its part
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
from smartckpt_cli.engine.distributed import Comm, dir_leaders, entry_hash, part_rel, plan_refs
from smartckpt_cli.engine.restore import Loaded, load_checkpoint, read_manifest
from smartckpt_cli.engine.snapshot import Snapshot
from smartckpt_cli.engine.writer import CommitInfo, Persister, Written
from smartckpt_cli.errors import CheckpointCorrupt, SmartckptError, StateMismatchError
from smartckpt_cli.state.precision import tensor_bytes
from smartckpt_cli.store import codec
from smartckpt_cli.store.blobs import BlobStore
from smartckpt_cli.store.journal import CheckpointRecord
from smartckpt_cli.store.ramarea import chunk_hashes
from smartckpt_cli.store.storage.base import Storage

__all__ = ["NotCommitted", "RankFailed", "persist_distributed", "restore_order", "settle_restore"]

logger = logging.getLogger(__name__)


class NotCommitted(SmartckptError):
    """A multi-rank save in which some rank's part did not become durable."""


class RankFailed(SmartckptError):
    """One rank's error, raised on every rank (it names the rank and the error)."""


_PROCESS = uuid.uuid4().hex  # this process, in a digest no other rank's can equal


def _digest(item: Any, known: dict[str, list[Any]], chunk_bytes: int) -> str:
    """What makes two ranks' entries the same: dtype, shape, precision and the hashes of their
    bytes cut in chunks. The chunks' hashes go to ``known`` (the snapshot's ``ram_hashes``) when
    the RAM tier did not make them already: the writer reuses them (each chunk hashed once)."""
    # The key is compared separately; dtype, shape and transform make equal bytes equal entries.
    head = f"{item.dtype}|{item.shape}|{item.plan.transform}|{item.plan.tier}|"
    if item.ref is not None:
        # Referenced from this rank's last part (engine/unchanged.py): kept in this rank's part,
        # never planned as a copy of another rank's (its bytes were not read, to compare).
        return head + f"own:{_PROCESS}:{item.plan.key}"
    # A save in pieces (engine/pager.py): not copied yet. A CPU tensor is hashed where it lives
    # (it cannot change before the pager copied it: the save call or the optimizer step waits);
    # one on a device would have to be copied to the host twice: this rank writes its own.
    source = item.tensor if item.live is None else item.live
    if item.live is not None and (source.device.type != "cpu" or not source.is_contiguous()):
        return head + f"own:{_PROCESS}:{item.plan.key}"
    chunks = known.get(item.plan.key)
    if chunks is None:
        chunks = chunk_hashes(tensor_bytes(source.contiguous()), chunk_bytes)
        known[item.plan.key] = chunks
    return head + codec.raw_hash(",".join(f"{n}:{h}" for n, h in chunks).encode())


def persist_distributed(
    p: Persister, snap: Snapshot, comm: Comm, dir_id: str, hold_gc: Callable[[], AbstractContextManager[Any]]
) -> tuple[CommitInfo, bool]:
    """Write this rank's part and take part in the commit; returns (CommitInfo, whether this rank
    collects its disk's garbage). Raises :class:`NotCommitted` (or this rank's own write error)
    when nothing was committed."""
    t0 = time.perf_counter()
    heard = comm.to_root({"hashes": _entry_hashes(p, snap), "dir": dir_id}, commit=True)
    plan = comm.from_root(_plans(heard) if heard is not None else None, commit=True)
    if plan.get("lost"):
        raise NotCommitted(
            f"save of step {snap.step} not committed: rank(s) {plan['lost']} could not stage their state"
        )
    cid = plan["cid"]
    refs = {int(i): int(owner) for i, owner in plan["refs"]}
    rel = part_rel(snap.step, cid, comm.rank)
    # Taken after the plan: a rank collecting garbage (exclusive) finishes before any rank can be
    # inside this save waiting on an exchange while holding the lock shared.
    with hold_gc():
        written, manifest_bytes, verdict, error = _write_part(p, snap, refs, cid, rel, comm, dir_id)
        verdicts = comm.to_root(verdict, commit=True)
        outcome: dict[str, Any] | None = None
        if verdicts is not None:  # rank 0
            why = _commit_on_rank0(p, snap, cid, verdicts, manifest_bytes, written)
            outcome = {"why": why, "health": _health(verdicts)}
        outcome = comm.broadcast(outcome, commit=True)
    if error is not None:
        raise error
    assert outcome is not None
    if outcome["why"] is not None:
        raise NotCommitted(f"save of step {snap.step} not committed: {outcome['why']}")
    assert written is not None
    info = CommitInfo(
        snap.step,
        cid,
        rel,
        written.bytes_new,
        written.bytes_total,
        written.bytes_raw,
        time.perf_counter() - t0,
        str(outcome["health"]),
        written.entries,
        tuple(written.changed),
        tuple(written.restage),
    )
    return info, bool(plan["gc"])


def _entry_hashes(p: Persister, snap: Snapshot) -> list[str] | None:
    """This rank's message of step 1: one short hash per entry; None when staging its state
    failed (said here: the rank still takes part in the exchange, the other ranks must not wait)."""
    try:
        snap.wait_ready()
        digests = p.pool.map(lambda it: _digest(it, snap.ram_hashes, p.chunk_bytes), snap.items)
        return [entry_hash(i.plan.key, d) for i, d in zip(snap.items, digests, strict=True)]
    except Exception as err:  # still take part in the exchange: the other ranks must not wait
        logger.error("step %d: staging this rank's state failed: %s", snap.step, err)
        return None


def _write_part(
    p: Persister, snap: Snapshot, refs: dict[int, int], cid: str, rel: str, comm: Comm, dir_id: str
) -> tuple[Written | None, bytes, dict[str, Any], BaseException | None]:
    """Step 2: this rank's blobs and part manifest durable, the entries a lower rank holds
    recorded as ``{"ref": owner}``. Returns what was written, the manifest's bytes, the verdict
    for rank 0, and the error: raised only after the exchanges, which every rank makes."""
    written: Written | None = None
    manifest_bytes = b""
    try:
        fault_fail("rank.write")
        written = p.write_entries(snap, [item for i, item in enumerate(snap.items) if i not in refs])
        for i, owner in refs.items():
            item = snap.items[i]
            written.entries[item.plan.key] = {"tier": item.plan.tier, "ref": owner}
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
        return written, manifest_bytes, {"ok": False, "error": f"{type(err).__name__}: {err}"[:300]}, err
    return written, manifest_bytes, verdict, None


def _plans(heard: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rank 0's answer to every rank's hashes (module docstring, step 1)."""
    lost = [r for r, h in enumerate(heard) if h["hashes"] is None]
    if lost:
        return [{"lost": lost}] * len(heard)
    cid = uuid.uuid4().hex[:12]
    dirs = [str(h["dir"]) for h in heard]
    leaders = dir_leaders(dirs)
    refs = plan_refs([h["hashes"] for h in heard], dirs)
    return [{"cid": cid, "refs": sorted(mine.items()), "gc": r in leaders} for r, mine in enumerate(refs)]


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
        p.commit(snap, cid, parts[0][0], manifest_bytes, total, world_size=len(verdicts), parts=parts)
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


def restore_order(comm: Comm, ids: list[str]) -> list[str]:
    """The checkpoint ids every rank tries, newest first: rank 0's ``ids`` (its view of the
    journal), the same on every rank."""
    return list(comm.broadcast(ids))


def settle_restore(comm: Comm, step: int | None, failure: BaseException | None) -> str | None:
    """Every rank's verdict on the candidate each has just tried to load (``failure``: this
    rank's, None when it loaded): None when every rank loaded it (every rank applies it), else the
    problems for which every rank falls back to the next one. Raises StateMismatchError on every
    rank when any rank's state cannot be carried, and RankFailed on every rank when any rank's
    load raised anything else (a MemoryError in an elastic read, a bug): one rank failing alone
    would leave the others waiting in the next collective until its timeout."""
    verdict: list[str] | None = None
    if isinstance(failure, CheckpointCorrupt):
        verdict = ["corrupt", str(failure)]
    elif isinstance(failure, StateMismatchError):
        verdict = ["refused", str(failure)]
    elif failure is not None:  # whatever it is, every rank hears of it at once
        verdict = ["error", f"{type(failure).__name__}: {str(failure)[:300]}"]
        logger.error("rank %d: restoring step %s failed", comm.rank, step, exc_info=failure)
    verdicts = comm.to_root(verdict)
    outcome = comm.broadcast(_restore_outcome(verdicts) if verdicts is not None else None)
    step_name = step if step is not None else "?"
    if outcome["failed"] is not None:
        raise RankFailed(f"{outcome['failed']} (restoring step {step_name}); every rank stops")
    if outcome["refused"] is not None:
        r, why = outcome["refused"]
        raise StateMismatchError(why if r == comm.rank else f"rank {r}: {why}")
    if outcome["bad"] is not None and comm.rank == 0:
        logger.warning(
            "checkpoint of step %s cannot be loaded on every rank (%s); all %d ranks fall back "
            "to the previous one together",
            step_name,
            outcome["bad"],
            comm.world,
        )
    return outcome["bad"]


def _restore_outcome(verdicts: list[list[str] | None]) -> dict[str, Any]:
    """Rank 0's reading of every rank's verdict on one candidate: any rank's error (every rank
    stops with it), the first refusal (every rank raises it), or the problems (every rank falls
    back), or none (every rank applies it)."""
    failed = [(r, v[1]) for r, v in enumerate(verdicts) if v is not None and v[0] == "error"]
    refused = [[r, v[1]] for r, v in enumerate(verdicts) if v is not None and v[0] == "refused"]
    bad = [(r, v[1]) for r, v in enumerate(verdicts) if v is not None]
    return {
        "failed": "; ".join(f"rank {r}: {why}" for r, why in failed) if failed else None,
        "refused": refused[0] if refused else None,
        "bad": "; ".join(f"rank {r}: {v}" for r, v in bad) if bad else None,
    }
