"""A checkpoint store on disk: ``dir`` (blobs, manifests) and ``meta_dir`` (journal, locks).

``meta_dir`` may live elsewhere (the seed's split: blobs on fast node-local NVMe, the small
journal on a shared SSD/NFS); by default it is ``dir`` itself.

One writer per store: :class:`WriterLock` (``<meta_dir>/writer.lock``) is held by the manager
that writes the store (rank 0 of several) from its start to ``close()``; ``smartckpt run`` takes
it too before it appends a rollback for a dead child.

Every file of a store is reached through its two :class:`~.storage.LocalStorage` backends (one
for ``dir``, one for ``meta_dir``), which refuse any name that would leave their root.
:func:`unsafe_layout` says what a store's own folders are when they are symlinks pointing
outside it: a writer refuses such a store, read-only commands report it.
"""

from __future__ import annotations

import contextlib
import os
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

from smartckpt_cli.errors import (
    NotAStoreError,
    StoreDamagedError,
    StoreLockedError,
    StoreNotFoundError,
    StoreUnreachableError,
    UnsafePathError,
    UsageError,
)
from smartckpt_cli.store.blobs import BlobStore
from smartckpt_cli.store.journal import JOURNAL, JOURNAL_LOCK, Journal
from smartckpt_cli.store.names import is_manifest_file
from smartckpt_cli.store.storage import LocalStorage, Storage, is_url, open_storage
from smartckpt_cli.store.unjournalled import Survey, repair_command, say_once, survey

__all__ = ["DIR_ID", "WRITER_LOCK", "StoreDir", "WriterLock", "open_store", "unsafe_layout"]

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

    def __init__(self, meta: Storage | Path, store_root: Path | None = None) -> None:
        if isinstance(meta, Path):
            store_root = store_root if store_root is not None else meta
            meta = LocalStorage(meta)
        self.meta: Storage = meta
        self.store_root = store_root if store_root is not None else Path(".")
        self._held: contextlib.ExitStack | None = None

    @property
    def held(self) -> bool:
        return self._held is not None

    def acquire(self) -> None:
        """Take the lock; :class:`StoreLockedError` naming the holder when another writer has it."""
        if self._held is not None:
            return
        stack = contextlib.ExitStack()
        try:
            fd = stack.enter_context(self.meta.lock(WRITER_LOCK, blocking=False))
        except BlockingIOError:
            stack.close()
            try:
                holder = self.meta.read(WRITER_LOCK)[:64].decode(errors="replace").strip()
            except OSError:
                holder = ""
            raise StoreLockedError(
                f"checkpoint store {self.store_root} is already being written by "
                f"{holder or 'another process'}; use another directory or stop that run"
            ) from None
        assert fd is not None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}".encode(), 0)
        self._held = stack

    def release(self) -> None:
        """Let the lock go (nothing when not held)."""
        held, self._held = self._held, None
        if held is not None:
            held.close()

    def __enter__(self) -> WriterLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass
class StoreDir:
    """A repository: blobs and manifests in ``storage``, the journal (and locks, status files)
    in ``meta``, on any backend. A local store has a directory for each (the same by default);
    a store named by a URL (:func:`open_repository`: a replica on an object store or a
    ``file://`` directory) has one backend for both, and ``url``."""

    root: Path
    meta_root: Path
    storage: Storage  # dir: blobs, manifests
    meta: Storage  # meta_dir: journal, locks, status files
    blobs: BlobStore
    journal: Journal
    url: str | None = None  # a store named by a URL (credentials never kept)

    @property
    def where(self) -> str:
        """The store as its messages name it: its directory, or its URL."""
        return self.url or str(self.root)

    def ensure_journal(self, store_id: str | None = None) -> str:
        """The store id; creates the journal on first use (under a lock, once), with
        ``store_id`` when given (a store continued from its remote copy). Refuses
        (:class:`StoreDamagedError`) a journal that cannot be read, and a missing or empty one
        beside manifests no journal line names: a new journal would make those checkpoints
        garbage (store/unjournalled.py)."""
        with self.meta.lock(JOURNAL_LOCK):
            found = self.survey()
            blocking = found.blocking
            if blocking is not None:
                raise StoreDamagedError(blocking.line(str(self.root), self.repair_command()))
            for finding in found.findings:
                say_once(finding.line(str(self.root), self.repair_command()))
            assert found.state is not None  # it read: nothing blocks
            if found.state.store_id is not None:
                return found.state.store_id
            return self.journal.create(store_id)

    def dir_id(self) -> str | None:
        """This directory's disk identity (``dir.id``, written by the first multi-rank save
        here), or None: parts whose dir id is another's were written to another disk."""
        try:
            return self.storage.read(DIR_ID).decode().strip() or None
        except (OSError, UnicodeDecodeError):
            return None

    def survey(self) -> Survey:
        """The journal and the manifests no line of it names (store/unjournalled.py)."""
        return survey(self.storage, self.journal)

    def repair_command(self) -> str:
        """The command that rebuilds this store's journal from its manifests."""
        return repair_command(self.root, self.meta_root)

    def lock(
        self, name: str, *, shared: bool = False, blocking: bool = True
    ) -> AbstractContextManager[int | None]:
        """Hold one of the store's lock files in ``meta_dir`` (``gc.lock``, ``remote.lock``,
        ``writer.lock``...): see :meth:`.storage.Storage.lock`."""
        return self.meta.lock(name, shared=shared, blocking=blocking)

    def writer_lock(self) -> WriterLock:
        """This store's :class:`WriterLock` (not yet taken)."""
        return WriterLock(self.meta, self.root)

    def refuse_unsafe_layout(self) -> None:
        """Raise UnsafePathError (one line) when a folder of the store is a symlink pointing
        outside it: nothing may be written or removed through it."""
        found = unsafe_layout(self.root, self.meta_root)
        if found:
            raise UnsafePathError(f"{found[0]}; refusing to write to or remove from this store")


