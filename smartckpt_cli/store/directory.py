"""A checkpoint store on disk: ``dir`` (blobs, manifests) and ``meta_dir`` (journal, locks).

``meta_dir`` may live elsewhere (the seed's split: blobs on fast node-local NVMe, the small
journal on a shared SSD/NFS); by default it is ``dir`` itself.

One writer per store: :class:`WriterLock` (``<meta_dir>/writer.lock``) is held by the manager
that writes the store (rank 0 of several) from its start to ``close()``; ``smartckpt run`` takes
it too before it appends a rollback for a dead child.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from smartckpt_cli.errors import NotAStoreError, StoreLockedError, StoreNotFoundError
from smartckpt_cli.store.blobs import BlobStore
from smartckpt_cli.store.journal import JOURNAL, Journal
from smartckpt_cli.store.storage.local import LocalStorage, file_lock

__all__ = ["DIR_ID", "WRITER_LOCK", "StoreDir", "WriterLock", "open_store"]

WRITER_LOCK = "writer.lock"
# The identity of the disk a directory is on, written by the first multi-rank save there: ranks
# with the same id share blobs; a part whose id is not this directory's was written elsewhere.
DIR_ID = "dir.id"


class WriterLock:
    """The single-writer lock of a store: an exclusive, non-blocking ``flock`` on
    ``<meta_dir>/writer.lock``, held from :meth:`acquire` to :meth:`release`.

    The kernel drops an ``flock`` when the holder's last descriptor closes, so a process that
    died (killed, crashed) leaves no stale lock: the next writer takes it at once, without any
    guess about whether a pid is still alive. The file only ever holds the last holder's
    ``pid N on HOST``, for the refusal message. Two locks on one store conflict even inside one
    process (each opens the file anew)."""

    def __init__(self, meta_root: Path, store_root: Path | None = None) -> None:
        self.path = meta_root / WRITER_LOCK
        self.store_root = store_root if store_root is not None else meta_root
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock; :class:`StoreLockedError` naming the holder when another writer has it."""
        import fcntl

        if self._fd is not None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise StoreLockedError(
                f"checkpoint store {self.store_root} is already being written by {holder}; "
                "use another directory or stop that run"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Let the lock go (nothing when not held)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> WriterLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass
class StoreDir:
    root: Path
    meta_root: Path
    storage: LocalStorage
    blobs: BlobStore
    journal: Journal

    def ensure_journal(self, store_id: str | None = None) -> str:
        """The store id; creates the journal on first use (under a lock, once), with
        ``store_id`` when given (a store continued from its remote copy)."""
        with file_lock(self.meta_root / "journal.lock"):
            state = self.journal.read()
            if state.store_id is not None:
                return state.store_id
            return self.journal.create(store_id)

    def writer_lock(self) -> WriterLock:
        """This store's :class:`WriterLock` (not yet taken)."""
        return WriterLock(self.meta_root, self.root)


def open_store(
    directory: str | os.PathLike[str], meta_dir: str | os.PathLike[str] | None = None, *, create: bool = False
) -> StoreDir:
    """Open a store. Without ``create``, the directory must exist and hold a journal."""
    root = Path(directory)
    meta_root = Path(meta_dir) if meta_dir is not None else root
    for path, what in ((root, "checkpoint directory"), (meta_root, "meta directory")):
        try:
            exists, is_dir = path.exists(), path.is_dir()
        except PermissionError:
            raise NotAStoreError(f"cannot open {what} {path}: permission denied") from None
        if exists and not is_dir:
            raise NotAStoreError(f"{what} {path} is not a directory")
        if not exists:
            if not create:
                raise StoreNotFoundError(f"{what} {path} does not exist")
            path.mkdir(parents=True, exist_ok=True)
    try:
        has_journal = (meta_root / JOURNAL).exists()
    except PermissionError:
        raise NotAStoreError(f"cannot open {meta_root}: permission denied") from None
    if not create and not has_journal:
        raise NotAStoreError(f"{meta_root} is not a smartckpt checkpoint store (no {JOURNAL})")
    storage = LocalStorage(root)
    meta_storage = LocalStorage(meta_root)
    return StoreDir(root, meta_root, storage, BlobStore(storage), Journal(meta_storage, meta_root))
