"""Read a checkpoint written by N ranks for rank ``r`` of M ranks (elastic resume).

What a new rank gets, by kind of state:

* **Sharded** (DTensor ``Shard(dim)`` on a 1-D mesh: FSDP2 parameters and every optimizer state
  tensor shaped like them): the rows of its new shard, copied from the old shards that overlap
  it (``state/shards.py``). For ``dim`` 0 of an entry stored exactly, only the chunks holding
  those rows are read and decoded, so each rank reads about its share of the checkpoint; other
  entries are decoded whole (one old shard at a time) and cut.
* **Replicated** (DDP weights and moments, ``Replicate`` DTensors, schedulers, grad scalers):
  from old rank ``r`` when it existed, else from old rank 0. Optimizer state that is neither
  sharded nor per element (``step``, scalars) must be equal on every old rank (compared by the
  hashes in the manifests, nothing read): what differs cannot be carried and is refused.
* **RNG**: ranks below ``min(N, M)`` keep their own generators; a rank that did not exist gets
  generators seeded from the checkpoint's step and its rank (:func:`derived_seed`), so the new
  world draws the same numbers every time it resumes from this checkpoint.
* **Data position**: old rank ``r``'s (or rank 0's) loader state; ``state/data.py`` sees the
  world size changed and deals the rest of the epoch to the new ranks.

Nothing here talks to other ranks: every new rank reads the old parts it needs from its own
``dir`` (all parts must therefore be readable from it: a shared or same-node ``dir``), and the
coordinator agrees on the step as for a same-size restore.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
import xxhash

from smartckpt_cli.engine.restore import decode_entry, decode_rows
from smartckpt_cli.errors import CheckpointCorrupt, StateMismatchError
from smartckpt_cli.state.apply import Loaded
from smartckpt_cli.state.shards import chunk_range, pieces, sharded_dim
from smartckpt_cli.state.tree import dtensor_specs, flatten
from smartckpt_cli.store.blobs import BlobStore
from smartckpt_cli.store.checkpoints import read_manifest
from smartckpt_cli.store.journal import CheckpointRecord
from smartckpt_cli.store.storage.base import Storage

__all__ = ["ReshardReport", "derived_seed", "load_resharded", "part_count", "sharded_entries"]

logger = logging.getLogger(__name__)


@dataclass
class ReshardReport:
    """What one rank's resharded restore did (the log line, and the figures of the bench)."""

    step: int
    old_world: int
    new_world: int
    rank: int
    resharded: int = 0
    replicated: int = 0
    bytes_read: int = 0
    bytes_stored: int = 0
    rng: str = "kept"
    parts_read: set[int] = field(default_factory=set)

    def line(self) -> str:
        keep = min(self.old_world, self.new_world)
        rng = f"RNG of ranks 0-{keep - 1} kept" if keep > 1 else "RNG of rank 0 kept"
        if self.new_world > self.old_world:
            rng += f", ranks {self.old_world}-{self.new_world - 1} seeded from the checkpoint"
        return (
            f"step {self.step}: written by {self.old_world} rank(s), restored on {self.new_world}: "
            f"{self.resharded} sharded tensor(s) resharded, {self.replicated} replicated, data "
            f"position carried, {rng}; rank {self.rank} read {self.bytes_read / 1e6:.1f} MB of "
            f"{self.bytes_stored / 1e6:.1f} MB stored"
        )


def part_count(record: CheckpointRecord) -> int:
    """How many ranks wrote ``record`` (1 for a single-process checkpoint)."""
    return record.world_size


def derived_seed(step: int, rank: int, base: bytes) -> int:
    """The seed of a rank that did not exist when the checkpoint was written: a function of the
    checkpoint (its step and old rank 0's torch generator) and the new rank only."""
    h = xxhash.xxh64(base)
    h.update(f"|{step}|{rank}".encode())
    return h.intdigest() & ((1 << 63) - 1)


def _seeded_rng_state(seed: int, saved_tree: Any) -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.Random(seed).getstate(),
        "torch": torch.Generator().manual_seed(seed).get_state(),
        "cuda_seed": seed,
    }
    if isinstance(saved_tree, dict) and "numpy" in saved_tree:
        state["numpy"] = np.random.RandomState(seed % (1 << 32)).get_state()
    return state


def sharded_entries(manifest: dict[str, Any]) -> dict[str, tuple[list[int], list[str]]]:
    """``{key: (global shape, placements)}`` of every DTensor entry of a manifest."""
    out: dict[str, tuple[list[int], list[str]]] = {}
    for obj in manifest.get("objects", {}).values():
        out.update(dtensor_specs(obj.get("tree")))
    return out


