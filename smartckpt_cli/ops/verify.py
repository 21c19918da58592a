"""Verify checkpoints without loading them anywhere: re-hash and decode every blob.

Order: the journal is read (under its shared lock, so a line being appended is not taken for a
torn one); each selected checkpoint's manifest is checked (present, its hash as committed, valid
JSON of this store, chunks covering every entry); then every distinct chunk is checked once on a
thread pool, however many checkpoints share it: size on disk, xxh3-128 of the encoded bytes = the
blob's name, decodable by its codec, xxh3-128 of the decoded bytes = the manifest's raw hash.
Hashing and zstd release the GIL, so the pool runs at the disk's pace rather than one core's.

A checkpoint a running job prunes while it is being verified is reported as such, not as corrupt:
its blobs may be gone by the time they are read. Nothing here writes; :func:`record_results`
(called by the CLI) appends the outcome to the journal so ``inspect`` can show it.

A checkpoint written by several ranks is checked part by part: every rank's part manifest this
directory holds (all of them on a shared ``dir``), with the blobs it references. A part written to
another disk (node-local ``dir``s: its dir id is not this directory's) cannot be read from here;
it is listed as elsewhere, not as damage: verify that node's directory (with the same
``--meta-dir``) to check it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from smartckpt_cli.errors import CheckpointCorrupt, StoreDamagedError, UsageError
from smartckpt_cli.store import codec
from smartckpt_cli.store.blobs import BlobStore
from smartckpt_cli.store.checkpoints import read_manifest
from smartckpt_cli.store.directory import StoreDir
from smartckpt_cli.store.journal import CheckpointRecord, JournalState
from smartckpt_cli.store.scrub import ScrubBook
from smartckpt_cli.store.storage import LocalStorage

__all__ = ["VerifyReport", "VerifyResult", "check", "record_results", "select", "verify", "verify_store"]

logger = logging.getLogger(__name__)

MAX_PROBLEMS = 5  # per checkpoint; the rest are counted


@dataclass
class VerifyResult:
    step: int
    id: str
    ok: bool
    problem: str | None = None  # every problem, joined: the one line printed per checkpoint
    problems: list[str] = field(default_factory=list)
    bytes: int = 0  # encoded bytes this checkpoint references
    note: str | None = None  # e.g. pruned by the running job while being verified
    ranks_checked: list[int] = field(default_factory=list)  # parts checked (several ranks)
    ranks_elsewhere: list[int] = field(default_factory=list)  # parts on another disk: not here


@dataclass
class VerifyReport:
    results: list[VerifyResult]
    journal_problems: list[str]
    bytes_checked: int  # distinct encoded bytes read and hashed
    seconds: float
    sound_blobs: list[str] = field(default_factory=list)  # re-hashed and found sound
    # checkpoints the journal lost: one line per cause (store/unjournalled.py)
    unjournalled: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results) and not self.journal_problems and not self.unjournalled


# (blob id, codec, raw length, raw hash, itemsize): one decode check, shared by every user.
_Task = tuple[str, str, int, str, int]


def select(
    state: JournalState, *, step: int | None = None, all_checkpoints: bool = False
) -> list[CheckpointRecord]:
    """Pure: which checkpoints to verify, newest first. Default: the newest live one; ``step``:
    every unpruned checkpoint of that step (rolled-back ones included); ``all_checkpoints``:
    every live one."""
    newest_first = sorted(state.records, key=lambda r: r.position, reverse=True)
    if step is None:
        live = [r for r in newest_first if r.live]
        return live if all_checkpoints else live[:1]
    hit = [r for r in newest_first if r.step == step and not r.pruned]
    if not hit:
        pruned = any(r.step == step for r in newest_first)
        steps = ", ".join(str(r.step) for r in newest_first if not r.pruned) or "none"
        raise UsageError(
            f"step {step} was pruned; nothing left to verify"
            if pruned
            else f"no checkpoint of step {step} in this store (steps: {steps})"
        )
    return hit


def _entry_tasks(key: str, entry: dict[str, Any]) -> tuple[list[tuple[_Task, int]], list[str]]:
    """The chunk checks of one manifest entry with their encoded sizes, and structural problems."""
    problems: list[str] = []
    tasks: list[tuple[_Task, int]] = []
    if "ref" in entry:  # a multi-rank part: stored once, in a lower rank's part
        return tasks, problems
    try:
        itemsize = codec.itemsize(entry["stored_dtype"])
        numel = 1
        for n in entry["shape"]:
            numel *= int(n)
        streams = [("data", entry["data"], itemsize, numel * itemsize)]
        patch = entry.get("patch")
        if patch:
            n = int(patch["n"])
            width = codec.itemsize(entry["dtype"])
            streams.append(("patch", patch, 1, n * 8 + n * width))
        for name, stream, size, expected in streams:
            covered = 0
            for bid, cod, raw_len, rh, enc_len in stream["chunks"]:
                tasks.append(((str(bid), str(cod), int(raw_len), str(rh), size), int(enc_len)))
                covered += int(raw_len)
            if covered != expected:
                problems.append(f"{name} chunks of {key} cover {covered} of {expected} bytes")
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        problems.append(f"entry {key} is malformed in the manifest ({type(err).__name__}: {err})")
    return tasks, problems


class _Checker:
    """Checks chunks; each thread reuses its own read and decode buffers."""

    def __init__(self, store: StoreDir) -> None:
        self.store = store
        self.local = threading.local()

    def _buffer(self, name: str, size: int) -> memoryview:
        buf = getattr(self.local, name, None)
        if buf is None or len(buf) < size:
            buf = bytearray(max(size, 1 << 20))
            setattr(self.local, name, buf)
        return memoryview(buf)[:size]

    def _read(self, bid: str) -> tuple[memoryview | None, str | None]:
        if not isinstance(self.store.storage, LocalStorage):
            return self._fetch(bid)  # an object store: one GET
        path = self.store.storage.path(BlobStore.rel(bid))
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None, f"missing blob {bid}"
        except OSError as err:
            return None, f"unreadable blob {bid}: {err.strerror}"
        try:
            size = os.fstat(fd).st_size
            view = self._buffer("enc", size)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, size, os.POSIX_FADV_SEQUENTIAL)
            got = 0
            while got < size:
                n = os.readv(fd, [view[got:]])
                if n == 0:
                    break
                got += n
            return view[:got], None
        except OSError as err:
            return None, f"unreadable blob {bid}: {err.strerror}"
        finally:
            os.close(fd)

    def _fetch(self, bid: str) -> tuple[memoryview | None, str | None]:
        try:
            return memoryview(self.store.storage.read(BlobStore.rel(bid))), None
        except FileNotFoundError:
            return None, f"missing blob {bid}"
        except Exception as err:  # an object store's own errors too (the remote went away)
            return None, f"unreadable blob {bid}: {type(err).__name__}: {str(err)[:200]}"

    def check(self, task: _Task) -> tuple[int, str | None]:
        """(encoded bytes read, the problem or None)."""
        bid, cod, raw_len, rh, itemsize = task
        data, problem = self._read(bid)
        if data is None:
            return 0, problem
        if codec.blob_id(data) != bid:
            return len(data), f"hash mismatch in blob {bid} ({len(data):,} bytes on disk)"
        out = np.frombuffer(self._buffer("raw", raw_len), dtype=np.uint8)
        try:
            decoded = codec.decode_into(cod, data, out, itemsize)
        except Exception as err:  # a corrupt zstd frame raises its own error types
            return len(data), f"undecodable chunk {bid}: {err}"
        if decoded != rh:
            return len(data), f"chunk {bid} decodes to bytes that do not match the manifest's raw hash"
        return len(data), None


def verify(
    store: StoreDir,
    *,
    step: int | None = None,
    all_checkpoints: bool = False,
    workers: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> VerifyReport:
    """Verify the selected checkpoints (see :func:`select`). ``progress(done, total)`` is called
    with encoded bytes from the calling thread. ``workers``: 0 = one per CPU, at least 4.
    Manifests no journal line names are reported too (store/unjournalled.py): a journal that
    lost checkpoints is not sound, whatever the checkpoints it still names are."""
    t0 = time.perf_counter()
    found = store.survey()
    blocking = found.blocking
    if blocking is not None:  # nothing in the journal to check: the one line is the answer
        raise StoreDamagedError(blocking.line(store.where, store.repair_command()))
    lost = [f.line(store.where, store.repair_command()) for f in found.findings]
    state, _ = store.journal.read_events(consistent=True)
    chosen = select(state, step=step, all_checkpoints=all_checkpoints)
    results, checked, sound = check(store, chosen, state.store_id, workers=workers, progress=progress)
    _recheck_pruned(store, results)
    for r in results:
        if r.problems and r.note is None:
            r.ok = False
            shown = sorted(r.problems)[:MAX_PROBLEMS]
            more = len(r.problems) - len(shown)
            r.problem = "; ".join(shown) + (f"; and {more} more" if more else "")
    return VerifyReport(results, state.problems, checked, time.perf_counter() - t0, sound, lost)


def check(
    store: StoreDir,
    chosen: list[CheckpointRecord],
    store_id: str | None,
    *,
    workers: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list[VerifyResult], int, list[str]]:
    """Check ``chosen`` (journal records, or records made for manifests no line names): one
    result each with its problems (``ok`` is set by the caller), the encoded bytes read, and
    the blobs found sound."""
    results = [VerifyResult(r.step, r.id, True) for r in chosen]
    uses = _Uses()
    here = store.dir_id()
    for i, rec in enumerate(chosen):
        for rank, part in _parts(store, rec, here, results[i]):
            _add_manifest(store, rec, rank, part, store_id, i, results[i], uses)
    checked, sound = _check_chunks(store, uses, results, workers, progress)
    return results, checked, sound


@dataclass
class _Uses:
    """Every distinct chunk check of the checkpoints being verified: who uses it (result index,
    tier, key) and its encoded size."""

    users: dict[_Task, list[tuple[int, str, str]]] = field(default_factory=dict)
    sizes: dict[_Task, int] = field(default_factory=dict)


def _add_manifest(
    store: StoreDir,
    rec: CheckpointRecord,
    rank: int | None,
    part: CheckpointRecord,
    store_id: str | None,
    i: int,
    result: VerifyResult,
    uses: _Uses,
) -> None:
    """Read one manifest (``part``: rank ``rank``'s of a multi-rank ``rec``, or ``rec``'s own)
    into ``result`` (result ``i``)'s problems and bytes, and its chunk checks into ``uses``, so
    that a chunk many checkpoints share is read once."""
    prefix = "" if rank is None else f"rank {rank}: "
    try:
        manifest = read_manifest(store.storage, part, store_id)
    except CheckpointCorrupt as err:
        result.problems.append(prefix + str(err).removeprefix(f"step {rec.step}: "))
        return
    except OSError as err:
        result.problems.append(f"{prefix}manifest {part.manifest} is unreadable: {err.strerror}")
        return
    entries = manifest.get("entries")
    if not isinstance(entries, dict):
        result.problems.append(f"{prefix}manifest {part.manifest} has no entries")
        return
    for key, entry in entries.items():
        tasks, problems = _entry_tasks(key, entry)
        tier = entry.get("tier", "?") if isinstance(entry, dict) else "?"
        result.problems.extend(f"{prefix}{tier} {p}" for p in problems)
        for task, enc_len in tasks:
            result.bytes += enc_len
            uses.users.setdefault(task, []).append((i, f"{prefix}{tier}", key))
            uses.sizes[task] = enc_len


def _check_chunks(
    store: StoreDir,
    uses: _Uses,
    results: list[VerifyResult],
    workers: int,
    progress: Callable[[int, int], None] | None,
) -> tuple[int, list[str]]:
    """Run every chunk check on the pool; a failed one is a problem of each result that uses
    it (once per result). Returns the encoded bytes read and the blobs found sound."""
    users, sizes = uses.users, uses.sizes
    total = sum(sizes.values())
    done = checked = 0
    checker = _Checker(store)
    n_workers = workers or max(4, os.cpu_count() or 1)
    # Largest first: the pool stays busy to the end instead of waiting on one big straggler.
    order = sorted(users, key=lambda t: sizes[t], reverse=True)
    sound: list[str] = []
    with ThreadPoolExecutor(max_workers=n_workers, thread_name_prefix="smartckpt-verify") as pool:
        futures = {pool.submit(checker.check, task): task for task in order}
        for fut in as_completed(futures):
            task = futures[fut]
            nbytes, problem = fut.result()
            checked += nbytes
            done += sizes[task]
            if progress is not None:
                progress(done, total)
            if problem is None:
                sound.append(task[0])
                continue
            seen: set[int] = set()
            for i, tier, key in users[task]:
                if i not in seen:
                    seen.add(i)
                    results[i].problems.append(f"{tier} entry {key}: {problem}")
    return checked, sound


def _parts(
    store: StoreDir, rec: CheckpointRecord, here: str | None, result: VerifyResult
) -> list[tuple[int | None, CheckpointRecord]]:
    """The manifests of ``rec`` to check from this directory: the one manifest of a
    single-process checkpoint (rank None), else every rank's part found here. Parts written to
    another disk go to ``result.ranks_elsewhere``; a part missing from its own disk stays in the
    list, so that reading it reports the damage."""
    if not rec.parts:
        return [(None, rec)]  # one process, or an invalid line (read_manifest names its fault)
    out: list[tuple[int | None, CheckpointRecord]] = []
    for rank, part in enumerate(rec.parts):
        rel, mhash, part_dir = part.manifest, part.manifest_hash, part.dir_id
        # In directories, a part on another node's disk is not damage; a URL holds every part.
        if store.url is None and part_dir != here and not store.storage.exists(rel):
            result.ranks_elsewhere.append(rank)
            continue
        result.ranks_checked.append(rank)
        out.append((rank, replace(rec, manifest=rel, manifest_hash=mhash)))
    return out


def _recheck_pruned(store: StoreDir, results: list[VerifyResult]) -> None:
    """A running job may prune a checkpoint (and collect its blobs) while it is being checked:
    that is not corruption. Failed checkpoints that the journal now says are pruned are noted."""
    if not any(r.problems for r in results):
        return
    state, _ = store.journal.read_events(consistent=True)
    pruned = {r.id for r in state.records if r.pruned}
    for r in results:
        if r.problems and r.id in pruned:
            r.note = "pruned by the running job while being verified; not checked"
            r.problems = []


def verify_store(
    store: StoreDir,
    *,
    step: int | None = None,
    all_checkpoints: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list[VerifyResult], list[str]]:
    """Returns (one result per checked checkpoint, journal problems); see :func:`verify`."""
    report = verify(store, step=step, all_checkpoints=all_checkpoints, progress=progress)
    return report.results, report.journal_problems


def record_results(store: StoreDir, report: VerifyReport) -> bool:
    """Append one ``verified`` event per checked checkpoint, so ``inspect`` can show when each
    was last verified and how it went. Best effort: a read-only store, or a journal with
    damaged lines (which appending would start repairing), is left as it is. Returns whether
    the results were recorded."""
    if report.journal_problems or report.unjournalled or not report.results:
        return False
    utc = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    try:
        for r in report.results:
            if r.note is not None:
                continue
            ev: dict[str, Any] = {"event": "verified", "id": r.id, "step": r.step, "ok": r.ok, "utc": utc}
            if r.problem:
                ev["problem"] = r.problem[:500]
            store.journal.append(ev)
    except OSError as err:
        logger.info("verification results not recorded: %s", err)
        return False
    if report.sound_blobs:  # when each blob was last found sound, for inspect (store/scrub.py)
        book = ScrubBook(store.meta)
        book.mark(report.sound_blobs)
        book.save(keep=set(store.blobs.all_ids()))
    return True
