"""HOW a snapshot becomes a committed checkpoint, off the training thread.

Order (the DESIGN commit protocol):

1. reduce precision where the plan says so, split every tensor into chunks;
2. per chunk, on the worker pool: hash the raw bytes; reuse the blob of identical earlier content
   (frozen weights, unchanged buffers) or encode (byte-shuffle + zstd), hash, write, fsync;
3. fsync the blob directories, so every blob rename is durable;
4. write the manifest (tmp, fsync, rename, fsync dir);
5. append the journal ``commit`` line and fsync it: **the commit point**.

A crash before 5 leaves garbage that garbage collection removes; the previous checkpoint is
untouched because blobs are write-once and nothing committed is ever modified.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from smartckpt_cli._faults import fault_point
from smartckpt_cli.engine.snapshot import Snapshot
from smartckpt_cli.procutil import lower_priority
from smartckpt_cli.state import precision
from smartckpt_cli.state.dtypes import all_finite, dtype_name
from smartckpt_cli.store import codec
from smartckpt_cli.store.blobs import BlobStore
from smartckpt_cli.store.commit import CommitLine, commit, write_manifest
from smartckpt_cli.store.journal import MANIFEST_FORMAT, MANIFEST_VERSION, Journal, manifest_rel
from smartckpt_cli.store.scrub import Scrubber
from smartckpt_cli.store.storage import Pending
from smartckpt_cli.store.storage.base import Storage

__all__ = ["CommitInfo", "Persister", "Written"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CommitInfo:
    step: int
    id: str
    manifest: str
    bytes_new: int  # encoded bytes this checkpoint wrote
    bytes_total: int  # encoded bytes it references (shared ones included)
    bytes_raw: int  # bytes of the state before precision reduction and compression
    seconds: float
    health: str = "ok"
    # this rank's manifest entries, and the keys found changed behind their version counter
    # (engine/unchanged.py: what the next save may reference)
    entries: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    changed: tuple[str, ...] = ()
    restage: tuple[str, ...] = ()  # referenced entries whose blob is damaged: the next save copies them


@dataclass
class _Chunk:
    view: memoryview
    itemsize: int
    raw_hash: str | None = None  # known already: the RAM tier hashed these very bytes this save


class Persister:
    """Carries out snapshots; knows nothing of when or why they are taken."""

    def __init__(
        self,
        storage: Storage,
        blobs: BlobStore,
        journal: Journal,
        store_id: str,
        *,
        level: int,
        chunk_bytes: int,
        workers: int,
        nice: int = 10,
    ) -> None:
        self.storage, self.blobs, self.journal, self.store_id = storage, blobs, journal, store_id
        self.level, self.chunk_bytes = level, chunk_bytes
        self.workers, self._nice = max(1, workers), nice
        self.pool = self._new_pool()
        # (raw hash, raw length) -> (blob id, codec, encoded length): identical content is not
        # encoded again, let alone written.
        self.known: dict[tuple[str, int], tuple[str, str, int]] = {}
        self._begun: set[str] = set()  # blobs this save started writing (not yet named)
        self._damaged: set[str] = set()  # referenced blobs found damaged: the next write rewrites them
        self._begun_lock = threading.Lock()
        # Re-hashes a share of the blobs each save reuses (store/scrub.py); None: off.
        self.scrub: Scrubber | None = None
        self._last_new = 0  # bytes the previous save wrote new: the next one's scrub budget
        self.scrubbed: dict[str, Any] = {}  # what the last save's scrub did (store/scrub.py)

    def _new_pool(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(
            max_workers=self.workers,
            thread_name_prefix="smartckpt-enc",
            initializer=lower_priority,
            initargs=(self._nice,),
        )

    def tune(self, chunk_bytes: int, workers: int) -> None:
        """Chunk size and encoder threads for the state's size (engine/budget.py). Only between
        saves: the caller waited for the one in flight."""
        self.chunk_bytes = chunk_bytes
        if max(1, workers) != self.workers:
            self.workers = max(1, workers)
            old, self.pool = self.pool, self._new_pool()
            old.shutdown(wait=True)  # its threads' scratch goes with them

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    def remember(self, manifest: dict[str, Any]) -> None:
        """Seed the dedup index from a restored manifest, so a resumed run shares its blobs."""
        for entry in manifest.get("entries", {}).values():
            for stream in (entry.get("data"), entry.get("patch")):
                for bid, cod, raw_len, rh, enc_len in (stream or {}).get("chunks", []):
                    self.known[(rh, raw_len)] = (bid, cod, enc_len)

    def _streams(
        self, item_tensor: torch.Tensor, transform: str, known: list[Any] | None = None
    ) -> tuple[precision.Reduced, list[_Chunk], list[_Chunk]]:
        """``known``: ``[length, raw hash]`` of the tensor's bytes cut every chunk (the RAM
        tier's, of this snapshot): reused where the stored bytes are those bytes, cut the same."""
        red = precision.reduce(item_tensor, transform)
        data = self._split(precision.tensor_bytes(red.stored), red.stored.element_size())
        if (
            known is not None
            and red.transform == "none"
            and [len(c.view) for c in data] == [k[0] for k in known]
        ):
            for c, k in zip(data, known, strict=True):
                c.raw_hash = str(k[1])
        patch: list[_Chunk] = []
        if red.patch_index is not None and red.patch_value is not None:
            raw = (
                precision.tensor_bytes(red.patch_index).tobytes()
                + precision.tensor_bytes(red.patch_value).tobytes()
            )
            patch = self._split(memoryview(raw), 1)
        return red, data, patch

    def _split(self, view: memoryview, itemsize: int) -> list[_Chunk]:
        step = max(itemsize, self.chunk_bytes - self.chunk_bytes % itemsize)
        return [_Chunk(view[i : i + step], itemsize) for i in range(0, len(view), step)] or [
            _Chunk(view, itemsize)
        ]

    def _put(self, chunk: _Chunk) -> tuple[list[Any], Pending | None]:
        """Returns ([blob id, codec, raw len, raw hash, encoded len], the pending write of a new
        blob or None when identical content is already stored)."""
        raw_len = len(chunk.view)
        rh = chunk.raw_hash if chunk.raw_hash is not None else codec.raw_hash(chunk.view)
        hit = self.known.get((rh, raw_len))
        rewrite = False
        if hit is not None and hit[0] in self._damaged and hit[0] not in self._begun:
            rewrite = True  # found damaged while referenced (_scrub_referenced): written again now
        elif hit is not None and (hit[0] in self._begun or self.blobs.has(hit[0])):
            if hit[0] in self._begun or self.scrub is None or not self.scrub.wants(hit[0], hit[2]):
                return [hit[0], hit[1], raw_len, rh, hit[2]], None
            sound = self.blobs.verify(hit[0]) is None
            self.scrub.checked(hit[0], sound)
            if sound:
                return [hit[0], hit[1], raw_len, rh, hit[2]], None
            # Bit rot in a blob that later checkpoints keep referencing: written again below from
            # the live bytes (their raw hash is the one recorded), over the damaged file.
            rewrite = True
        # The pieces are written before this thread encodes its next chunk (they may live in the
        # thread's reusable plane buffers); a raw chunk's blob id is its raw hash, no second pass.
        name, parts = codec.encode_chunk_parts(chunk.view, chunk.itemsize, self.level)
        bid = rh if name == "raw" else codec.parts_id(parts)
        enc_len = sum(len(memoryview(p).cast("B")) for p in parts)
        with self._begun_lock:  # identical chunks in one save: write the blob once
            if bid in self._begun:
                self.known[(rh, raw_len)] = (bid, name, enc_len)
                return [bid, name, raw_len, rh, enc_len], None
            self._begun.add(bid)
        if rewrite and hit is not None and bid != hit[0]:
            logger.warning(
                "blob %s is damaged and encodes differently now (%s): checkpoints that reference it "
                "stay damaged; this one writes %s",
                hit[0],
                name,
                bid,
            )
        bid, pending = self.blobs.begin(parts, bid, rewrite=rewrite)
        if rewrite and hit is not None:
            self._damaged.discard(hit[0])
            if self.scrub is not None:  # what the save's log line and journal event report
                self.scrub.checked(hit[0], False)
        fault_point("blob.stored")
        self.known[(rh, raw_len)] = (bid, name, enc_len)
        return [bid, name, raw_len, rh, enc_len], pending

    def persist(self, snap: Snapshot) -> CommitInfo:
        t0 = time.perf_counter()
        snap.wait_ready()
        written = self.write_entries(snap, snap.items)
        cid = uuid.uuid4().hex[:12]
        rel = manifest_rel(snap.step, cid)
        manifest_bytes = self.write_manifest(snap, cid, rel, written)
        # IMPORTANT: the commit line is the commit point (store/commit.py). It is appended only
        # after every blob and the manifest are durable; before it, this checkpoint does not exist.
        self.commit(snap, cid, rel, manifest_bytes, written)
        return CommitInfo(
            snap.step,
            cid,
            rel,
            written.bytes_new,
            written.bytes_total,
            written.bytes_raw,
            time.perf_counter() - t0,
            written.health,
            written.entries,
            tuple(written.changed),
            tuple(written.restage),
        )

    def write_entries(self, snap: Snapshot, items: list[Any]) -> Written:
        """Phase 1 for ``items``: every blob durable; returns their manifest entries. A
        referenced item (unchanged since the last committed checkpoint: engine/unchanged.py) is
        that checkpoint's entry as it is: nothing read, hashed or written for it. A save in
        pieces (``snap.pager``, engine/pager.py) copies and writes the others a piece at a time."""
        referenced = [it for it in items if it.ref is not None]
        staged = [it for it in items if it.ref is None]
        self._begun.clear()
        if self.scrub is not None:
            self.scrub.begin_save(self._last_new)
        damaged = self._scrub_referenced(referenced)
        if snap.pager is None:
            written = self._write_staged(snap, staged)
        else:
            written = Written({}, 0, 0, 0, snap.health)
            for piece in snap.pager.pieces(snap, staged):
                written.add(self._write_staged(snap, piece))
        self._last_new = written.bytes_new
        if self.scrub is not None:
            self.scrubbed = self.scrub.end_save()
        written.restage = damaged
        for it in referenced:
            written.entries[it.plan.key] = dict(it.ref)
            written.bytes_total += sum(int(c[4]) for s in _streams_of(it.ref) for c in s)
            written.bytes_raw += it.nbytes
        # The rotation's share of referenced bytes, hashed again: other bytes than the entry's
        # mean the tensor changed behind its version counter (engine/unchanged.py).
        hashed = self.pool.map(lambda job: codec.raw_hash(precision.tensor_bytes(job[1])), snap.verify)
        written.changed = sorted(
            {key for (key, _, want), got in zip(snap.verify, hashed, strict=True) if got != want}
        )
        return written

    def _scrub_referenced(self, referenced: list[Any]) -> list[str]:
        """The scrub's share of the blobs referenced entries name (their bytes were not read:
        bit rot in them is found here). A damaged blob is written again from the live tensor by
        the next save, which copies it: the keys returned."""
        if self.scrub is None:
            return []
        again = []
        for it in referenced:
            for stream in _streams_of(it.ref):
                for c in stream:
                    bid, enc_len = str(c[0]), int(c[4])
                    if bid in self._damaged or not self.scrub.wants(bid, enc_len):
                        continue
                    if self.blobs.verify(bid) is None:
                        self.scrub.checked(bid, True)
                    else:  # reported as repaired by the save that writes it again
                        self._damaged.add(bid)
                        again.append(it.plan.key)
        return sorted(set(again))

    def _write_staged(self, snap: Snapshot, items: list[Any]) -> Written:
        """The blobs of ``items`` (their bytes staged) durable; their manifest entries."""
        known = snap.ram_hashes  # hashed once per save: by the RAM tier, when it took this snapshot
        reduced = list(
            self.pool.map(
                lambda it: self._streams(it.tensor, it.plan.transform, known.get(it.plan.key)), items
            )
        )
        jobs: list[_Chunk] = []
        layout: list[tuple[int, int, int]] = []  # per item: data chunk count, patch chunk count, patch n
        for red, data, patch in reduced:
            jobs.extend(data)
            jobs.extend(patch)
            n_patch = 0 if red.patch_index is None else red.patch_index.numel()
            layout.append((len(data), len(patch), n_patch))
        results = _gather([self.pool.submit(self._put, job) for job in jobs], lambda r: r[1])
        pending = [p for _, p in results if p is not None]
        _gather([self.pool.submit(p.finish) for p in pending], lambda _: None, cleanup=pending)
        health = snap.health
        # Committed for inspection, never restored by default: weights (L1), then optimizer
        # moments (L2), which would turn the weights into NaN at the first step after a resume.
        for tier, verdict in (("L1", "nonfinite-weights"), ("L2", "nonfinite-moments")):
            if health == "ok" and not all(
                self.pool.map(all_finite, [i.tensor for i in items if i.plan.tier == tier])
            ):
                health = verdict
        fault_point("blobs.durable")

        entries: dict[str, Any] = {}
        pos = 0
        bytes_new = sum(r[0][4] for r in results if r[1] is not None)
        bytes_total = sum(r[0][4] for r in results)
        bytes_raw = 0
        for item, (red, _, _), (n_data, n_pchunks, n_patch) in zip(items, reduced, layout, strict=True):
            data_chunks = [r[0] for r in results[pos : pos + n_data]]
            pos += n_data
            patch_chunks = [r[0] for r in results[pos : pos + n_pchunks]]
            pos += n_pchunks
            bytes_raw += item.tensor.numel() * item.tensor.element_size()
            entries[item.plan.key] = {
                "tier": item.plan.tier,
                "dtype": dtype_name(item.dtype),
                "shape": item.shape,
                "stored_dtype": dtype_name(red.stored.dtype),
                "transform": red.transform,
                "data": {"chunks": data_chunks},
                "patch": {"n": n_patch, "chunks": patch_chunks} if n_patch else None,
            }
        return Written(entries, bytes_new, bytes_total, bytes_raw, health)

    def write_manifest(
        self, snap: Snapshot, cid: str, rel: str, written: Written, extra: dict[str, Any] | None = None
    ) -> bytes:
        """Phase 2: the manifest durable (store/commit.py); returns its bytes."""
        if snap.before_manifest is not None:
            snap.before_manifest(snap)
        manifest = {
            "format": MANIFEST_FORMAT,
            "version": MANIFEST_VERSION,
            "store_id": self.store_id,
            "id": cid,
            "step": snap.step,
            "health": written.health,
            "calm": snap.calm,
            "meta": {**snap.meta, "reason": snap.reason, "score": snap.score, "utc": _utc_now()},
            "objects": snap.objects,
            "entries": written.entries,
            "not_stored": snap.dropped,
            **(extra or {}),
        }
        return write_manifest(self.storage, rel, manifest)[0]

    def commit(
        self,
        snap: Snapshot,
        cid: str,
        rel: str,
        manifest_bytes: bytes,
        written: Written,
        *,
        world_size: int | None = None,
        parts: list[list[str]] | None = None,
    ) -> None:
        """Phase 3, the commit point (store/commit.py). ``world_size`` and ``parts``: a commit of
        several ranks' parts (engine/multirank.py)."""
        commit(
            self.journal,
            CommitLine(
                step=snap.step,
                id=cid,
                manifest=rel,
                manifest_hash=codec.blob_id(manifest_bytes),
                health=written.health,
                calm=snap.calm,
                reason=snap.reason,
                score=snap.score,
                bytes_new=written.bytes_new,
                bytes_total=written.bytes_total,
                lineage=snap.meta.get("lineage") or None,
                world_size=world_size,
                parts=tuple(tuple(p) for p in parts) if parts is not None else None,
            ),
        )


