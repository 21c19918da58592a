"""The background uploader: ships committed local checkpoints to the remote, in commit order.

One round (:meth:`Replicator.run_round`), started by a commit (``wake``) or by a timer:

1. read both journals; :func:`.plan.plan_round` (pure) says which local commits the remote lacks,
   and which remote checkpoints were rolled back locally;
2. for each missing commit, oldest first: upload the blobs the remote does not have (each one
   re-hashed first: a blob damaged on the local disk is never shipped), then the manifest, then
   the ``commit`` object. IMPORTANT: the commit object is written last, only after every blob
   and the manifest are there; it is the remote commit point;
3. remote retention (``remote_keep_last``).

With several ranks (``world > 1``, :mod:`.parts`) every rank runs one, for its own part: a round
(:func:`.part_round.round_parts`) uploads the part's blobs and part manifest, then writes its
marker; rank 0's round also writes the ``commit`` object of each step whose every part is marked,
and then, holding ``remote.lock`` exclusively (the ranks' rounds hold it shared), retention.

Every remote call is retried with backoff; a round that still fails is retried later with a
growing delay, so a remote that is down or slow delays replication, never training. The thread
runs at the background priority and never holds a lock the training loop waits for.

This module holds the thread, the one-process round, the uploads and retention; the round's plan
and errors are in :mod:`.plan`, the multi-rank round in :mod:`.part_round`, and the status file it
reports to in :mod:`.status`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from smartckpt_cli.remote.check import REMOTE_LOCK, list_blobs, remove_unreferenced, upload_lag
from smartckpt_cli.remote.fetch import manifest_blob_ids
from smartckpt_cli.remote.part_round import round_parts
from smartckpt_cli.remote.parts import still_pending
from smartckpt_cli.remote.plan import (
    LocalBlobGone,
    RemoteMismatch,
    RoundPlan,
    RoundProgress,
    _LocalCorrupt,
    _writer,
    plan_round,
)
from smartckpt_cli.remote.replica import display_url, replica_journal
from smartckpt_cli.remote.status import _Status, write_status
from smartckpt_cli.store import codec
from smartckpt_cli.store.directory import StoreDir
from smartckpt_cli.store.journal import CheckpointRecord, JournalState, decode_manifest
from smartckpt_cli.store.leases import Lease, holding
from smartckpt_cli.store.retention import select_prunable
from smartckpt_cli.store.storage import Storage

__all__ = ["RemoteMismatch", "Replicator", "RoundPlan", "plan_round"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
IDLE_POLL = 30.0  # seconds between rounds when nothing wakes the uploader
MAX_BACKOFF = 30.0


class Replicator:
    """Owns the uploader thread. Called by the manager: ``start``, ``wake`` after each commit,
    ``drain`` (close, preemption), ``stop``."""

    def __init__(
        self,
        remote: Storage,
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
        self._lease: Lease | None = None  # held while uploading (uploader thread)
        self.progress = RoundProgress()  # what one round leaves the next (plan.py)
        self.journal = replica_journal(remote)
        self.store = store
        self.store_id = store_id
        self.s = settings
        self.nice = nice
        self.status = _Status()
        self._known_blobs: set[str] | None = None
        self._manifests: dict[str, dict[str, Any]] = {}
        self._cond = threading.Condition()
        self.status_lock = threading.Lock()
        self._wakes = 0  # bumped by wake(); a round that started after a wake covers it
        self._done = -1  # wake count at the start of the last round that left nothing pending
        self._stop = False
        self.disabled: str | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ control (any thread)

    @property
    def stopping(self) -> bool:
        """Whether ``stop()`` was asked: a round leaves what it has not begun."""
        return self._stop

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="smartckpt-remote", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        with self._cond:
            self._wakes += 1
            self._cond.notify_all()
        if self._thread is not None:
            self.publish_status()  # a new commit is new lag, even while an upload is running

    def drain(self, timeout: float) -> bool:
        """Wait until every checkpoint committed so far is remote, at most ``timeout`` s."""
        if self._thread is None or self.disabled:
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
                self.disabled = str(err)
                self.status.last_error = str(err)
                logger.error("remote tier disabled: %s", err)
                self.publish_status()
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
                self.publish_status()
                continue
            self.status.failures_in_row, self.status.last_error, delay = 0, None, 0.0
            self.publish_status()
            with self._cond:
                if pending == 0:
                    self._done = max(self._done, started)
                    self._cond.notify_all()
                else:  # waiting for another rank's part: list again a second later
                    delay = 1.0 if self.progress.waiting else 0.1

    @contextlib.contextmanager
    def uploading(self) -> Iterator[None]:
        """A lease on the replica while blobs, manifests and commits go up (store/leases.py): a
        ``prune URL`` refuses while it is held; while a prune holds the replica, this raises
        LeaseHeld and the round is tried again later."""
        with holding(self.remote, "upload", {"prune"}) as lease:
            self._lease = lease
            try:
                yield
            finally:
                self._lease = None

    def retry(self, what: str, fn: Callable[[], T]) -> T:
        tries = max(1, self.s.remote_retries)
        for attempt in range(tries):
            try:
                return fn()
            except FileNotFoundError:
                raise
            except Exception as err:
                # show the trouble (inspect, the live panel) while retrying
                self.status.last_error = f"{type(err).__name__}: {str(err)[:300]}"
                self.publish_status()
                if attempt == tries - 1 or self._stop:
                    raise
                pause = min(8.0, 0.25 * 2**attempt)
                logger.debug("remote %s failed (%s); retry %d in %.2f s", what, err, attempt + 1, pause)
                time.sleep(pause)
        raise AssertionError("unreachable")  # pragma: no cover

    def run_round(self) -> int:
        """One round, under remote.lock; returns how many committed checkpoints are still not
        remote."""
        if self.world == 1:
            with self.store.lock(REMOTE_LOCK):
                return self._round()
        # Several ranks: their rounds run side by side (shared); rank 0's garbage collection
        # (exclusive) never runs while any rank is between its dedup decision and its marker.
        with self.store.lock(REMOTE_LOCK, shared=True):
            pending = round_parts(self)
        if self.rank == 0:
            with self.store.lock(REMOTE_LOCK):
                self._expire()
        return pending

    def _round(self) -> int:
        # The lag as last known, before touching the remote (which may be down).
        lag = upload_lag(self.store.journal.read().records, self.progress.remote_live)
        self.status.pending, self.status.pending_steps = len(lag), [r.step for r in lag]
        rstate = self.remote_state()
        local = self.store.journal.read()
        plan = plan_round(local, rstate, self.progress.skip)
        self.set_pending(plan.upload, rstate)
        seq = rstate.next_seq
        if plan.upload:
            with self.uploading():
                seq = self._upload_missing(plan.upload, seq)
        if plan.withdraw:
            ids = [r.id for r in plan.withdraw]
            event = {
                "event": "prune",
                "ids": ids,
                "steps": [r.step for r in plan.withdraw],
                "why": "rolled back",
            }
            self.retry("withdraw", lambda: self.journal.append(event, seq=seq))
            seq += 1
        self._expire()
        after = self.retry("journal read", self.journal.read)
        self.progress.next_seq = after.next_seq
        left = plan_round(self.store.journal.read(), after, self.progress.skip).upload
        self.set_pending(left, after)
        return len(left)

    def remote_state(self, *, may_init: bool = True) -> JournalState:
        """The remote journal, made on first use (``may_init``: by this process; with several
        ranks rank 0 alone makes it) and refused when it is another store's; the remote's blobs
        listed again when another writer moved its journal on (or never listed)."""
        rstate = self.retry("journal read", self.journal.read)
        if rstate.store_id is None and may_init:
            self.retry("journal init", lambda: self.journal.create(self.store_id))
            rstate = self.retry("journal read", self.journal.read)
        if (rstate.store_id is not None or may_init) and rstate.store_id != self.store_id:
            raise RemoteMismatch(
                f"{display_url(self.remote.url)} holds the checkpoints of another store "
                f"({rstate.store_id}, this one is {self.store_id}); use another remote prefix"
            )
        if rstate.next_seq != self.progress.next_seq:
            # Somebody else wrote to the remote (`prune --remote` may have removed blobs): what
            # this process believes is remote must be listed again, or dedup would skip a blob
            # that is gone and commit a checkpoint that cannot be restored.
            self._known_blobs = None
        if self._known_blobs is None:
            self._known_blobs = self.retry("blob listing", lambda: list_blobs(self.remote))
        return rstate

    def _upload_missing(self, upload: list[CheckpointRecord], seq: int) -> int:
        """Each checkpoint of ``upload`` up and committed as remote journal line ``seq`` onwards,
        oldest first, until stop(); one damaged or pruned locally is skipped. Returns the next line's seq."""
        for rec in upload:
            if self._stop:
                break
            try:
                self.upload_checkpoint(rec)
            except LocalBlobGone:
                if any(r.id == rec.id and r.live for r in self.store.journal.read().records):
                    self.progress.skip.add(rec.id)
                    logger.error(
                        "remote: step %d is damaged locally (a blob is missing); not uploaded", rec.step
                    )
                continue  # pruned locally meanwhile: nothing to ship
            except _LocalCorrupt as err:
                self.progress.skip.add(rec.id)
                logger.error("remote: step %d is damaged locally (%s); not uploaded", rec.step, err)
                continue
            # IMPORTANT: the commit object goes last, after every blob and the manifest.
            self.retry("commit", _writer(self.journal, seq, rec))
            seq += 1
            self.status.checkpoints_sent += 1
            self.status.pending = max(0, self.status.pending - 1)
            self.status.pending_steps = [s for s in self.status.pending_steps if s != rec.step]
            self.status.remote_steps.append(rec.step)
            self.progress.remote_live.add(rec.id)
            self.publish_status()
        return seq

    def set_pending(self, pending: list[CheckpointRecord], rstate: JournalState) -> None:
        self.progress.remote_live = rstate.live_ids()
        self.status.pending = len(pending)
        self.status.pending_steps = [r.step for r in pending]
        self.status.remote_steps = [r.step for r in sorted(rstate.live(), key=lambda r: r.position)]

    def upload_checkpoint(self, rec: CheckpointRecord) -> None:
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
        self.retry(
            "manifest",
            lambda: self.remote.write(rec.manifest, data),
        )
        self._manifests[rec.manifest] = manifest
        self.status.bytes_sent += len(data)
        self.status.last_upload_seconds = round(time.monotonic() - t0, 3)

    def _upload_blob(self, bid: str) -> int:
        if self._lease is not None:  # a long upload renews its lease: never taken as dead
            self._lease = self._lease.renewed(self.remote)
        rel = self.store.blobs.rel(bid)
        try:
            data = self.store.storage.read(rel)
        except FileNotFoundError as err:
            raise LocalBlobGone(bid) from err
        if codec.blob_id(data) != bid:  # re-hash: never ship what the local disk damaged
            raise _LocalCorrupt(f"blob {bid} hash mismatch")
        if self.world > 1 and self.retry("blob check", lambda: self.remote.exists(rel)):
            return -1  # another rank sent this content already
        self.retry("blob upload", lambda: self.remote.write(rel, data))
        return len(data)

    def _expire(self) -> None:
        keep = self.s.remote_keep_last or self.s.keep_last
        rstate = self.retry("journal read", self.journal.read)
        doomed = select_prunable(rstate.records, keep)
        if not doomed:
            return
        event = {
            "event": "prune",
            "ids": [r.id for r in doomed],
            "steps": [r.step for r in doomed],
            "why": f"remote_keep_last={keep}",
        }
        self.retry("prune", lambda: self.journal.append(event, seq=rstate.next_seq))
        rstate = self.retry("journal read", self.journal.read)
        if self.world > 1:  # the other ranks' blobs too (this rank's listing knows its own)
            self._known_blobs = self.retry("blob listing", lambda: list_blobs(self.remote))
        assert self._known_blobs is not None
        known = self._known_blobs
        # Several ranks: the parts that can still be committed are those of local checkpoints
        # after the newest remote one; the rest (a killed upload, a previous run's) are collected.
        # Only here, with a prune event just written: it makes every rank relist the blobs.
        pending = None
        if self.world > 1:
            pending = still_pending(
                self.store.journal.read().records, {r.id for r in rstate.records}, rstate.live_ids()
            )
        self.retry(
            "garbage collection",
            lambda: remove_unreferenced(
                self.remote, rstate, known, self._manifests, keep_pending=self.world > 1, pending_ids=pending
            ),
        )

    def publish_status(self) -> None:
        write_status(self)
