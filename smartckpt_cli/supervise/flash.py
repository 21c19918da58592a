"""Flash persist: ``smartckpt run`` writes the RAM snapshot of a dead training process to the store
itself, so that a later restart anywhere (another node, after the run) finds it. No torch.

The RAM tier (``store/ramarea.py``) holds each rank's newest snapshot in shared memory that the
supervisor owns. When the training process dies holding one newer than the newest checkpoint on
disk, :func:`flash_persist` writes it through the store's own commit protocol, as the training's
saves do (``engine/writer.py``): every chunk re-hashed against the record (a damaged snapshot is
never persisted: one line names the entry and chunk), encoded with the store's codec, written as a
content-addressed blob (tmp, fsync, rename), then the manifest (of one process, or one part per
rank with the commit line naming them all), then the journal ``commit`` line: **the commit
point**. Names come from ``store/names.py``; every file goes through the Storage interface.

Order of calls (the supervisor's, ``ramowner.py``): :func:`take` between the death and the next
start (the slots read are locked shared), then :func:`flash_persist`, before the next attempt
starts: nothing else appends to the journal meanwhile. It holds the store's ``gc.lock`` shared
while it writes, as a save does.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from smartckpt_cli.procutil import lower_priority
from smartckpt_cli.store import codec, ramarea
from smartckpt_cli.store.commit import CommitLine, commit, write_manifest
from smartckpt_cli.store.directory import StoreDir
from smartckpt_cli.store.journal import MANIFEST_FORMAT, MANIFEST_VERSION
from smartckpt_cli.store.names import manifest_rel, part_rel
from smartckpt_cli.store.retention import GC_LOCK

__all__ = ["FlashError", "Held", "flash_persist", "take"]

logger = logging.getLogger(__name__)


class FlashError(Exception):
    """Why a RAM snapshot was not persisted (one line)."""


@dataclass
class Held:
    """The RAM snapshot(s) of a dead attempt, locked for reading: one record and slot per rank."""

    records: list[dict[str, Any]]
    views: list[memoryview]
    _stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    @property
    def step(self) -> int:
        return int(self.records[0]["step"])

    def release(self) -> None:
        self._stack.close()


def _rank_dirs(area: Path) -> list[Path]:
    found = []
    for p in area.glob("rank*"):
        rank = p.name[4:]
        if rank.isdigit() and p.name == f"rank{int(rank)}" and p.is_dir():
            found.append((int(rank), p))
    return [p for _, p in sorted(found)]


def take(area: Path, store_id: str | None, newest_disk: int) -> Held | str | None:
    """The RAM snapshot to persist, locked (every rank's of one step), or the line saying why
    there is none worth it; None when there is nothing newer than the disk's ``newest_disk``."""
    stack = contextlib.ExitStack()
    records: list[dict[str, Any]] = []
    views: list[memoryview] = []
    try:
        for rank_dir in _rank_dirs(area):
            for _ in range(3):  # the record may move to the other slot while the lock is taken
                rec = ramarea.read_record(rank_dir)
                if rec is None:
                    break
                inner = contextlib.ExitStack()
                view = inner.enter_context(ramarea.reading(rank_dir, rec["slot"]))
                again = ramarea.read_record(rank_dir)
                if again is not None and again.get("id") == rec["id"]:
                    stack.enter_context(inner)
                    records.append(rec)
                    views.append(view)
                    break
                inner.close()
            else:
                raise FlashError(f"{rank_dir}: the RAM snapshot kept changing while it was read")
        if not records or max(int(r["step"]) for r in records) <= newest_disk:
            stack.close()
            return None
        steps = {int(r["step"]) for r in records}
        world = int(records[0].get("world_size", 1))
        if (
            len(steps) != 1
            or len(records) != world
            or any(int(r.get("rank", -1)) != n for n, r in enumerate(records))
        ):
            stack.close()
            return (
                f"the RAM snapshots here are of steps {sorted(steps)} for {len(records)} of {world} rank(s): "
                f"not persisted (the disk's newest is step {newest_disk})"
            )
        if store_id is not None and any(r["store_id"] != store_id for r in records):
            stack.close()
            return "the RAM snapshot belongs to another store: not persisted"
        if any(r.get("health") != "ok" for r in records):
            stack.close()
            return (
                f"the RAM snapshot of step {records[0]['step']} is {records[0].get('health')}: not persisted"
            )
    except (OSError, ValueError, FlashError) as err:
        stack.close()
        return f"the RAM snapshot cannot be read ({err}): not persisted"
    return Held(records, views, stack)


def flash_persist(
    store: StoreDir, held: Held, *, level: int, workers: int = 2, nice: int = 0
) -> tuple[int, str, float]:
    """Write ``held`` to ``store`` as a committed checkpoint (module docstring); returns (step,
    manifest, seconds). Raises :class:`FlashError` (one line) when a chunk fails its hash or the
    store cannot take it; nothing half-written is ever committed. ``nice``: the CPU priority of
    the threads that hash and encode, lowered while a restarted process needs the cores."""
    t0 = time.perf_counter()
    state = store.journal.read()
    store_id = state.store_id
    if store_id is None:
        raise FlashError(f"{store.meta_root} has no journal")
    cid = uuid.uuid4().hex[:12]
    step = held.step
    world = len(held.records)
    with (
        store.lock(GC_LOCK, shared=True),
        ThreadPoolExecutor(
            max(1, workers), "smartckpt-flash", initializer=lower_priority, initargs=(nice,)
        ) as pool,
    ):
        written: list[tuple[str, str, int, int]] = []  # (manifest, its hash, new bytes, bytes)
        for rank, (rec, view) in enumerate(zip(held.records, held.views, strict=True)):
            entries, new, total = _write_blobs(store, rec, view, level, pool)
            rel = manifest_rel(step, cid) if world == 1 else part_rel(step, cid, rank)
            extra = {} if world == 1 else {"rank": rank, "world_size": world}
            manifest = _manifest(rec, store_id, cid, step, entries, extra)
            mhash = write_manifest(store.storage, rel, manifest)[1]
            written.append((rel, mhash, new, total))
        # IMPORTANT: the commit line is the commit point (store/commit.py); every blob and
        # manifest above is durable before it, and before it this checkpoint does not exist.
        rec0 = held.records[0]
        dir_id = store.dir_id() if world > 1 else None
        commit(
            store.journal,
            CommitLine(
                step=step,
                id=cid,
                manifest=written[0][0],
                manifest_hash=written[0][1],
                calm=bool(rec0.get("calm", True)),
                reason="flash persist",
                bytes_new=sum(w[2] for w in written),
                bytes_total=sum(w[3] for w in written),
                lineage=(rec0.get("meta") or {}).get("lineage") or None,
                world_size=world if world > 1 else None,
                parts=tuple((rel, mh, *([dir_id] if dir_id else [])) for rel, mh, _, _ in written)
                if world > 1
                else None,
            ),
        )
    return step, written[0][0], time.perf_counter() - t0


def _write_blobs(
    store: StoreDir, rec: dict[str, Any], view: memoryview, level: int, pool: ThreadPoolExecutor
) -> tuple[dict[str, Any], int, int]:
    """Every chunk of one rank's record, verified and written; (manifest entries, new bytes, bytes)."""
    jobs = []
    for key, e in rec["entries"].items():
        pos = int(e["offset"])
        item = codec.itemsize(e["dtype"])
        for n, (length, rh) in enumerate(e["chunks"]):
            jobs.append((key, n, pos, int(length), str(rh), item))
            pos += int(length)

    def put(job: tuple[str, int, int, int, str, int]) -> tuple[list[Any], int]:
        key, n, pos, length, rh, item = job
        data = view[pos : pos + length]
        if codec.raw_hash(data) != rh:
            raise FlashError(
                f"entry {key} chunk {n} of the RAM snapshot of step {rec['step']} fails its hash"
            )
        name, parts = codec.encode_chunk_parts(data, item, level)
        bid = rh if name == "raw" else codec.parts_id(parts)
        enc_len = sum(len(memoryview(p).cast("B")) for p in parts)
        bid, pending = store.blobs.begin(parts, bid)
        if pending is not None:
            try:
                pending.finish()
            except BaseException:
                pending.abort()
                raise
        return [bid, name, length, rh, enc_len], enc_len if pending is not None else 0

    results = list(pool.map(put, jobs))
    entries: dict[str, Any] = {}
    for (key, _n, _p, _l, _h, _i), (chunk, _) in zip(jobs, results, strict=True):
        e = rec["entries"][key]
        if key not in entries:
            entries[key] = {
                "tier": e["tier"],
                "dtype": e["dtype"],
                "shape": e["shape"],
                "stored_dtype": e["dtype"],
                "transform": {"kind": "none"},
                "data": {"chunks": []},
                "patch": None,
            }
        entries[key]["data"]["chunks"].append(chunk)
    return entries, sum(r[1] for r in results), sum(r[0][4] for r in results)


def _manifest(
    rec: dict[str, Any], store_id: str, cid: str, step: int, entries: dict[str, Any], extra: dict[str, Any]
) -> dict[str, Any]:
    meta = dict(rec.get("meta") or {})
    meta.update(
        reason="flash persist",
        score=None,
        utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        flash={"snapshot": rec["id"], "taken": rec.get("time"), "pid": rec.get("pid")},
    )
    return {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "store_id": store_id,
        "id": cid,
        "step": step,
        "health": "ok",
        "calm": bool(rec.get("calm", True)),
        "meta": meta,
        "objects": rec["objects"],
        "entries": entries,
        "not_stored": rec.get("not_stored") or [],
        **extra,
    }
