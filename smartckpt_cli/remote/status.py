"""The uploader's status file (``status_name(rank)`` in the store's meta directory): what this
rank's replicator has sent, what is still pending and since when, and its last error; read by
``inspect`` and the live panel. Written by the uploader and by the saver thread (``wake``)."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from smartckpt_cli.remote.check import upload_lag
from smartckpt_cli.remote.parts import abandoned_before, status_name
from smartckpt_cli.remote.replica import display_url

if TYPE_CHECKING:
    from smartckpt_cli.remote.replicator import Replicator

__all__ = ["write_status"]

logger = logging.getLogger(__name__)


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


def write_status(rep: Replicator) -> None:
    with rep.status_lock:  # the uploader and the saver thread (wake) both write it
        _write_status_locked(rep)


def _write_status_locked(rep: Replicator) -> None:
    st = rep.status
    oldest: float | None = None
    part_steps: list[int] = []
    try:  # the lag against the remote as last seen: current even while the remote is down
        records = rep.store.journal.read().records
        newest = abandoned_before(records, rep.progress.remote_live) if rep.world > 1 else -1
        lag = [
            r
            for r in upload_lag(records, rep.progress.remote_live)
            if r.id not in rep.progress.skip
            and r.position > newest
            and (rep.rank == 0 or r.id not in rep.progress.marked)
        ]
        st.pending, st.pending_steps = len(lag), [r.step for r in lag]
        now = time.time()
        seen = {r.id: rep.progress.first_seen.get(r.id, now) for r in lag}
        rep.progress.first_seen = seen  # when each pending checkpoint was first seen (wake: its commit)
        own = [r for r in lag if r.id not in rep.progress.marked]  # this rank's part not up yet
        part_steps = [r.step for r in own]
        oldest = min((seen[r.id] for r in own), default=None)
    except Exception as err:  # the status file is a view; never let it stop the uploader
        logger.debug("upload lag unknown: %s", err)
    body = {
        "remote": display_url(rep.remote.url),
        "rank": rep.rank,
        "world": rep.world,
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
        "disabled": rep.disabled,
        "pid": os.getpid(),
        "updated": time.time(),
    }
    path = Path(rep.store.meta_root) / status_name(rep.rank)
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    try:
        tmp.write_text(json.dumps(body, indent=1))
        os.replace(tmp, path)
    except OSError as err:
        logger.debug("cannot write %s: %s", path, err)
