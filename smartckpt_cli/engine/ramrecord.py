"""The RAM record's content: built from a snapshot when the RAM tier commits it, and read back
into a restore's :class:`~smartckpt_cli.state.apply.Loaded` when the RAM tier loads it.

Separate from ``engine/ramtier.py``, which owns the slots (layout, mapping, locks, cadence) and
decides when a record is written or read: this module only says what a record holds and what it
means to a restore, with no state of its own. The record's format and its checks are
``store/ramarea.py``'s.
"""

from __future__ import annotations

import os
import time
import uuid
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from smartckpt_cli.engine.snapshot import Item, Snapshot
from smartckpt_cli.state.apply import Loaded
from smartckpt_cli.state.dtypes import all_finite, dtype_name, lookup
from smartckpt_cli.state.precision import byte_view
from smartckpt_cli.store import ramarea
from smartckpt_cli.store.journal import CheckpointRecord
from smartckpt_cli.store.names import RAM_SLOTS

__all__ = ["copy_out", "loaded_from", "new_record", "record_entries", "snapshot_health"]


def snapshot_health(snap: Snapshot, pool: Executor) -> str:
    """The snapshot's health once its staged bytes are checked finite: weights (L1) first, then
    optimizer moments (L2), as the writer judges a checkpoint."""
    health = snap.health
    for tier, verdict in (("L1", "nonfinite-weights"), ("L2", "nonfinite-moments")):
        if health == "ok" and not all(
            pool.map(all_finite, [it.tensor for it in snap.staged if it.plan.tier == tier])
        ):
            health = verdict
    return health


def record_entries(
    snap: Snapshot,
    hashes: list[list[Any]],
    offsets: dict[str, int],
    held: dict[str, Any],
    slot: int,
) -> dict[str, Any]:
    """Every entry of the record: the staged items with their place in the slot and their chunks'
    ``hashes``; an unchanged (referenced) item keeps the entry ``held`` (the slot's previous
    record) gives it, which must sit where the current layout puts it."""
    staged: list[Item] = snap.staged
    entries = {
        it.plan.key: {
            "tier": it.plan.tier,
            "dtype": dtype_name(it.dtype),
            "shape": it.shape,
            "offset": offsets[it.plan.key],
            "nbytes": it.nbytes,
            "chunks": h,
        }
        for it, h in zip(staged, hashes, strict=True)
    }
    for it in snap.items:
        if it.tensor is None:  # unchanged, and in this slot already: its place and hashes
            entry = held.get(it.plan.key)
            if entry is None or entry["offset"] != offsets.get(it.plan.key):
                raise RuntimeError(f"{it.plan.key} is not in RAM slot {slot} as referenced")
            entries[it.plan.key] = entry
    return entries


def new_record(
    snap: Snapshot,
    entries: dict[str, Any],
    *,
    store_id: str,
    slot: int,
    slot_size: int,
    chunk_bytes: int,
    health: str,
    rank: int,
    world: int,
) -> dict[str, Any]:
    """The record naming slot ``slot`` as the RAM snapshot of ``snap`` (a new id, this time)."""
    return {
        "store_id": store_id,
        "id": uuid.uuid4().hex[:12],
        "step": snap.step,
        "slot": RAM_SLOTS[slot],
        "slot_size": slot_size,
        "chunk_bytes": chunk_bytes,
        "time": time.time(),
        "health": health,
        "calm": snap.calm,
        "reason": snap.reason,
        "score": snap.score,
        "rank": rank,
        "world_size": world,
        "pid": os.getpid(),
        "objects": snap.objects,
        "entries": entries,
        "not_stored": snap.dropped,
        "meta": snap.meta,
    }


def copy_out(rank_dir: Path, rec: dict[str, Any], workers: int) -> tuple[dict[str, torch.Tensor], str | None]:
    """``rec``'s tensors copied out of its slot, every chunk verified as it is copied, and the
    first failure (None: every chunk matched its hash)."""
    tensors = {key: torch.empty(e["shape"], dtype=lookup(e["dtype"])) for key, e in rec["entries"].items()}
    flat = {key: byte_view(t) for key, t in tensors.items()}

    def copy(key: str, at: int, chunk: memoryview) -> None:
        flat[key][at : at + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)

    with ramarea.reading(rank_dir, rec["slot"]) as view:
        bad = ramarea.verify(view, rec, copy, workers=workers)
    return tensors, bad


def loaded_from(rec: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Loaded:
    """A verified RAM snapshot as a restore applies it: a journal-like record and a manifest
    (``restored_from`` "ram"), no blob, no manifest file behind them."""
    lineage = (rec.get("meta") or {}).get("lineage")
    record = CheckpointRecord(
        int(rec["step"]),
        str(rec["id"]),
        "",
        "",
        -1,
        health=str(rec.get("health")),
        reason="ram",
        event={"lineage": lineage} if lineage else {},
    )
    manifest = {
        "store_id": rec["store_id"],
        "id": rec["id"],
        "step": rec["step"],
        "health": rec.get("health"),
        "calm": rec.get("calm", True),
        "meta": rec.get("meta") or {},
        "objects": rec["objects"],
        "entries": {
            k: {"tier": e["tier"], "dtype": e["dtype"], "shape": e["shape"]}
            for k, e in rec["entries"].items()
        },
        "not_stored": rec.get("not_stored") or [],
        "restored_from": "ram",
    }
    return Loaded(record, manifest, tensors, set())
