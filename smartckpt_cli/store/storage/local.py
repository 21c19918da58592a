"""Local filesystem backend: temp file, fsync, rename, fsync of the directory.

The rename is what makes a file appear; the directory fsync is what makes the rename survive a
power cut. Temporary names carry the pid so leftovers of a killed process are recognisable and
collected later (``<name>.tmp.<pid>.<n>``).

Every relative name is checked (:func:`~smartckpt_cli.store.names.check_rel`) and resolved before
use: a name that would land outside the root — through ``..``, an absolute name, or a symlink
planted inside the store (``blobs/`` pointing at someone's home) — is refused with
:class:`~smartckpt_cli.errors.UnsafePathError`, for reading, writing and deleting alike.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import itertools
import logging
import mmap
import os
import stat
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from smartckpt_cli._faults import fault_point
from smartckpt_cli.errors import UnsafePathError
from smartckpt_cli.store.names import TMP_MARK, InvalidName, check_rel, is_temporary
from smartckpt_cli.store.storage.base import Buffer
from smartckpt_cli.store.storage.limiter import Limiter

__all__ = ["LocalStorage", "PendingWrite", "file_lock"]

logger = logging.getLogger(__name__)

_counter = itertools.count()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStorage:
    """A directory on a local (or NFS) filesystem. With a ``limiter`` (a ``file://`` remote under
    ``remote_bandwidth_mb``) every write takes its bytes from it, ``part_bytes`` at a time."""

    appends = True

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        url: str | None = None,
        limiter: Limiter | None = None,
        part_bytes: int = 8 << 20,
    ) -> None:
        self.root = Path(root)
        self._root_str = str(self.root)
        self.url = url or self._root_str  # as the user named it (file://...), for messages
        self._real_root: str | None = None
        self._limiter = limiter if limiter is not None and limiter.rate > 0 else None
        self._part_bytes = part_bytes

    def path(self, rel: str) -> Path:
        """The path of ``rel`` under the root, once it is known to stay there: the name passes
        the grammar's generic rule and its resolved form (symlinks followed) is inside the
        resolved root. Raises UnsafePathError otherwise."""
        try:
            check_rel(rel)
        except InvalidName as err:
            raise UnsafePathError(f"{self.root}: {err}; refused") from None
        path = self.root / rel
        # Walk the name's components below the root: a symlink among them is followed (realpath)
        # and must land inside the resolved root. One lstat per component, not realpath's walk
        # of the whole absolute path: this runs for every blob a save or a restore touches.
        probe = self._root_str
        for part in rel.split("/"):
            probe = f"{probe}/{part}"
            try:
                mode = os.lstat(probe).st_mode
            except (FileNotFoundError, NotADirectoryError):
                break  # nothing below a missing component exists yet
            if stat.S_ISLNK(mode):
                self._check_link(path)
                break
        return path

    def _check_link(self, path: Path) -> None:
        if self._real_root is None:
            self._real_root = os.path.realpath(self.root)
        real, root = os.path.realpath(path), self._real_root
        if real != root and not real.startswith(root.rstrip(os.sep) + os.sep):
            raise UnsafePathError(
                f"{path} resolves to {real}, outside the store {self.root} (a symlink pointing "
                "outside); refused"
            )

    def begin(self, rel: str, data: Buffer | Sequence[Buffer]) -> PendingWrite:
        """First half of an atomic write: the bytes go to a temporary file and the kernel starts
        writing them back at once (``sync_file_range``), without waiting. Many files can be in
        flight while the next ones are being encoded; ``PendingWrite.finish`` then makes each
        durable and gives it its name. A crash in between leaves only a temporary file."""
        final = self.path(rel)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f"{final.name}{TMP_MARK}{os.getpid()}.{next(_counter)}")
        parts: Sequence[Buffer] = [data] if isinstance(data, bytes | bytearray | memoryview) else data
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for part in parts:
                view = memoryview(part).cast("B")
                while view:
                    if self._limiter is not None:
                        view, rest = view[: self._part_bytes], view[self._part_bytes :]
                        self._limiter.take(len(view))
                    else:
                        rest = view[len(view) :]
                    while view:
                        written = os.write(fd, view)
                        view = view[written:]
                    view = rest
            _start_writeback(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        kind = "blob" if rel.startswith("blobs/") else "manifest" if rel.startswith("manifests/") else "file"
        return PendingWrite(fd, tmp, final, kind)

    def write(self, rel: str, data: Buffer | Sequence[Buffer], *, sync_dir: bool = True) -> None:
        pending = self.begin(rel, data)
        pending.sync_dir = sync_dir
        pending.finish()

    def read_view(self, rel: str) -> mmap.mmap | bytes:
        """The file's bytes without copying them into the process (a read-only mapping)."""
        with open(self.path(rel), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return b""
            return mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)

    def sync_dirs(self, dirs: Iterable[str]) -> None:
        """Make the names in ``dirs`` durable, and the directories themselves: a fan-out
        directory (``blobs/ab``) made by this save exists after a power cut only once its parent
        is fsynced too (POSIX does not promise it; ext4 and XFS happen to)."""
        wanted = set(dirs)
        parents = {str(Path(d).parent) for d in wanted if str(Path(d).parent) not in ("", ".")}
        for d in sorted(wanted | parents, key=lambda d: (-d.count("/"), d)):  # children first
            _fsync_dir(self.path(d))

    def append(self, rel: str, data: bytes) -> None:
        """Append every byte of ``data`` and fsync, or fail leaving the file as it was.

        ``os.write`` may write less than asked (a full disk, NFS, FUSE): it is called until every
        byte is written. When a write or the fsync fails, the file is cut back to its size before
        the append, so a line that is not durable is never left for a reader to take as whole."""
        path = self.path(rel)
        created = not path.exists()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            before = os.fstat(fd).st_size
            try:
                view = memoryview(data)
                while view:
                    n = os.write(fd, view)
                    if n <= 0:
                        raise OSError(errno.EIO, f"append to {path} wrote nothing")
                    view = view[n:]
                os.fsync(fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, before)
                    os.fsync(fd)
                raise
        finally:
            os.close(fd)
        if created:
            _fsync_dir(path.parent)

    def truncate(self, rel: str, size: int) -> None:
        with open(self.path(rel), "rb+") as f:
            f.truncate(size)
            f.flush()
            os.fsync(f.fileno())

    def read(self, rel: str) -> bytes:
        return self.path(rel).read_bytes()

    def exists(self, rel: str) -> bool:
        return self.path(rel).exists()

    def size(self, rel: str) -> int:
        return self.path(rel).stat().st_size

    def _names(self, rel_dir: str) -> list[str]:
        try:
            return sorted(os.listdir(self.path(rel_dir)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def leftovers(self, rel_dir: str) -> list[str]:
        return [n for n in self._names(rel_dir) if is_temporary(n)]

    def list(self, rel_dir: str) -> list[str]:
        return [n for n in self._names(rel_dir) if not is_temporary(n)]

    def remove(self, rel: str) -> None:
        try:
            os.unlink(self.path(rel))
        except FileNotFoundError:
            pass

    @contextlib.contextmanager
    def lock(
        self, name: str, *, shared: bool = False, blocking: bool = True, create: bool = True
    ) -> Iterator[int | None]:
        path = self.path(name)
        if not create and not path.exists():
            yield None
            return
        with file_lock(path, shared=shared, blocking=blocking) as fd:
            yield fd


class PendingWrite:
    """A temporary file written but not yet durable nor named (see ``LocalStorage.begin``)."""

    def __init__(self, fd: int, tmp: Path, final: Path, kind: str, sync_dir: bool = True) -> None:
        self.fd, self.tmp, self.final, self.kind = fd, tmp, final, kind
        self.sync_dir = sync_dir

    def finish(self) -> None:
        """fsync, rename to the final name, fsync the directory: a file never has its final name
        before its content is durable (dedup trusts that a blob which exists is whole), and the
        name is durable when this returns. Many finishes run at once and share the filesystem's
        journal commits."""
        try:
            os.fsync(self.fd)
        except BaseException:
            self.abort()
            raise
        os.close(self.fd)
        self.fd = -1
        fault_point(f"{self.kind}.written")
        os.replace(self.tmp, self.final)
        fault_point(f"{self.kind}.renamed")
        if self.sync_dir:
            _fsync_dir(self.final.parent)

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        with contextlib.suppress(OSError):
            os.unlink(self.tmp)


def _load_sync_file_range() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    return fn


_sync_file_range = _load_sync_file_range() if sys.platform.startswith("linux") else None
_SYNC_FILE_RANGE_WRITE = 2


def _start_writeback(fd: int) -> None:
    # Linux: start writing the dirty pages now, asynchronously, so the disk works while the next
    # chunks are encoded; the fsync in finish() then has little left to wait for. Elsewhere the
    # fsync alone does the job.
    if _sync_file_range is not None:
        _sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


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