@dataclass
class Written:
    """What phase 1 produced: manifest entries and byte counts."""

    entries: dict[str, Any]
    bytes_new: int
    bytes_total: int
    bytes_raw: int
    health: str
    changed: list[str] = field(default_factory=list)  # keys found changed behind their counter
    restage: list[str] = field(default_factory=list)  # referenced keys whose blob is damaged

    def add(self, piece: Written) -> None:
        """A piece of a save in pieces (engine/pager.py) added: a tensor cut over several pieces
        is one entry, its chunks in order."""
        for key, entry in piece.entries.items():
            have = self.entries.get(key)
            if have is None:
                self.entries[key] = entry
            else:
                have["data"]["chunks"].extend(entry["data"]["chunks"])
        self.bytes_new += piece.bytes_new
        self.bytes_total += piece.bytes_total
        self.bytes_raw += piece.bytes_raw
        if self.health == "ok":
            self.health = piece.health


def _streams_of(entry: dict[str, Any]) -> list[list[Any]]:
    return [list((entry.get(s) or {}).get("chunks", [])) for s in ("data", "patch")]


def _gather(futures: list[Any], pending_of: Any, cleanup: list[Pending] | None = None) -> list[Any]:
    """All results, or — when any task failed — abort every pending write (no temporary file or
    open descriptor outlives a failed save) and raise the first error."""
    results, error = [], None
    for f in futures:
        try:
            results.append(f.result())
        except BaseException as err:
            error = error or err
    if error is not None:
        for p in (cleanup or []) + [pending_of(r) for r in results if pending_of(r) is not None]:
            p.abort()
        raise error
    return results


def _utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
