"""Local filesystem backend: temp file, fsync, rename, fsync of the directory.

The rename is what makes a file appear; the directory fsync is what makes the rename survive a
power cut. Temporary names carry the pid so leftovers of a killed process are recognisable and
collected later (``*.tmp.*``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from smartckpt_cli._faults import fault_point
from smartckpt_cli.storage.base import Buffer

__all__ = ["TMP_MARK", "LocalStorage", "file_lock"]

logger = logging.getLogger(__name__)

TMP_MARK = ".tmp."
_counter = itertools.count()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStorage:
    """A directory on a local (or NFS) filesystem."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def path(self, rel: str) -> Path:
        return self.root / rel

    def write(self, rel: str, data: Buffer | Sequence[Buffer], *, sync_dir: bool = True) -> None:
        final = self.path(rel)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f"{final.name}{TMP_MARK}{os.getpid()}.{next(_counter)}")
        parts: Sequence[Buffer] = [data] if isinstance(data, bytes | bytearray | memoryview) else data
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for part in parts:
                view = memoryview(part).cast("B")
                while view:
                    written = os.write(fd, view)
                    view = view[written:]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.close(fd)
        fault_point("blob.written" if rel.startswith("blobs/") else "manifest.written")
        os.replace(tmp, final)
        fault_point("blob.renamed" if rel.startswith("blobs/") else "manifest.renamed")
        if sync_dir:
            _fsync_dir(final.parent)

    def sync_dirs(self, dirs: Iterable[str]) -> None:
        for d in sorted(set(dirs)):
            _fsync_dir(self.path(d))

    def append(self, rel: str, data: bytes) -> None:
        path = self.path(rel)
        created = not path.exists()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        if created:
            _fsync_dir(path.parent)

    def read(self, rel: str) -> bytes:
        return self.path(rel).read_bytes()

    def exists(self, rel: str) -> bool:
        return self.path(rel).exists()

    def size(self, rel: str) -> int:
        return self.path(rel).stat().st_size

    def list(self, rel_dir: str) -> list[str]:
        try:
            return sorted(os.listdir(self.path(rel_dir)))
        except FileNotFoundError:
            return []

    def remove(self, rel: str) -> None:
        try:
            os.unlink(self.path(rel))
        except FileNotFoundError:
            pass


@contextlib.contextmanager
def file_lock(path: Path, *, shared: bool = False, blocking: bool = True) -> Iterator[int]:
    """An fcntl lock on ``path`` (created if needed). Raises BlockingIOError when not blocking
    and somebody else holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        flags = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
        if not blocking:
            flags |= fcntl.LOCK_NB
        try:
            fcntl.flock(fd, flags)
        except OSError as err:
            if err.errno in (errno.EAGAIN, errno.EACCES):
                raise BlockingIOError(err.errno, str(path)) from err
            raise
        yield fd
    finally:
        os.close(fd)