class _Parts:
    """The old parts' manifests, read once each, refs resolved (an entry identical on a lower
    rank of the same disk is recorded as a reference to it)."""

    def __init__(self, storage: Storage, record: CheckpointRecord, store_id: str | None) -> None:
        self.storage, self.record, self.store_id = storage, record, store_id
        self.parts: list[list[Any]] = (
            [[p.manifest, p.manifest_hash, p.dir_id] for p in record.parts]
            if record.parts
            else [[record.manifest, record.manifest_hash, None]]
        )
        self._raw: dict[int, dict[str, Any]] = {}

    def _read(self, q: int) -> dict[str, Any]:
        if not 0 <= q < len(self.parts):
            raise CheckpointCorrupt(
                f"step {self.record.step}: an entry refers to rank {q}, which has no part"
            )
        if q not in self._raw:
            rel, mhash = self.parts[q][0], self.parts[q][1]
            try:
                self._raw[q] = read_manifest(
                    self.storage, replace(self.record, manifest=rel, manifest_hash=mhash), self.store_id
                )
            except CheckpointCorrupt as err:
                raise CheckpointCorrupt(f"the part of old rank {q}: {err}", tier=err.tier) from None
        return self._raw[q]

    def entry(self, q: int, key: str) -> dict[str, Any]:
        entry = self._read(q)["entries"].get(key)
        seen = {q}
        while entry is not None and "ref" in entry:
            owner = int(entry["ref"])
            if owner in seen:
                break
            seen.add(owner)
            entry = self._read(owner)["entries"].get(key)
        if entry is None or "ref" in entry:
            raise CheckpointCorrupt(f"step {self.record.step}: old rank {q} has no entry {key}", tier="L1")
        return entry

    def manifest(self, q: int) -> dict[str, Any]:
        """Part ``q``'s manifest with every ref replaced by the entry it points to (a copy)."""
        m = dict(self._read(q))
        m["entries"] = {k: self.entry(q, k) for k in m["entries"]}
        return m


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    def sig(e: dict[str, Any]) -> Any:
        return (e["dtype"], list(e["shape"]), [c[3] for c in e["data"]["chunks"]], e.get("patch") is not None)

    return bool(sig(a) == sig(b))


def load_resharded(
    storage: Storage,
    blobs: BlobStore,
    record: CheckpointRecord,
    store_id: str | None,
    rank: int,
    world: int,
    *,
    skip_corrupt_l2: bool = False,
) -> tuple[Loaded, ReshardReport]:
    """Rank ``rank`` of ``world``'s state from a checkpoint written by any number of ranks.
    Raises CheckpointCorrupt (a part unreadable or damaged: the caller falls back) or
    StateMismatchError (the state cannot be carried to this world size: one line, the reason)."""
    parts = _Parts(storage, record, store_id)
    old = len(parts.parts)
    base = rank if rank < old else 0
    manifest = parts.manifest(base)
    entries: dict[str, dict[str, Any]] = manifest["entries"]
    report = ReshardReport(int(record.step), old, world, rank, parts_read={base})
    sharded = sharded_entries(manifest)
    kinds = {name: obj.get("kind") for name, obj in manifest["objects"].items()}
    tensors: dict[str, torch.Tensor] = {}
    skipped: set[str] = set()

    def fail(key: str, err: Exception) -> None:
        tier = entries[key]["tier"]
        if tier == "L2" and skip_corrupt_l2:
            skipped.add("L2")
            return
        raise CheckpointCorrupt(f"step {record.step}: {tier} entry {key}: {err}", tier=tier) from err

    for key, entry in entries.items():
        obj = key.split("/", 1)[0]
        if kinds.get(obj) == "rng" and rank >= old:
            continue  # replaced below
        placement = sharded.get(key)
        dim = sharded_dim(key, placement[1]) if placement is not None else None
        if dim is None:
            if kinds.get(obj) == "optimizer" and old > 1 and key not in sharded:
                _refuse_unless_same(parts, key, entry, base)
            whole = _read_replicated(blobs, key, entry, report, fail)
            if whole is not None:
                tensors[key] = whole
            continue
        assert placement is not None  # a dimension is only found in a placement
        shard = _read_shard(blobs, parts, key, entry, placement[0], dim, world, rank, report, fail)
        if shard is not None:
            tensors[key], out_shape = shard
            entries[key] = {**entry, "shape": out_shape}

    manifest["resharded_from"] = old  # apply: the data position and stateful loaders read it
    if rank >= old:
        _reseed(manifest, tensors, parts, record, rank, report)
    if "L2" in skipped:
        tensors = {k: t for k, t in tensors.items() if entries.get(k, {}).get("tier") != "L2"}
    mine = replace(record, manifest=parts.parts[base][0], manifest_hash=parts.parts[base][1])
    return Loaded(mine, manifest, tensors, skipped), report


