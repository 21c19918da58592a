"""Where remote bytes go: fsspec filesystems (s3fs for ``s3://``, gcsfs, ...) and plain
directories (``file://``: a second disk, an NFS mount).

Every object is written whole or not at all: a directory write goes to a temporary name and is
renamed; an S3 object appears only when its single PUT or its multipart upload completes, so a
process killed mid-upload leaves no object (only an incomplete multipart upload, which S3
lifecycle rules expire). Credentials come only from fsspec/boto's own mechanisms (environment
variables, config files, instance roles); nothing here stores or logs them, and ``display_url``
strips any that a URL carries (``hooks/_smartckpt_redact.py``, the one home of that rule).

Like the local backend, every backend checks each relative name it is given
(:func:`~smartckpt_cli.store.names.check_rel`) and a directory remote refuses any path that
resolves outside its root: nothing read from a bucket can make a node write outside the prefix.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from smartckpt_cli.errors import ConfigError, UnsafePathError
from smartckpt_cli.redact import redact_url
from smartckpt_cli.store.names import InvalidName, check_rel

__all__ = ["DirRemote", "FsspecRemote", "Limiter", "Remote", "display_url", "open_remote"]

logger = logging.getLogger(__name__)


def display_url(url: str) -> str:
    """``url`` without what must never reach a log or a file: the userinfo of any scheme (a
    secret with ``/`` in it included) and the values of credential query parameters."""
    return redact_url(url)


def _checked(rel: str, url: str) -> str:
    try:
        return check_rel(rel, "remote object")
    except InvalidName as err:
        raise UnsafePathError(f"remote {display_url(url)}: {err}; refused") from None


class Limiter:
    """A shared bandwidth cap (bytes per second; 0 = unlimited) for every upload thread."""

    def __init__(self, bytes_per_second: float) -> None:
        self.rate = bytes_per_second
        self._lock = threading.Lock()
        self._next = time.monotonic()

    def take(self, n: int) -> None:
        if self.rate <= 0 or n <= 0:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + n / self.rate
            delay = self._next - now
        if delay > 0:
            time.sleep(delay)


class Remote(Protocol):
    """A remote store. Paths are relative ('blobs/ab/ab12..'). Called from the replicator's
    threads, restore and the CLI; every call may raise OSError (or a backend error) when the
    remote is down, and callers retry."""

    url: str

    def put(self, rel: str, data: bytes | memoryview, *, part_bytes: int, limiter: Limiter) -> None:
        """Write ``rel`` whole or not at all; multipart in ``part_bytes`` parts when larger."""

    def get(self, rel: str) -> bytes:
        """The object's bytes; FileNotFoundError when it does not exist."""

    def exists(self, rel: str) -> bool: ...

    def list(self, rel_dir: str) -> list[str]:
        """Names (not paths) directly under ``rel_dir``; empty when there is none."""

    def remove(self, rel: str) -> None:
        """Remove ``rel``; a missing object is not an error."""


def _chunks(data: bytes | memoryview, size: int) -> Iterator[memoryview]:
    view = memoryview(data).cast("B")
    for pos in range(0, len(view), size):
        yield view[pos : pos + size]


