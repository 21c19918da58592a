"""The background uploader: ships committed local checkpoints to the remote, in commit order.

One round (:meth:`Replicator.run_round`), started by a commit (``wake``) or by a timer:

1. read both journals; :func:`plan_round` (pure) says which local commits the remote lacks,
   and which remote checkpoints were rolled back locally;
2. for each missing commit, oldest first: upload the blobs the remote does not have (each one
   re-hashed first: a blob damaged on the local disk is never shipped), then the manifest, then
   the ``commit`` object. IMPORTANT: the commit object is written last, only after every blob
   and the manifest are there; it is the remote commit point;
3. remote retention (``remote_keep_last``).

With several ranks (``world > 1``, :mod:`.parts`) every rank runs one, for its own part: a round
(:meth:`Replicator._round_parts`) uploads the part's blobs and part manifest, then writes its
marker; rank 0's round also writes the ``commit`` object of each step whose every part is marked,
and then, holding ``remote.lock`` exclusively (the ranks' rounds hold it shared), retention.

Every remote call is retried with backoff; a round that still fails is retried later with a
growing delay, so a remote that is down or slow delays replication, never training. The thread
runs at the background priority and never holds a lock the training loop waits for.

It stays one module (about 570 lines with the multi-rank round): the round's upload order, the
retries around each call and the status it reports are one piece of state around one commit
point, and read best in one place (the pure parts, :func:`plan_round` and :mod:`.parts`, are
separate).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from smartckpt_cli._faults import fault_fail
from smartckpt_cli.remote.backend import Limiter, Remote, display_url
from smartckpt_cli.remote.check import REMOTE_LOCK, list_blobs, remove_unreferenced, upload_lag
from smartckpt_cli.remote.fetch import manifest_blob_ids
from smartckpt_cli.remote.parts import (
    PARTS_DIR,
    abandoned_before,
    marker_body,
    marker_name,
    missing_markers,
    record_parts,
    status_name,
)
from smartckpt_cli.remote.rjournal import RemoteJournal, RemoteState
from smartckpt_cli.store import codec
from smartckpt_cli.store.directory import StoreDir
from smartckpt_cli.store.journal import CheckpointRecord, JournalState, decode_manifest
from smartckpt_cli.store.retention import select_prunable
from smartckpt_cli.store.storage.local import file_lock

__all__ = ["RemoteMismatch", "Replicator", "RoundPlan", "plan_round"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
IDLE_POLL = 30.0  # seconds between rounds when nothing wakes the uploader
MAX_BACKOFF = 30.0


class RemoteMismatch(Exception):
    """The remote holds another store's checkpoints: never mix them."""


@dataclass
class RoundPlan:
    upload: list[CheckpointRecord] = field(default_factory=list)  # oldest first
    withdraw: list[CheckpointRecord] = field(default_factory=list)  # rolled back locally


def plan_round(local: JournalState, remote: RemoteState, skip: set[str] | None = None) -> RoundPlan:
    """Pure: what one round must do to bring the remote up to the local journal."""
    bad = skip or set()
    remote_live = remote.live_ids()
    upload = [r for r in upload_lag(local.records, remote_live) if r.id not in bad]
    rolled_back = {r.id for r in local.records if r.rolled_back}
    withdraw = [r for r in remote.live() if r.id in rolled_back]
    return RoundPlan(upload, withdraw)


class LocalBlobGone(Exception):
    """A blob vanished locally mid-upload (local retention pruned its checkpoint)."""


@dataclass
class _Status:
    pending: int = 0
    pending_steps: list[int] = field(default_factory=list)
    remote_steps: list[int] = field(default_factory=list)
    last_error: str | None = None
    failures_in_row: int = 0
    bytes_sent: int = 0
    blobs_sent: int = 0
    blobs_deduped: int = 0
    checkpoints_sent: int = 0
    parts_sent: int = 0  # several ranks: this rank's parts marked complete on the remote
    last_upload_seconds: float | None = None


