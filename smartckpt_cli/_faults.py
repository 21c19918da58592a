"""Named fault points, for crash tests only.

A test child process sets ``SMARTCKPT_TEST_FAULTS=1`` and ``SMARTCKPT_FAULT=<point>[@N]``; the N-th
time (default 1st) the code passes ``<point>`` the process SIGKILLs itself, exactly as a power cut or
an OOM kill would stop it there. Both variables are needed, so a stray ``SMARTCKPT_FAULT`` in a
user's environment does nothing. Points, in the order a save passes them: blob.stored (a new
blob is in its temporary file, write-back started), blob.written (fsynced, not yet renamed),
blob.renamed, blobs.durable, manifest.written, manifest.renamed, journal.half_line,
journal.fsynced, prune.in_progress.

Two more variables for multi-rank tests: ``SMARTCKPT_FAULT_RANK=<r>`` arms the fault on that rank
(``RANK``) only, and ``SMARTCKPT_FAULT_MODE=raise`` makes :func:`fault_fail` points raise an
``OSError`` (a failed write: full disk, I/O error) instead of killing the process. A rank's part
of a multi-rank save passes ``rank.write`` before writing anything; a rank's remote uploader
passes ``remote.part`` after its part's blobs and manifest, before its marker, and ``rank.restore``
before loading its part of each checkpoint a multi-rank restore tries (``SMARTCKPT_FAULT_MODE=memory``:
a MemoryError there). ``<point>@*`` fires at every pass (with ``raise``: a rank whose uploads always
fail).
"""

from __future__ import annotations

import os
import signal
import threading

__all__ = ["crash", "fault_active", "fault_fail", "fault_point"]

_lock = threading.Lock()
_hits: dict[str, int] = {}


def _target() -> tuple[str, int] | None:
    if os.environ.get("SMARTCKPT_TEST_FAULTS") != "1":
        return None
    spec = os.environ.get("SMARTCKPT_FAULT", "")
    if not spec:
        return None
    rank = os.environ.get("SMARTCKPT_FAULT_RANK")
    if rank is not None and os.environ.get("RANK", "0") != rank:
        return None
    name, _, count = spec.partition("@")
    return name, 0 if count == "*" else int(count or 1)  # "@*": every pass


def fault_active(name: str) -> bool:
    """Count one pass through ``name``; True when this pass is the one to crash at."""
    target = _target()
    if target is None or target[0] != name:
        return False
    with _lock:
        _hits[name] = _hits.get(name, 0) + 1
        return target[1] == 0 or _hits[name] == target[1]


def crash() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def fault_point(name: str) -> None:
    if fault_active(name):
        crash()


def fault_fail(name: str) -> None:
    """Like :func:`fault_point`, but with ``SMARTCKPT_FAULT_MODE=raise`` the pass raises an I/O
    error instead of killing the process, and with ``memory`` a MemoryError (an allocation that
    failed: what an elastic read of a large checkpoint can meet)."""
    if fault_active(name):
        mode = os.environ.get("SMARTCKPT_FAULT_MODE")
        if mode == "raise":
            import errno

            raise OSError(errno.EIO, f"injected write failure at {name}")
        if mode == "memory":
            raise MemoryError(f"injected allocation failure at {name}")
        crash()