class DirRemote:
    """``file://`` and plain paths: a directory, written with temp name + fsync + rename."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.root = Path(url[len("file://") :] if url.startswith("file://") else url)
        self._n = 0
        self._lock = threading.Lock()

    def _at(self, rel: str) -> Path:
        """The path of ``rel`` under the root, refused when it would resolve outside it."""
        path = self.root / _checked(rel, self.url)
        real, root = os.path.realpath(path), os.path.realpath(self.root)
        if real != root and not real.startswith(root.rstrip(os.sep) + os.sep):
            raise UnsafePathError(
                f"remote object {rel} resolves to {real}, outside the remote {self.root}; refused"
            )
        return path

    def _tmp(self, final: Path) -> Path:
        with self._lock:
            self._n += 1
            n = self._n
        return final.with_name(f"{final.name}.tmp.{os.getpid()}.{n}")

    def put(self, rel: str, data: bytes | memoryview, *, part_bytes: int, limiter: Limiter) -> None:
        final = self._at(rel)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._tmp(final)
        try:
            with open(tmp, "wb") as f:
                for part in _chunks(data, part_bytes):
                    limiter.take(len(part))
                    f.write(part)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def get(self, rel: str) -> bytes:
        return self._at(rel).read_bytes()

    def exists(self, rel: str) -> bool:
        return self._at(rel).is_file()

    def list(self, rel_dir: str) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self._at(rel_dir)) if ".tmp." not in n)
        except (FileNotFoundError, NotADirectoryError):
            return []

    def remove(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._at(rel))


class FsspecRemote:
    """Any fsspec filesystem. For ``s3://`` the endpoint may come from ``AWS_ENDPOINT_URL``
    (MinIO, Ceph, a test server); keys come from boto's usual chain, never from smartckpt."""

    def __init__(self, url: str) -> None:
        import fsspec

        self.url = url
        # The bucket and prefix come from the URL without its userinfo: a secret holding "/" must
        # not become part of the object names (nor of any message naming them).
        clean = redact_url(url)
        self.protocol, _, rest = clean.partition("://")
        self.base = rest.split("?", 1)[0].rstrip("/")
        if clean.partition("?")[0] != url.partition("?")[0]:
            logger.warning(
                "remote %s: credentials in the URL are not used; give them the usual way "
                "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, a profile, an instance role)",
                clean,
            )
        options: dict[str, Any] = {"skip_instance_cache": True, "use_listings_cache": False}
        if self.protocol in ("s3", "s3a"):
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            if endpoint:
                options["endpoint_url"] = endpoint
            # Fail fast when the remote is down: the replicator retries with its own backoff,
            # and restore must fall through to what is local without hanging.
            options["config_kwargs"] = {
                "connect_timeout": 5,
                "read_timeout": 60,
                "retries": {"max_attempts": 2},
            }
        self.fs = fsspec.filesystem(self.protocol, **options)

    def _path(self, rel: str) -> str:
        return f"{self.base}/{_checked(rel, self.url)}" if rel else self.base

    def put(self, rel: str, data: bytes | memoryview, *, part_bytes: int, limiter: Limiter) -> None:
        view = memoryview(data).cast("B")
        if len(view) <= part_bytes:
            limiter.take(len(view))
            self.fs.pipe_file(self._path(rel), bytes(view))  # one PUT: atomic
            return
        # Multipart: each write of a full block uploads one part; the object appears only at
        # close() (CompleteMultipartUpload). A kill before that leaves no object.
        with self.fs.open(self._path(rel), "wb", block_size=part_bytes) as f:
            for part in _chunks(view, part_bytes):
                limiter.take(len(part))
                f.write(part)

    def get(self, rel: str) -> bytes:
        data = self.fs.cat_file(self._path(rel))
        return bytes(data)

    def exists(self, rel: str) -> bool:
        return bool(self.fs.exists(self._path(rel)))

    def list(self, rel_dir: str) -> list[str]:
        try:
            entries = self.fs.ls(self._path(rel_dir), detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted(str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def remove(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._path(rel))


def open_remote(url: str) -> Remote:
    """A backend for ``url``; ConfigError (one line) when it cannot be used here."""
    if not url or ("://" not in url and not url.startswith("/")):
        raise ConfigError(f"remote must be a URL such as s3://bucket/prefix or file:///path, not {url!r}")
    if url.startswith(("file://", "/")):
        return DirRemote(url)
    scheme = url.split("://", 1)[0]
    try:
        import fsspec
    except ImportError:
        raise ConfigError(
            f"remote {display_url(url)} needs fsspec: pip install 'smartckpt[remote]'"
        ) from None
    try:
        fsspec.get_filesystem_class(scheme)
    except (ImportError, ValueError) as err:
        raise ConfigError(f"remote {display_url(url)}: no fsspec backend for '{scheme}://' ({err})") from None
    try:
        return FsspecRemote(url)
    except (ImportError, ValueError, TypeError) as err:
        raise ConfigError(f"remote {display_url(url)}: {err}") from None
