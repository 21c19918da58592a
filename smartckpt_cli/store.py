"""Content-addressed blob store: a blob's name is the xxh3-128 of its bytes; written once.

Blobs fan out by the first two hex digits (``blobs/ab/ab12...``), as restic does, so no
directory grows past a few thousand entries. Since names are hashes, writing a blob that exists
is skipped, and verifying a blob is re-hashing it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from smartckpt_cli.codec import blob_id
from smartckpt_cli.storage.base import Buffer, Storage
from smartckpt_cli.storage.local import TMP_MARK

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

    def put(self, data: Buffer, bid: str | None = None) -> tuple[str, bool]:
        """Store ``data``; returns (id, written) where written is False when it already existed.
        The caller makes the directory durable (``sync_dirs``) before committing."""
        bid = bid or blob_id(data)
        if self.has(bid):
            return bid, False
        self.storage.write(self.rel(bid), data, sync_dir=False)
        return bid, True

    def get(self, bid: str) -> bytes:
        return self.storage.read(self.rel(bid))

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

    def all_ids(self) -> Iterator[str]:
        for fan in self.storage.list("blobs"):
            for name in self.storage.list(f"blobs/{fan}"):
                if TMP_MARK not in name:
                    yield name

    def leftovers(self) -> Iterator[str]:
        """Temporary files of writes that never completed (their process died)."""
        for fan in self.storage.list("blobs"):
            for name in self.storage.list(f"blobs/{fan}"):
                if TMP_MARK in name:
                    yield f"blobs/{fan}/{name}"

    def remove(self, bid: str) -> None:
        self.storage.remove(self.rel(bid))
