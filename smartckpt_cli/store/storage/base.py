"""The storage interface every backend implements: the one boundary between smartckpt and bytes
on a disk. Everything above it names files relatively (``blobs/ab/ab12…``, ``manifests/…``,
``journal.jsonl``) and never builds a path itself.

Every method checks the relative name it is given (:func:`smartckpt_cli.store.names.check_rel`)
and refuses, with :class:`~smartckpt_cli.errors.UnsafePathError`, any name that would resolve
outside the backend's root (an absolute name, ``..``, a symlink inside the root pointing out):
the second wall behind the grammar checks made where names are read.

Order of calls for one checkpoint (made by the writer thread of the one writing process):

1. ``begin(rel, data)`` for each new blob, then ``finish()`` on each returned pending write
   (fsync of the content, then the rename to its final name);
2. ``sync_dirs(dirs)`` once for the blob directories touched, so the renames are durable;
3. ``write(manifest_rel, data)`` (fsync, rename, fsync of the directory);
4. the journal appends its commit line through ``append``.

Readers (restore, verify, the CLI) only call ``read``, ``read_view``, ``exists``, ``list`` and
``size``. Garbage collection also calls ``leftovers`` and ``remove``. Cross-process exclusion
(``gc.lock``, ``journal.lock``, ``remote.lock``, ``writer.lock``) goes through ``lock``.

Two backends implement it: :class:`~.local.LocalStorage` (a directory: a store's ``dir`` and
``meta_dir``, a ``file://`` remote) and :class:`~.objects.ObjectStorage` (any fsspec filesystem:
``s3://``, ``gs://``, ``memory://``). An object store has no append and no lock: ``appends`` says
so, and the journal then keeps one object per event (:mod:`smartckpt_cli.store.log`) — the same
lines, the same replay, the same commit rule. :func:`~.open.open_storage` picks the backend of a
URL.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

__all__ = ["Buffer", "Pending", "Storage"]

Buffer = bytes | bytearray | memoryview


class Pending(Protocol):
    """A write begun by :meth:`Storage.begin`: its bytes are in a temporary file."""

    def finish(self) -> None:
        """Make the content durable, then give it its final name (and make the name durable
        unless ``sync_dir`` was turned off)."""

    def abort(self) -> None:
        """Drop the temporary file; the final name never appears."""


@runtime_checkable
class Storage(Protocol):
    url: str  # where it is, for messages (never with credentials: see open_storage)
    appends: bool  # whether ``append``/``truncate`` work (a file system) or not (an object store)

    def write(self, rel: str, data: Buffer | Sequence[Buffer], *, sync_dir: bool = True) -> None:
        """Write ``rel`` atomically: a reader sees either nothing or the whole, durable content."""

    def begin(self, rel: str, data: Buffer | Sequence[Buffer]) -> Pending:
        """Write to a temporary name and start the write-back; returns the pending write whose
        ``finish()`` makes it durable and renames it (see LocalStorage.begin)."""

    def read_view(self, rel: str) -> Any:
        """The bytes of ``rel`` as a buffer, mapped instead of copied where possible."""

    def sync_dirs(self, dirs: Iterable[str]) -> None:
        """Make earlier renames into these directories durable."""

    def append(self, rel: str, data: bytes) -> None:
        """Append every byte of ``data`` and fsync (the journal); raises when it cannot."""

    def truncate(self, rel: str, size: int) -> None:
        """Cut ``rel`` back to ``size`` bytes, durably (the journal's torn last line)."""

    def read(self, rel: str) -> bytes:
        """The bytes of ``rel``; FileNotFoundError when it does not exist."""

    def exists(self, rel: str) -> bool: ...

    def size(self, rel: str) -> int: ...

    def leftovers(self, rel_dir: str) -> list[str]:
        """Names of temporary files in ``rel_dir``: writes in flight, or of writers that died."""

    def list(self, rel_dir: str) -> list[str]:
        """Names (not paths) in ``rel_dir``, temporary files of writes excluded; empty when it
        does not exist."""

    def remove(self, rel: str) -> None:
        """Remove ``rel``; a missing file is not an error."""

    def lock(
        self, name: str, *, shared: bool = False, blocking: bool = True, create: bool = True
    ) -> AbstractContextManager[int | None]:
        """Hold the advisory lock file ``name`` in the root (exclusive, or ``shared``) for the
        ``with`` block; ``BlockingIOError`` when not ``blocking`` and somebody else holds it.
        Without ``create`` a lock file that does not exist is not made: the block runs unlocked
        (yields None). Yields the lock file's descriptor otherwise."""
