"""A checkpoint store on disk: ``dir`` (blobs, manifests) and ``meta_dir`` (journal, locks).

``meta_dir`` may live elsewhere (the seed's split: blobs on fast node-local NVMe, the small
journal on a shared SSD/NFS); by default it is ``dir`` itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from smartckpt_cli.errors import NotAStoreError, StoreNotFoundError
from smartckpt_cli.store.blobs import BlobStore
from smartckpt_cli.store.journal import JOURNAL, Journal
from smartckpt_cli.store.storage.local import LocalStorage, file_lock

__all__ = ["StoreDir", "open_store"]


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
