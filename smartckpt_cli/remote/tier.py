"""The remote tier as the manager sees it: a source of checkpoints for restore and an observer
of commits (the engine's ``CheckpointSource`` and ``CommitObserver`` protocols, in
``smartckpt_cli/engine/observers.py``; met structurally, remote never imports the engine). The
manager calls, in this order:

1. ``RemoteTier.open(settings, store)`` before the local journal exists (a new node, a wiped
   disk): ``adopted_store_id`` is the remote's store id, so the checkpoints it holds belong to
   this store and keep passing the manifests' store check. With nothing to resume locally, a
   remote that does not answer is waited for (``remote_start_wait``, :mod:`.start_wait`), and
   the start refused after it, never started over with a new store id;
2. ``order`` and ``fetch`` in ``read``: what to try, and for a candidate whose local copy is
   missing or fails, its missing or damaged parts downloaded from the remote (the manager then
   reads the local store again);
3. ``on_start(store_id)`` once (the uploader starts), then ``on_commit(info)`` after each commit
   (it wakes the uploader);
4. ``on_preempt()`` after the preemption save (``drain``), ``on_close()`` in ``close`` (both
   bounded by ``remote_close_wait``).

A remote that is down never raises out of here into training: restore falls back to what is
local, the uploader retries in the background.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from smartckpt_cli.errors import CheckpointCorrupt
from smartckpt_cli.remote.check import REMOTE_LOCK
from smartckpt_cli.remote.fetch import Candidate, fetch_checkpoint, fetch_part, restore_order
from smartckpt_cli.remote.replica import display_url, open_remote, replica_journal
from smartckpt_cli.remote.replicator import Replicator
from smartckpt_cli.remote.start_wait import wait_for_remote
from smartckpt_cli.store.checkpoints import candidates
from smartckpt_cli.store.commit import adopt
from smartckpt_cli.store.directory import StoreDir
from smartckpt_cli.store.journal import JournalState
from smartckpt_cli.store.retention import GC_LOCK
from smartckpt_cli.store.storage import Storage

__all__ = ["REMOTE_LOCK", "RemoteTier"]

logger = logging.getLogger(__name__)


class RemoteTier:
    def __init__(
        self, remote: Storage, store: StoreDir, settings: Any, rank: int = 0, world: int = 1
    ) -> None:
        self.remote = remote
        self.rank, self.world = rank, world  # several ranks: each uploads and fetches its own part
        self.url = display_url(remote.url)
        self.store = store
        self.settings = settings
        self.journal = replica_journal(remote)
        self.replicator: Replicator | None = None
        self.adopted_store_id: str | None = None

    @classmethod
    def open(
        cls,
        settings: Any,
        store: StoreDir,
        rank: int = 0,
        world: int = 1,
        pause: Callable[[float], None] = time.sleep,
    ) -> RemoteTier:
        tier = cls(open_remote(settings.remote, settings), store, settings, rank, world)
        if rank == 0 and not _usable_locally(store):
            # Nothing to resume here (a new or wiped node): the remote may hold the whole run.
            # Its store id is adopted before a local journal exists, so its checkpoints belong to
            # this store; never a new id while the remote cannot be asked (start_wait.py).
            tier.adopted_store_id = wait_for_remote(tier.journal.read, tier.url, settings, pause)
            if tier.adopted_store_id:
                logger.info("remote %s: this store continues store %s", tier.url, tier.adopted_store_id)
        return tier

    # ------------------------------------------------------------------ restore

    def order(self, state: JournalState, *, include_unhealthy: bool) -> list[Candidate]:
        local = candidates(state.records, include_unhealthy=include_unhealthy)
        try:
            rstate = self.journal.read()
        except Exception as err:
            logger.warning(
                "remote %s unreachable (%s); restoring from the local copy only", self.url, _short(err)
            )
            return [Candidate(r, "local", False) for r in local]
        if rstate.store_id is not None and state.store_id is not None and rstate.store_id != state.store_id:
            logger.warning("remote %s holds another store's checkpoints; not restoring from it", self.url)
            return [Candidate(r, "local", False) for r in local]
        remote_live = candidates(rstate.records, include_unhealthy=include_unhealthy)
        return restore_order(local, {r.id for r in state.records}, remote_live)

    def fetch(self, cand: Candidate, damaged: CheckpointCorrupt | None = None) -> None:
        """Download ``cand``'s parts that the local store lacks or holds damaged (nothing else):
        a candidate only the remote holds, or one whose local copy failed with ``damaged`` (said
        in the log). Raises CheckpointCorrupt when the remote has no sound copy or cannot be
        reached. The manager then reads the local store again."""
        rec = cand.record
        if damaged is not None:
            logger.warning(
                "local copy of step %d fails (%s); repairing it from remote %s", rec.step, damaged, self.url
            )
        with self.store.lock(GC_LOCK, shared=True):  # fetched blobs are no garbage
            try:
                if rec.parts or self.world > 1:
                    got = fetch_part(
                        self.remote,
                        self.store.storage,
                        self.store.blobs,
                        rec,
                        self.rank,
                        self.world,
                        workers=self.settings.remote_workers,
                    )
                else:
                    got = fetch_checkpoint(
                        self.remote,
                        self.store.storage,
                        self.store.blobs,
                        rec,
                        workers=self.settings.remote_workers,
                    )
            except CheckpointCorrupt:
                raise
            except Exception as err:  # remote down mid-restore: fall back like any unusable copy
                raise CheckpointCorrupt(
                    f"step {rec.step}: remote {self.url} unreachable: {_short(err)}"
                ) from err
            if cand.where == "remote" and self.rank == 0:
                # The local journal (one for all ranks: rank 0 writes it) learns of it: local retention, inspect and dedup see it.
                adopt(self.store.journal, dict(rec.event))  # blobs and manifest are durable here
        logger.warning(
            "step %d: downloaded %d blob(s)%s, %d byte(s) from remote %s; %d blob(s) were sound locally",
            rec.step,
            got.blobs,
            " and the manifest" if got.manifest else "",
            got.bytes,
            self.url,
            got.kept,
        )

    # ------------------------------------------------------------------ replication

    def start(self, store_id: str, nice: int) -> None:
        # One uploader per store: the manager's writer.lock already makes it one per store; the
        # uploader takes remote.lock for each round (see check.REMOTE_LOCK).
        self.replicator = Replicator(
            self.remote, self.store, store_id, self.settings, nice=nice, rank=self.rank, world=self.world
        )
        self.replicator.start()
        self.replicator.wake()  # a backlog left by an earlier run goes up now

    def wake(self) -> None:
        if self.replicator is not None:
            self.replicator.wake()

    def drain(self, timeout: float) -> bool:
        if self.replicator is None:
            return True
        ok = self.replicator.drain(timeout)
        if not ok:
            st = self.replicator.status
            logger.warning(
                "remote %s: %d committed checkpoint(s) not uploaded after %.0f s (steps %s)%s",
                self.url,
                st.pending,
                timeout,
                st.pending_steps,
                f"; last error: {st.last_error}" if st.last_error else "",
            )
        return ok

    # ------------------------------------------------------------------ commit observer

    def on_start(self, store_id: str) -> None:
        self.start(store_id, self.settings.background_nice)

    def on_commit(self, info: Any) -> None:
        self.wake()

    def on_preempt(self) -> None:
        self.drain(self.settings.remote_close_wait)  # the node may not come back: get it off first

    def on_close(self) -> None:
        self.close(self.settings.remote_close_wait)

    def close(self, timeout: float) -> None:
        try:
            self.drain(timeout)
        finally:
            if self.replicator is not None:
                self.replicator.stop()


def _usable_locally(store: StoreDir) -> bool:
    """Whether the local journal names a live checkpoint (then a remote that is down only
    delays replication: restore falls back to the local copy)."""
    if not store.journal.exists():
        return False
    try:
        return bool(store.journal.read().live())
    except Exception:
        return False


def _short(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err)[:200]}"
