"""The local backlog uploaded at once, outside any training process. No torch.

``smartckpt run`` calls :func:`ship` when a run ends after a flash persist that no training
process followed (``supervise/ramowner.py``): the checkpoint the supervisor wrote from RAM
would otherwise stay on this node, where no uploader runs any more. It is the training's own
uploader (:class:`.replicator.Replicator`), the same rounds in the same order (every live local
commit the remote lacks, oldest first; each blob re-hashed before it is sent; the commit object
last), run here until the checkpoints asked for are remote or ``timeout`` passes. A checkpoint
of N ranks is N parts on the remote (``parts.py``): one uploader per rank, rank 0's writes the
commit once every part is marked, as under torchrun.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from smartckpt_cli.remote.replica import open_remote, replica_journal
from smartckpt_cli.remote.replicator import Replicator
from smartckpt_cli.store.directory import StoreDir
from smartckpt_cli.store.storage import Storage

__all__ = ["Shipped", "ship"]


@dataclass
class Shipped:
    missing: set[str]  # ids asked for that the remote has not committed
    uploaded: bool  # this call ran the uploader (False: the remote held them already)
    seconds: float
    error: str | None = None  # the last error the uploader met, or why it could not run


def _committed(remote: Storage) -> set[str]:
    """The ids ever committed on the remote (remote retention may have pruned some since)."""
    return {r.id for r in replica_journal(remote).read().records}


def ship(
    settings: Any, store: StoreDir, store_id: str, ids: set[str], *, world: int = 1, timeout: float
) -> Shipped:
    """Upload ``store``'s backlog to ``settings.remote`` until every id of ``ids`` is committed
    there, at most ``timeout`` seconds (module docstring). Never raises for a remote that is down: the
    result says what is still missing and why."""
    t0 = time.monotonic()
    first_error: str | None
    try:
        missing = ids - _committed(open_remote(settings.remote, settings))
    except Exception as err:  # down, refusing, no fsspec: the uploader below says it again
        missing, first_error = set(ids), f"{type(err).__name__}: {str(err)[:300]}"
    else:
        first_error = None
        if not missing:
            return Shipped(set(), False, time.monotonic() - t0)
    try:
        reps = [
            Replicator(
                open_remote(settings.remote, settings), store, store_id, settings, nice=0, rank=r, world=world
            )
            for r in range(world)
        ]
    except Exception as err:
        return Shipped(missing, False, time.monotonic() - t0, first_error or str(err))
    for rep in reps:
        rep.start()
    try:
        reps[0].drain(timeout)
    finally:
        for rep in reps:
            rep.stop()
    errors = [rep.disabled or rep.status.last_error for rep in reps]
    error = next((e for e in errors if e), None) or first_error
    try:
        missing = ids - _committed(reps[0].remote)
    except Exception as err:
        error = error or f"{type(err).__name__}: {str(err)[:300]}"
    return Shipped(missing, True, time.monotonic() - t0, error)
