"""Content-addressed blob store: a blob's name is the xxh3-128 of its bytes; written once.

Blobs fan out by the first two hex digits (``blobs/ab/ab12...``), as restic does, so no
directory grows past a few thousand entries. Since names are hashes, writing a blob that exists
is skipped, and verifying a blob is re-hashing it.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Iterator, Sequence

from smartckpt_cli.store.codec import blob_id, parts_id
from smartckpt_cli.store.storage.base import Buffer, Storage
from smartckpt_cli.store.storage.local import TMP_MARK, PendingWrite

__all__ = ["BlobStore"]

logger = logging.getLogger(__name__)


class BlobStore:
    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    @staticmethod
    def rel(bid: str) -> str:
        return f"blobs/{bid[:2]}/{bid}"

    def has(self, bid: str) -> bool:
        return self.storage.exists(self.rel(bid))

    def begin(
        self, data: Buffer | Sequence[Buffer], bid: str | None = None
    ) -> tuple[str, PendingWrite | None]:
        """Start storing ``data`` (one buffer, or pieces to be concatenated); returns (id, pending
        write), or (id, None) when the blob already exists. The caller finishes the pending
        writes, then makes their directories durable (``sync_dirs``) before committing."""
        if bid is None:
            bid = blob_id(data) if isinstance(data, bytes | bytearray | memoryview) else parts_id(data)
        if self.has(bid):
            return bid, None
        return bid, self.storage.begin(self.rel(bid), data)

    def get(self, bid: str) -> bytes | mmap.mmap:
        """The blob's bytes, mapped rather than copied where the backend can."""
        return self.storage.read_view(self.rel(bid))

    def size(self, bid: str) -> int:
        return self.storage.size(self.rel(bid))

    def verify(self, bid: str) -> str | None:
        """None when the blob is sound, else what is wrong."""
        try:
            data = self.get(bid)
        except FileNotFoundError:
            return f"missing blob {bid}"
        except OSError as err:
            return f"unreadable blob {bid}: {err.strerror}"
        if blob_id(data) != bid:
            return f"hash mismatch in blob {bid}"
        return None

    def _names(self) -> Iterator[tuple[str, str]]:
        """(fan-out folder, file name) of everything under ``blobs/``. A stray file beside the
        folders (a .DS_Store, a note) is not ours and must not stop garbage collection."""
        for fan in self.storage.list("blobs"):
            try:
                names = self.storage.list(f"blobs/{fan}")
            except NotADirectoryError:
                continue
            for name in names:
                yield fan, name

    def all_ids(self) -> Iterator[str]:
        for _, name in self._names():
            if TMP_MARK not in name:
                yield name

    def leftovers(self) -> Iterator[str]:
        """Temporary files of writes that never completed (their process died)."""
        for fan, name in self._names():
            if TMP_MARK in name:
                yield f"blobs/{fan}/{name}"

    def remove(self, bid: str) -> None:
        self.storage.remove(self.rel(bid))