class Replicator:
    """Owns the uploader thread. Called by the manager: ``start``, ``wake`` after each commit,
    ``drain`` (close, preemption), ``stop``."""

    def __init__(
        self,
        remote: Remote,
        store: StoreDir,
        store_id: str,
        settings: Any,
        nice: int = 10,
        *,
        rank: int = 0,
        world: int = 1,
    ) -> None:
        self.remote = remote
        # Several ranks (parts.py): this rank uploads its own part and marks it; rank 0 also
        # writes the commit object once every rank's part is marked, and runs retention.
        self.rank, self.world = rank, world
        self._marked: set[str] = set()  # ids whose part of this rank is marked on the remote
        self._waiting = False  # rank 0: the last round waited for another rank's part
        self._first_seen: dict[str, float] = {}  # pending id -> wall time it was first seen
        self.journal = RemoteJournal(remote)
        self.store = store
        self.store_id = store_id
        self.s = settings
        self.nice = nice
        self.limiter = Limiter(settings.remote_bandwidth_mb * (1 << 20))
        self.status = _Status()
        self._known_blobs: set[str] | None = None
        self._remote_live: set[str] = set()  # remote live ids as last read
        self._next_seq = -1  # the remote journal's next sequence number after our last round
        self._manifests: dict[str, dict[str, Any]] = {}
        self._skip: set[str] = set()  # local checkpoints found damaged: never shipped
        self._cond = threading.Condition()
        self._status_lock = threading.Lock()
        self._wakes = 0  # bumped by wake(); a round that started after a wake covers it
        self._done = -1  # wake count at the start of the last round that left nothing pending
        self._stop = False
        self._disabled: str | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ control (any thread)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="smartckpt-remote", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        with self._cond:
            self._wakes += 1
            self._cond.notify_all()
        if self._thread is not None:
            self._write_status()  # a new commit is new lag, even while an upload is running

    def drain(self, timeout: float) -> bool:
        """Wait until every checkpoint committed so far is remote, at most ``timeout`` s."""
        if self._thread is None or self._disabled:
            return False
        self.wake()
        deadline = time.monotonic() + timeout
        with self._cond:
            target = self._wakes
            while self._done < target:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(min(left, 0.5))
        return True

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)

    # ------------------------------------------------------------------ the thread

    def _loop(self) -> None:
        from smartckpt_cli.procutil import lower_priority

        lower_priority(self.nice)
        delay = 0.0
        while True:
            with self._cond:
                if not self._stop and delay and self.world > 1:
                    # Several ranks: a backoff (or the wait for another rank's part) is waited out
                    # even when commits wake the uploader, so a failing rank never spins.
                    self._cond.wait_for(lambda: self._stop, timeout=delay)
                elif not self._stop:
                    self._cond.wait_for(
                        lambda: self._stop or self._wakes > self._done, timeout=delay or IDLE_POLL
                    )
                if self._stop:
                    return
                started = self._wakes
            try:
                pending = self.run_round()
                if self._stop and self.world > 1:
                    return  # a round cut short by stop(): the status keeps the last error seen
            except RemoteMismatch as err:
                self._disabled = str(err)
                self.status.last_error = str(err)
                logger.error("remote tier disabled: %s", err)
                self._write_status()
                with self._cond:
                    self._cond.notify_all()
                return
            except Exception as err:  # the remote is down, slow, refusing: training goes on
                self.status.failures_in_row += 1
                self.status.last_error = f"{type(err).__name__}: {str(err)[:300]}"
                delay = min(MAX_BACKOFF, 0.5 * 2 ** min(self.status.failures_in_row, 8))
                if self.status.failures_in_row in (1, 5) or self.status.failures_in_row % 20 == 0:
                    logger.warning(
                        "remote %s: upload failed (%s); retrying in %.0f s, training continues",
                        display_url(self.remote.url),
                        self.status.last_error,
                        delay,
                    )
                self._write_status()
                continue
            self.status.failures_in_row, self.status.last_error, delay = 0, None, 0.0
            self._write_status()
            with self._cond:
                if pending == 0:
                    self._done = max(self._done, started)
                    self._cond.notify_all()
                else:  # waiting for another rank's part: list again a second later
                    delay = 1.0 if self._waiting else 0.1

    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        tries = max(1, self.s.remote_retries)
        for attempt in range(tries):
            try:
                return fn()
            except FileNotFoundError:
                raise
            except Exception as err:
                # show the trouble (inspect, the live panel) while retrying
                self.status.last_error = f"{type(err).__name__}: {str(err)[:300]}"
                self._write_status()
                if attempt == tries - 1 or self._stop:
                    raise
                pause = min(8.0, 0.25 * 2**attempt)
                logger.debug("remote %s failed (%s); retry %d in %.2f s", what, err, attempt + 1, pause)
                time.sleep(pause)
        raise AssertionError("unreachable")  # pragma: no cover

    def run_round(self) -> int:
        """One round, under remote.lock; returns how many committed checkpoints are still not
        remote."""
        lock = Path(self.store.meta_root) / REMOTE_LOCK
        if self.world == 1:
            with file_lock(lock):
                return self._round()
        # Several ranks: their rounds run side by side (shared); rank 0's garbage collection
        # (exclusive) never runs while any rank is between its dedup decision and its marker.
        with file_lock(lock, shared=True):
            pending = self._round_parts()
        if self.rank == 0:
            with file_lock(lock):
                self._expire()
        return pending

    def _round_parts(self) -> int:
        """One round with several ranks: this rank's parts up and marked; on rank 0 the commit
        object of every step whose parts are all marked (parts.py)."""
        rstate = self._retry("journal read", self.journal.read)
        if rstate.store_id is None and self.rank == 0:
            self._retry("journal init", lambda: self.journal.init(self.store_id))
            rstate = self._retry("journal read", self.journal.read)
        if rstate.store_id is not None and rstate.store_id != self.store_id:
            raise RemoteMismatch(
                f"{display_url(self.remote.url)} holds the checkpoints of another store "
                f"({rstate.store_id}, this one is {self.store_id}); use another remote prefix"
            )
        if rstate.next_seq != self._next_seq or self._known_blobs is None:
            self._known_blobs = self._retry("blob listing", lambda: list_blobs(self.remote))
        local = self.store.journal.read()
        markers = set(self._retry("part listing", lambda: self.remote.list(PARTS_DIR)))
        remote_live = rstate.live_ids()
        newest = abandoned_before(local.records, remote_live)
        todo = [r for r in plan_round(local, rstate, self._skip).upload if r.position > newest]
        self._remote_live = remote_live
        seq = rstate.next_seq
        waiting = False
        left: list[CheckpointRecord] = []
        for rec in todo:
            if self._stop:
                left.append(rec)
                continue
            parts = record_parts(rec)
            mine = marker_name(rec.step, rec.id, self.rank)
            if parts is None:  # a one-process checkpoint (written before a resize): rank 0's
                if self.rank == 0:
                    left.append(rec)
                continue
            if self.rank < len(parts) and mine not in markers:
                try:
                    self._upload_part(rec, parts[self.rank])
                except (LocalBlobGone, _LocalCorrupt) as err:
                    if any(r.id == rec.id and r.live for r in self.store.journal.read().records):
                        self._skip.add(rec.id)
                        logger.error(
                            "remote: step %d: this rank's part is not uploadable (%s)", rec.step, err
                        )
                    continue
                markers.add(mine)
                self.status.parts_sent += 1
            self._marked.add(rec.id)
            if self.rank != 0:
                continue
            if missing_markers(rec, markers):
                waiting = True
                left.append(rec)
                continue
            # IMPORTANT: the commit object goes last, after every rank's part is marked.
            self._retry("commit", _writer(self.journal, seq, rec))
            seq += 1
            self.status.checkpoints_sent += 1
            self.status.remote_steps.append(rec.step)
            self._remote_live.add(rec.id)
        self._waiting = waiting
        if self.rank == 0:
            after = self._retry("journal read", self.journal.read)
            self._next_seq = after.next_seq
            self._set_pending(left, after)
        else:
            self._next_seq = rstate.next_seq
            self.status.pending, self.status.pending_steps = len(left), [r.step for r in left]
        self._write_status()
        return len(left)

    def _upload_part(self, rec: CheckpointRecord, part: list[Any]) -> None:
        """This rank's part of ``rec``: its blobs, its part manifest, then its marker."""
        self._upload_checkpoint(replace(rec, manifest=part[0], manifest_hash=part[1]))
        fault_fail("remote.part")  # tests: a rank killed (or failing) between its part and marker
        body = marker_body(rec, self.rank)
        self._retry(
            "part marker",
            lambda: self.remote.put(
                f"{PARTS_DIR}/{marker_name(rec.step, rec.id, self.rank)}",
                body,
                part_bytes=self._part(),
                limiter=self.limiter,
            ),
        )

    def _round(self) -> int:
        # The lag as last known, before touching the remote (which may be down).
        lag = upload_lag(self.store.journal.read().records, self._remote_live)
        self.status.pending, self.status.pending_steps = len(lag), [r.step for r in lag]
        rstate = self._retry("journal read", self.journal.read)
        if rstate.store_id is None:
            self._retry("journal init", lambda: self.journal.init(self.store_id))
            rstate = self._retry("journal read", self.journal.read)
        if rstate.store_id != self.store_id:
            raise RemoteMismatch(
                f"{display_url(self.remote.url)} holds the checkpoints of another store "
                f"({rstate.store_id}, this one is {self.store_id}); use another remote prefix"
            )
        if rstate.next_seq != self._next_seq:
            # Somebody else wrote to the remote (`prune --remote` may have removed blobs): what
            # this process believes is remote must be listed again, or dedup would skip a blob
            # that is gone and commit a checkpoint that cannot be restored.
            self._known_blobs = None
        if self._known_blobs is None:
            self._known_blobs = self._retry("blob listing", lambda: list_blobs(self.remote))
        local = self.store.journal.read()
        plan = plan_round(local, rstate, self._skip)
        self._set_pending(plan.upload, rstate)
        seq = rstate.next_seq
        for rec in plan.upload:
            if self._stop:
                break
            try:
                self._upload_checkpoint(rec)
            except LocalBlobGone:
                if any(r.id == rec.id and r.live for r in self.store.journal.read().records):
                    self._skip.add(rec.id)
                    logger.error(
                        "remote: step %d is damaged locally (a blob is missing); not uploaded", rec.step
                    )
                continue  # pruned locally meanwhile: nothing to ship
            except _LocalCorrupt as err:
                self._skip.add(rec.id)
                logger.error("remote: step %d is damaged locally (%s); not uploaded", rec.step, err)
                continue
            # IMPORTANT: the commit object goes last, after every blob and the manifest.
            self._retry("commit", _writer(self.journal, seq, rec))
            seq += 1
            self.status.checkpoints_sent += 1
            self.status.pending = max(0, self.status.pending - 1)
            self.status.pending_steps = [s for s in self.status.pending_steps if s != rec.step]
            self.status.remote_steps.append(rec.step)
            self._remote_live.add(rec.id)
            self._write_status()
        if plan.withdraw:
            ids = [r.id for r in plan.withdraw]
            event = {
                "event": "prune",
                "ids": ids,
                "steps": [r.step for r in plan.withdraw],
                "why": "rolled back",
            }
            self._retry("withdraw", lambda: self.journal.write(seq, event))
            seq += 1
        self._expire()
        after = self._retry("journal read", self.journal.read)
        self._next_seq = after.next_seq
        left = plan_round(self.store.journal.read(), after, self._skip).upload
        self._set_pending(left, after)
        return len(left)

    def _set_pending(self, pending: list[CheckpointRecord], rstate: RemoteState) -> None:
        self._remote_live = rstate.live_ids()
        self.status.pending = len(pending)
        self.status.pending_steps = [r.step for r in pending]
        self.status.remote_steps = [r.step for r in sorted(rstate.live(), key=lambda r: r.position)]

    def _upload_checkpoint(self, rec: CheckpointRecord) -> None:
        t0 = time.monotonic()
        try:
            data = self.store.storage.read(rec.manifest)
        except FileNotFoundError as err:
            raise LocalBlobGone(rec.manifest) from err
        if codec.blob_id(data) != rec.manifest_hash:
            raise _LocalCorrupt(f"manifest {rec.manifest} hash mismatch")
        manifest = decode_manifest(data, rec.manifest)
        assert self._known_blobs is not None
        known = self._known_blobs
        todo = [b for b in manifest_blob_ids(manifest) if b not in known]
        self.status.blobs_deduped += len(manifest_blob_ids(manifest)) - len(todo)
        if self.world > 1 and todo:
            # Ranks holding the same replicated blobs start at different places in the list, so
            # the existence check before each upload finds most of another rank's work done.
            cut = len(todo) * self.rank // self.world
            todo = todo[cut:] + todo[:cut]
        with ThreadPoolExecutor(
            max_workers=max(1, self.s.remote_workers), thread_name_prefix="smartckpt-upload"
        ) as pool:
            for bid, n in zip(todo, pool.map(self._upload_blob, todo), strict=True):
                known.add(bid)
                if n < 0:  # already remote (another rank sent it)
                    self.status.blobs_deduped += 1
                    continue
                self.status.blobs_sent += 1
                self.status.bytes_sent += n
        self._retry(
            "manifest",
            lambda: self.remote.put(rec.manifest, data, part_bytes=self._part(), limiter=self.limiter),
        )
        self._manifests[rec.manifest] = manifest
        self.status.bytes_sent += len(data)
        self.status.last_upload_seconds = round(time.monotonic() - t0, 3)

    def _part(self) -> int:
        return max(5, self.s.remote_part_mb) << 20

    def _upload_blob(self, bid: str) -> int:
        rel = self.store.blobs.rel(bid)
        try:
            data = self.store.storage.read(rel)
        except FileNotFoundError as err:
            raise LocalBlobGone(bid) from err
        if codec.blob_id(data) != bid:  # re-hash: never ship what the local disk damaged
            raise _LocalCorrupt(f"blob {bid} hash mismatch")
        if self.world > 1 and self._retry("blob check", lambda: self.remote.exists(rel)):
            return -1  # another rank sent this content already
        self._retry(
            "blob upload", lambda: self.remote.put(rel, data, part_bytes=self._part(), limiter=self.limiter)
        )
        return len(data)

    def _expire(self) -> None:
        keep = self.s.remote_keep_last or self.s.keep_last
        rstate = self._retry("journal read", self.journal.read)
        doomed = select_prunable(rstate.records, keep)
        if not doomed:
            return
        event = {
            "event": "prune",
            "ids": [r.id for r in doomed],
            "steps": [r.step for r in doomed],
            "why": f"remote_keep_last={keep}",
        }
        self._retry("prune", lambda: self.journal.write(rstate.next_seq, event))
        rstate = self._retry("journal read", self.journal.read)
        if self.world > 1:  # the other ranks' blobs too (this rank's listing knows its own)
            self._known_blobs = self._retry("blob listing", lambda: list_blobs(self.remote))
        assert self._known_blobs is not None
        known = self._known_blobs
        self._retry(
            "garbage collection",
            lambda: remove_unreferenced(
                self.remote, rstate, known, self._manifests, keep_pending=self.world > 1
            ),
        )

    def _write_status(self) -> None:
        with self._status_lock:  # the uploader and the saver thread (wake) both write it
            self._write_status_locked()

    def _write_status_locked(self) -> None:
        st = self.status
        oldest: float | None = None
        part_steps: list[int] = []
        try:  # the lag against the remote as last seen: current even while the remote is down
            records = self.store.journal.read().records
            newest = abandoned_before(records, self._remote_live) if self.world > 1 else -1
            lag = [
                r
                for r in upload_lag(records, self._remote_live)
                if r.id not in self._skip
                and r.position > newest
                and (self.rank == 0 or r.id not in self._marked)
            ]
            st.pending, st.pending_steps = len(lag), [r.step for r in lag]
            now = time.time()
            seen = {r.id: self._first_seen.get(r.id, now) for r in lag}
            self._first_seen = seen  # when each pending checkpoint was first seen (wake: its commit)
            own = [r for r in lag if r.id not in self._marked]  # this rank's part not up yet
            part_steps = [r.step for r in own]
            oldest = min((seen[r.id] for r in own), default=None)
        except Exception as err:  # the status file is a view; never let it stop the uploader
            logger.debug("upload lag unknown: %s", err)
        body = {
            "remote": display_url(self.remote.url),
            "rank": self.rank,
            "world": self.world,
            # this rank's own part: checkpoints whose part is not on the remote yet, and the
            # seconds since the oldest of them was committed (its upload lag)
            "part_pending": len(part_steps),
            "part_pending_steps": part_steps,
            "lag_seconds": round(max(0.0, time.time() - oldest), 3) if oldest is not None else 0.0,
            "pending": st.pending,
            "pending_steps": st.pending_steps,
            "remote_steps": st.remote_steps[-20:],
            "last_error": st.last_error,
            "failures_in_row": st.failures_in_row,
            "bytes_sent": st.bytes_sent,
            "blobs_sent": st.blobs_sent,
            "blobs_deduped": st.blobs_deduped,
            "checkpoints_sent": st.checkpoints_sent,
            "parts_sent": st.parts_sent,
            "last_upload_seconds": st.last_upload_seconds,
            "disabled": self._disabled,
            "pid": os.getpid(),
            "updated": time.time(),
        }
        path = Path(self.store.meta_root) / status_name(self.rank)
        tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
        try:
            tmp.write_text(json.dumps(body, indent=1))
            os.replace(tmp, path)
        except OSError as err:
            logger.debug("cannot write %s: %s", path, err)


class _LocalCorrupt(Exception):
    pass


def _writer(journal: RemoteJournal, seq: int, rec: CheckpointRecord) -> Callable[[], str]:
    return lambda: journal.write(seq, dict(rec.event), tag=rec.id)
