"""One checkpoint's manifest, tensor by tensor, for ``smartckpt inspect --step N``.

Separate from ``ops/catalog.py``, which lists every checkpoint of a store as one row each: this
reads the one manifest again and describes each entry (its dtype, shape, chunks, bytes raw and
on disk, a DTensor's global shape and placements) and whether the checkpoint can be carried to
another world size. Like the catalog it reads manifests only, never a blob, and never torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from smartckpt_cli.errors import UsageError
from smartckpt_cli.ops.catalog import Row, _is_sharded, dtensor_nodes, list_checkpoints
from smartckpt_cli.store.checkpoints import read_manifest
from smartckpt_cli.store.directory import StoreDir

__all__ = ["EntryRow", "ManifestDetail", "describe"]


@dataclass
class EntryRow:
    key: str
    tier: str
    dtype: str
    shape: list[int]
    stored_dtype: str
    transform: str
    chunks: int
    bytes_raw: int
    bytes_stored: int  # encoded, on disk
    patched: int  # values stored exactly beside a reduced-precision tensor
    global_shape: list[int] | None = None  # a DTensor's whole shape (``shape`` is rank 0's shard)
    placements: list[str] | None = None  # a DTensor's placements: ["S0"] = Shard(0), ["R"]


@dataclass
class ManifestDetail:
    row: Row
    manifest_path: str
    meta: dict[str, Any]
    objects: dict[str, str]  # name -> kind
    entries: list[EntryRow]
    not_stored: list[str]

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoint": self.row.to_json(),
            "manifest": self.manifest_path,
            "world_size": self.row.world_size,
            "sharded": self.row.sharded,
            "restorable_at_any_world_size": self.any_world_size,
            "meta": self.meta,
            "objects": self.objects,
            "entries": [asdict(e) for e in self.entries],
            "not_stored": self.not_stored,
        }

    @property
    def any_world_size(self) -> bool:
        """Whether an elastic restore can carry it to another world size: every DTensor on a
        1-D mesh, ``Shard(d)`` or ``Replicate`` (what ``engine/reshard.py`` reshards)."""
        return all(
            len(e.placements) == 1 and (e.placements[0] == "R" or _shard_dim(e.placements[0]) is not None)
            for e in self.entries
            if e.placements is not None
        )

    def sharding_line(self) -> str | None:
        """``world size 2: 12 tensors sharded (Shard(0)), shapes below are rank 0's shard;
        restorable at any world size``; None for a single-process checkpoint without DTensors."""
        r = self.row
        sharded = [e for e in self.entries if e.placements is not None and _is_sharded(e.placements)]
        if r.world_size == 1 and not sharded:
            return None
        line = f"world size {r.world_size}: "
        if sharded:
            kinds = sorted({", ".join(_placement_name(p) for p in e.placements or []) for e in sharded})
            line += f"{len(sharded)} tensors sharded ({'; '.join(kinds)}), shapes below are rank 0's shard"
        else:
            line += "no tensor sharded, every rank holds whole tensors (shapes below are rank 0's)"
        line += (
            "; restorable at any world size"
            if self.any_world_size
            else "; restorable at this world size only (a DTensor not on a 1-D mesh of Shard/Replicate)"
        )
        return line


def _shard_dim(p: str) -> int | None:
    return int(p[1:]) if p.startswith("S") and p[1:].isdigit() else None


def _placement_name(p: str) -> str:
    if p == "R":
        return "Replicate"
    dim = _shard_dim(p)
    return p if dim is None else f"Shard({dim})"


def describe(store: StoreDir, step: int) -> ManifestDetail:
    """The newest unpruned checkpoint of ``step``, tensor by tensor."""
    catalog = list_checkpoints(store)
    rows = [r for r in catalog.rows if r.step == step]
    if not rows:
        steps = ", ".join(str(r.step) for r in catalog.rows if r.state != "pruned") or "none"
        raise UsageError(f"no checkpoint of step {step} in this store (steps: {steps})")
    row = next((r for r in rows if r.state != "pruned"), rows[0])
    if row.state == "pruned":
        raise UsageError(f"step {step} was pruned; its manifest is gone")
    state = store.journal.read()
    rec = next(r for r in state.records if r.id == row.id)
    manifest = read_manifest(store.storage, rec, state.store_id)
    dts = dtensor_nodes(manifest)
    entries = []
    for key, e in manifest.get("entries", {}).items():
        chunks = list((e.get("data") or {}).get("chunks", []))
        patch = e.get("patch") or {}
        chunks += list(patch.get("chunks", []))
        entries.append(
            EntryRow(
                key=key,
                tier=str(e.get("tier")),
                dtype=str(e.get("dtype")),
                shape=[int(n) for n in e.get("shape", [])],
                stored_dtype=str(e.get("stored_dtype")),
                transform=str((e.get("transform") or {}).get("kind", "none")),
                chunks=len(chunks),
                bytes_raw=sum(int(c[2]) for c in chunks),
                bytes_stored=sum(int(c[4]) for c in chunks),
                patched=int(patch.get("n", 0)),
                global_shape=dts[key][0] if key in dts else None,
                placements=dts[key][1] if key in dts else None,
            )
        )
    objects = {name: str(o.get("kind")) for name, o in manifest.get("objects", {}).items()}
    meta = json.loads(json.dumps(manifest.get("meta", {})))
    return ManifestDetail(row, rec.manifest, meta, objects, entries, list(manifest.get("not_stored", [])))
