"""Leases: who is writing a repository that has no lock files (an object store, a replica).

A replica is written by uploaders on several nodes and pruned by ``smartckpt prune URL`` from
anywhere; its collection must never run while an upload is between its first blob and its
commit (the blobs would look unreferenced). Each takes a lease first, an object of its own name,
``locks/<kind>-<12 hex>.json`` holding who and when, then lists the others: an uploader that sees
a ``prune`` lease drops its own and retries later; a prune that sees any other lease drops its
own and refuses. Both write before they look, so of two that start together at least one sees
the other (object stores list what was written: S3 is strongly consistent). A writer that died
leaves its lease; a lease not renewed for :data:`STALE_AFTER` seconds is taken as dead. Uploads
renew theirs as they go (:meth:`Lease.renewed`). restic locks a repository the same way.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from smartckpt_cli.store.names import lease_object
from smartckpt_cli.store.storage import Storage

__all__ = ["LEASES_DIR", "STALE_AFTER", "Lease", "LeaseHeld", "holding", "others"]

LEASES_DIR = "locks"
STALE_AFTER = 3600.0  # seconds without renewal after which a lease is a dead writer's
RENEW_AFTER = STALE_AFTER / 6


class LeaseHeld(Exception):
    """Another live lease of a conflicting kind holds the repository."""

    def __init__(self, other: Lease, now: float) -> None:
        super().__init__(f"{other.kind} by {other.who}, {max(0, int(now - other.utc))} s ago")
        self.other = other


@dataclass(frozen=True)
class Lease:
    rel: str
    kind: str
    who: str
    utc: float  # when it was written or last renewed (time.time())

    def renewed(self, storage: Storage, now: float | None = None) -> Lease:
        """This lease written again with the time now, when it is due (else itself)."""
        now = time.time() if now is None else now
        if now - self.utc < RENEW_AFTER:
            return self
        fresh = Lease(self.rel, self.kind, self.who, now)
        storage.write(self.rel, _body(fresh))
        return fresh


def _body(lease: Lease) -> bytes:
    return json.dumps({"kind": lease.kind, "who": lease.who, "utc": lease.utc}).encode()


def take(storage: Storage, kind: str) -> Lease:
    lease = Lease(
        f"{LEASES_DIR}/{kind}-{uuid.uuid4().hex[:12]}.json",
        kind,
        f"pid {os.getpid()} on {socket.gethostname()}",
        time.time(),
    )
    storage.write(lease.rel, _body(lease))
    return lease


def others(storage: Storage, mine: Lease | None = None, *, now: float | None = None) -> list[Lease]:
    """The live leases other than ``mine``. One that cannot be read counts as live and new: a
    lease is never ignored because it is odd."""
    now = time.time() if now is None else now
    out: list[Lease] = []
    for name in storage.list(LEASES_DIR):
        parsed = lease_object(name)
        rel = f"{LEASES_DIR}/{name}"
        if parsed is None or (mine is not None and rel == mine.rel):
            continue
        try:
            body = json.loads(storage.read(rel))
            who, utc = str(body.get("who", "?"))[:100], float(body["utc"])
        except FileNotFoundError:
            continue  # dropped while listing
        except (ValueError, TypeError, KeyError, OSError):
            who, utc = "an unreadable lease", now
        if now - utc < STALE_AFTER:
            out.append(Lease(rel, parsed[0], who, utc))
    return out


@contextmanager
def holding(storage: Storage, kind: str, conflicts: set[str]) -> Iterator[Lease]:
    """Hold a lease of ``kind`` for the block; LeaseHeld (its own dropped) when a live lease of a
    kind in ``conflicts`` is there. The lease is dropped after the block, whatever happens."""
    lease = take(storage, kind)
    try:
        now = time.time()
        for other in others(storage, lease, now=now):
            if other.kind in conflicts:
                raise LeaseHeld(other, now)
        yield lease
    finally:
        storage.remove(lease.rel)
