"""Object-store backend: any fsspec filesystem (s3fs for ``s3://``, gcsfs, ``memory://``).

An object appears whole or not at all: a single PUT, or a multipart upload that completes only
at its last call, so a process killed mid-upload leaves no object (only an incomplete multipart
upload, which S3 lifecycle rules expire) — the temporary-name-and-rename of the local backend is
built in. There is no append and no lock: ``appends`` is False, and the journal keeps one object
per event instead of a file of lines (:mod:`smartckpt_cli.store.log`).

Credentials come only from fsspec/boto's own mechanisms (environment variables, config files,
instance roles); nothing here stores or logs them: ``url`` is the URL without any
(``hooks/_smartckpt_redact.py``, the one home of that rule). Every relative name is checked
(:func:`~smartckpt_cli.store.names.check_rel`): nothing read from a bucket can make a node write
outside the prefix.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from smartckpt_cli.errors import UnsafePathError
from smartckpt_cli.redact import redact_url
from smartckpt_cli.store.names import InvalidName, check_rel
from smartckpt_cli.store.storage.base import Buffer
from smartckpt_cli.store.storage.limiter import NO_LIMIT, Limiter

__all__ = ["ObjectStorage"]

logger = logging.getLogger(__name__)


def _chunks(view: memoryview, size: int) -> Iterator[memoryview]:
    for pos in range(0, len(view), size):
        yield view[pos : pos + size]


def _joined(data: Buffer | Sequence[Buffer]) -> memoryview:
    if isinstance(data, bytes | bytearray | memoryview):
        return memoryview(data).cast("B")
    return memoryview(b"".join(bytes(memoryview(p).cast("B")) for p in data))


class _PendingPut:
    """An object store has no temporary name: the object is uploaded whole at ``finish``."""

    def __init__(self, storage: ObjectStorage, rel: str, data: memoryview) -> None:
        self.storage, self.rel, self.data = storage, rel, data

    def finish(self) -> None:
        self.storage.write(self.rel, self.data)

    def abort(self) -> None:
        self.data = memoryview(b"")


class ObjectStorage:
    """Any fsspec filesystem. For ``s3://`` the endpoint may come from ``AWS_ENDPOINT_URL``
    (MinIO, Ceph, a test server); keys come from boto's usual chain, never from smartckpt."""

    appends = False

    def __init__(self, url: str, *, limiter: Limiter | None = None, part_bytes: int = 8 << 20) -> None:
        import fsspec

        # The bucket and prefix come from the URL without its userinfo: a secret holding "/" must
        # not become part of the object names (nor of any message naming them).
        self.url = redact_url(url)
        self.protocol, _, rest = self.url.partition("://")
        self.base = rest.split("?", 1)[0].rstrip("/")
        if self.url.partition("?")[0] != url.partition("?")[0]:
            logger.warning(
                "remote %s: credentials in the URL are not used; give them the usual way "
                "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, a profile, an instance role)",
                self.url,
            )
        self._limiter = limiter or NO_LIMIT
        self._part_bytes = part_bytes
        self.fs = fsspec.filesystem(self.protocol, **self._options())

    def _options(self) -> dict[str, Any]:
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
        return options

    def _path(self, rel: str) -> str:
        if not rel:
            return self.base
        try:
            return f"{self.base}/{check_rel(rel, 'remote object')}"
        except InvalidName as err:
            raise UnsafePathError(f"remote {self.url}: {err}; refused") from None

    def write(self, rel: str, data: Buffer | Sequence[Buffer], *, sync_dir: bool = True) -> None:
        view = _joined(data)
        if len(view) <= self._part_bytes:
            self._limiter.take(len(view))
            self.fs.pipe_file(self._path(rel), bytes(view))  # one PUT: atomic
            return
        # Multipart: each write of a full block uploads one part; the object appears only at
        # close() (CompleteMultipartUpload). A kill before that leaves no object.
        with self.fs.open(self._path(rel), "wb", block_size=self._part_bytes) as f:
            for part in _chunks(view, self._part_bytes):
                self._limiter.take(len(part))
                f.write(part)

    def begin(self, rel: str, data: Buffer | Sequence[Buffer]) -> _PendingPut:
        self._path(rel)  # refuse a bad name now, as the local backend does
        return _PendingPut(self, rel, _joined(data))

    def read(self, rel: str) -> bytes:
        return bytes(self.fs.cat_file(self._path(rel)))

    def read_view(self, rel: str) -> bytes:
        return self.read(rel)

    def exists(self, rel: str) -> bool:
        return bool(self.fs.exists(self._path(rel)))

    def size(self, rel: str) -> int:
        return int(self.fs.size(self._path(rel)))

    def leftovers(self, rel_dir: str) -> list[str]:
        return []  # an upload that did not complete is no object

    def list(self, rel_dir: str) -> list[str]:
        try:
            entries = self.fs.ls(self._path(rel_dir), detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted(str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def remove(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._path(rel))

    def sync_dirs(self, dirs: Iterable[str]) -> None:
        return None  # an object is durable when its PUT returns

    def append(self, rel: str, data: bytes) -> None:
        raise OSError(f"remote {self.url}: an object store has no append")

    def truncate(self, rel: str, size: int) -> None:
        raise OSError(f"remote {self.url}: an object store has no truncate")

    @contextlib.contextmanager
    def lock(
        self, name: str, *, shared: bool = False, blocking: bool = True, create: bool = True
    ) -> Iterator[int | None]:
        # No lock exists on an object store: its writers never need one (each journal event is
        # an object of its own name; the replicator's rounds hold remote.lock in the local
        # meta_dir). The block runs unlocked, as for a lock file that does not exist.
        yield None
