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
from smartckpt_cli.store.names import blob_rel, is_blob_id, is_temporary
from smartckpt_cli.store.storage.base import Buffer, Pending, Storage

__all__ = ["BlobStore"]

logger = logging.getLogger(__name__)


class BlobStore:
    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    @staticmethod
    def rel(bid: str) -> str:
        return blob_rel(bid)

    def has(self, bid: str) -> bool:
        return self.storage.exists(self.rel(bid))

    def begin(
        self, data: Buffer | Sequence[Buffer], bid: str | None = None, *, rewrite: bool = False
    ) -> tuple[str, Pending | None]:
        """Start storing ``data`` (one buffer, or pieces to be concatenated); returns (id, pending
        write), or (id, None) when the blob already exists. The caller finishes the pending
        writes, then makes their directories durable (``sync_dirs``) before committing.
        ``rewrite``: write it although a file of that name exists (a damaged copy, which the new
        file replaces atomically)."""
        if bid is None:
            bid = blob_id(data) if isinstance(data, bytes | bytearray | memoryview) else parts_id(data)
        if not rewrite and self.has(bid):
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

    def _fans(self) -> Iterator[str]:
        """The fan-out folders (two hex digits). Anything else under ``blobs/`` (a .DS_Store, a
        note) is not ours: never read, never removed, and it never stops garbage collection."""
        for fan in self.storage.list("blobs"):
            if len(fan) == 2 and all(c in "0123456789abcdef" for c in fan):
                yield fan

    def all_ids(self) -> Iterator[str]:
        """Every blob in the store: only names that are blob ids, in the folder of their first two
        digits; any other file there is left alone."""
        for fan in self._fans():
            for name in self.storage.list(f"blobs/{fan}"):
                if is_blob_id(name) and name[:2] == fan:
                    yield name

    def leftovers(self) -> Iterator[str]:
        """Temporary files of blob writes that never completed (their process died)."""
        for fan in self._fans():
            for name in self.storage.leftovers(f"blobs/{fan}"):
                if is_blob_id(name[:32]) and is_temporary(name, name[:32]):
                    yield f"blobs/{fan}/{name}"

    def remove(self, bid: str) -> None:
        self.storage.remove(self.rel(bid))