def _refuse_unless_same(parts: _Parts, key: str, entry: dict[str, Any], base: int) -> None:
    """Optimizer state neither sharded nor per element (``step``, scalars) is carried only when
    every old rank holds the same (compared by the manifests' hashes, nothing read)."""
    for q in range(len(parts.parts)):
        if not _same(entry, parts.entry(q, key)):
            raise StateMismatchError(
                f"{key} differs between old ranks {base} and {q}: optimizer state that is "
                "neither sharded nor the same on every rank cannot be carried to another "
                "world size"
            )


def _read_replicated(
    blobs: BlobStore,
    key: str,
    entry: dict[str, Any],
    report: ReshardReport,
    fail: Callable[[str, Exception], None],
) -> torch.Tensor | None:
    """A replicated entry decoded whole from the base part; None when ``fail`` let it be skipped."""
    try:
        tensor, nbytes = decode_entry(blobs, key, entry)
    except (ValueError, KeyError, RuntimeError, OSError) as err:
        fail(key, err)
        return None
    report.bytes_read += nbytes
    report.bytes_stored += _encoded(entry)
    report.replicated += 1
    return tensor


def _read_shard(
    blobs: BlobStore,
    parts: _Parts,
    key: str,
    entry: dict[str, Any],
    shape: list[int],
    dim: int,
    world: int,
    rank: int,
    report: ReshardReport,
    fail: Callable[[str, Exception], None],
) -> tuple[torch.Tensor, list[int]] | None:
    """This rank's new shard of a ``Shard(dim)`` entry of global ``shape``, its rows copied from
    the old shards that overlap it, and its shape; None when ``fail`` let it be skipped."""
    old = len(parts.parts)
    length = shape[dim]
    out_shape = list(entry["shape"])
    lo, hi = chunk_range(length, world, rank)
    out_shape[dim] = hi - lo
    out = torch.empty(out_shape, dtype=_dtype(entry))
    try:
        for p in pieces(length, old, world, rank):
            src = parts.entry(p.old_rank, key)
            c, e = chunk_range(length, old, p.old_rank)
            if int(src["shape"][dim]) != e - c:
                raise StateMismatchError(
                    f"{key}: old rank {p.old_rank} holds {src['shape'][dim]} rows of dimension {dim} "
                    f"where Shard({dim}) over {old} ranks gives {e - c}: not a layout this version "
                    "can reshard"
                )
            rows, nbytes = decode_rows(blobs, key, src, dim, p.src_start, p.src_stop)
            out.narrow(dim, p.dst_start, p.src_stop - p.src_start).copy_(rows)
            report.bytes_read += nbytes
            report.parts_read.add(p.old_rank)
    except (ValueError, KeyError, RuntimeError, OSError) as err:
        fail(key, err)
        return None
    report.bytes_stored += sum(_encoded(parts.entry(q, key)) for q in range(old))
    report.resharded += 1
    return out, out_shape


def _encoded(entry: dict[str, Any]) -> int:
    return sum(
        int(c[4]) for stream in (entry["data"], entry.get("patch") or {}) for c in stream.get("chunks", [])
    )


def _dtype(entry: dict[str, Any]) -> torch.dtype:
    from smartckpt_cli.state.dtypes import lookup

    return lookup(entry["dtype"])


def _reseed(
    manifest: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    parts: _Parts,
    record: CheckpointRecord,
    rank: int,
    report: ReshardReport,
) -> None:
    """A new rank's generators: seeded from the checkpoint and the rank (module docstring)."""
    rng = next((n for n, o in manifest["objects"].items() if o.get("kind") == "rng"), None)
    if rng is None:
        return
    try:  # old rank 0's torch generator, by the raw hashes its manifest records (nothing read)
        base = "|".join(c[3] for c in parts.entry(0, f"{rng}/torch")["data"]["chunks"]).encode()
    except CheckpointCorrupt:
        base = b""
    seed = derived_seed(int(record.step), rank, base)
    tree, new = flatten(_seeded_rng_state(seed, manifest["objects"][rng]["tree"]), rng)
    manifest["objects"][rng] = {**manifest["objects"][rng], "tree": tree}
    for key in [k for k in manifest["entries"] if k.split("/", 1)[0] == rng]:
        del manifest["entries"][key]
    tensors.update(new)
    report.rng = f"seeded {seed}"
    logger.info(
        "rank %d did not exist at step %d: its generators are seeded with %d", rank, record.step, seed
    )
