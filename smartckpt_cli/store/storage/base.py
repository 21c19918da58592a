"""The storage interface every backend implements.

Order of calls for one checkpoint (made by the writer thread of the one writing process):

1. ``begin(rel, data)`` for each new blob, then ``finish()`` on each returned pending write
   (fsync of the content, then the rename to its final name);
2. ``sync_dirs(dirs)`` once for the blob directories touched, so the renames are durable;
3. ``write(manifest_rel, data)`` (fsync, rename, fsync of the directory);
4. the journal appends its commit line through ``append``.

Readers (restore, verify, the CLI) only call ``read``, ``read_view``, ``exists``, ``list`` and ``size``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = ["Buffer", "Storage"]

Buffer = bytes | bytearray | memoryview


@runtime_checkable
class Storage(Protocol):
    def write(self, rel: str, data: Buffer | Sequence[Buffer], *, sync_dir: bool = True) -> None:
        """Write ``rel`` atomically: a reader sees either nothing or the whole, durable content."""

    def begin(self, rel: str, data: Buffer | Sequence[Buffer]) -> Any:
        """Write to a temporary name and start the write-back; returns an object whose
        ``finish()`` makes it durable and renames it (see LocalStorage.begin)."""

    def read_view(self, rel: str) -> Any:
        """The bytes of ``rel`` as a buffer, mapped instead of copied where possible."""

    def sync_dirs(self, dirs: Iterable[str]) -> None:
        """Make earlier renames into these directories durable."""

    def append(self, rel: str, data: bytes) -> None:
        """Append and fsync (the journal)."""

    def read(self, rel: str) -> bytes: ...

    def exists(self, rel: str) -> bool: ...

    def size(self, rel: str) -> int: ...

    def list(self, rel_dir: str) -> list[str]:
        """Names (not paths) in ``rel_dir``; empty when it does not exist."""

    def remove(self, rel: str) -> None:
        """Remove ``rel``; a missing file is not an error."""