_FOLDERS = ("blobs", "manifests")


def unsafe_layout(root: Path, meta_root: Path | None = None) -> list[str]:
    """What points outside the store among its own folders (``blobs/``, ``manifests/``, the fan-out
    folders of ``blobs/``) and the journal: one line each; empty for a sound layout. A store
    directory that is itself a symlink is the user's choice and fine."""
    found: list[str] = []
    real_root = os.path.realpath(root)
    candidates = [root / name for name in _FOLDERS]
    with contextlib.suppress(OSError):
        candidates += [root / "blobs" / fan for fan in sorted(os.listdir(root / "blobs"))]
    if meta_root is not None:
        candidates.append(meta_root / JOURNAL)
    for path in candidates:
        if not path.is_symlink():
            continue
        target = os.path.realpath(path)
        base = real_root if path.is_relative_to(root) else os.path.realpath(meta_root or root)
        if target != base and not target.startswith(base.rstrip(os.sep) + os.sep):
            found.append(f"{path} is a symlink to {target}, outside the store")
    return found


def open_repository(url: str, *, must_exist: bool = True) -> StoreDir:
    """The store a URL names (``s3://bucket/prefix``, ``file:///path``: a replica, or a store
    copied there), read through the same code as a directory; its journal's layout is what it
    holds. NotAStoreError (one line) when there is no journal there."""
    storage = open_storage(url, what="store")
    journal = Journal(storage)
    try:
        found = journal.exists()  # the layout is read here: the one remote call of the opening
    except Exception as err:  # botocore, aiohttp, OSError: whatever the backend raises
        raise StoreUnreachableError(
            f"{storage.url} cannot be read: {type(err).__name__}: {str(err)[:200]}"
        ) from None
    if must_exist and not found:
        raise NotAStoreError(f"{storage.url} is not a smartckpt checkpoint store (no journal there)")
    root = Path(url[len("file://") :]) if url.startswith("file://") else Path(".")
    return StoreDir(root, root, storage, storage, BlobStore(storage), journal, url=storage.url)


def open_store(
    directory: str | os.PathLike[str], meta_dir: str | os.PathLike[str] | None = None, *, create: bool = False
) -> StoreDir:
    """Open a store. Without ``create``, the directory must exist and hold a journal. A URL
    (``s3://``, ``file://``) opens the repository there (:func:`open_repository`)."""
    if isinstance(directory, str) and is_url(directory):
        if meta_dir is not None:
            raise UsageError("--meta-dir is for a store in directories, not for a URL")
        return open_repository(directory)
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
        held = _manifests(root)
        raise NotAStoreError(
            f"{meta_root} is not a smartckpt checkpoint store (no {JOURNAL})"
            + (
                f"; {root}/manifests/ holds {held} manifest(s): if the journal is in another "
                f"directory, pass it with --meta-dir; if it was lost, `{repair_command(root, meta_root)}` "
                "rebuilds it from the manifests that verify"
                if held
                else ""
            )
        )
    storage = LocalStorage(root)
    meta_storage = LocalStorage(meta_root)
    return StoreDir(
        root, meta_root, storage, meta_storage, BlobStore(storage), Journal(meta_storage, meta_root)
    )


def _manifests(root: Path) -> int:
    try:
        return sum(is_manifest_file(n) for n in os.listdir(root / "manifests"))
    except OSError:
        return 0
