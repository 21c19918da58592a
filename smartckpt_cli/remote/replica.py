"""The replica: a second repository of the store's own format (blobs, manifests, a journal) on
any backend (:mod:`smartckpt_cli.store.storage`), kept in step by the replicator.

Its journal has the objects layout (:mod:`smartckpt_cli.store.log`) whatever the backend: an
object store cannot append, and the nodes of a multi-node job write one replica at once, each
event under a name no other writer uses. The commit rule is the local one: a checkpoint exists
remotely only once its ``commit`` object exists, written last, after every blob and the manifest.
"""

from __future__ import annotations

from typing import Any

from smartckpt_cli.redact import redact_url
from smartckpt_cli.store.journal import Journal
from smartckpt_cli.store.storage import Limiter, Storage, open_storage

__all__ = ["display_url", "open_remote", "replica_journal"]

MIN_PART_MB = 5  # S3 refuses multipart parts under 5 MiB (but the last)


def display_url(url: str) -> str:
    """``url`` without what must never reach a log or a file: the userinfo of any scheme (a
    secret with ``/`` in it included) and the values of credential query parameters."""
    return redact_url(url)


def open_remote(url: str, settings: Any = None) -> Storage:
    """The replica's backend for ``url``, writing under ``settings``' bandwidth cap and part
    size (none given: unlimited, 8 MiB parts); ConfigError (one line) when it cannot be used."""
    if settings is None:
        return open_storage(url)
    return open_storage(
        url,
        limiter=Limiter(settings.remote_bandwidth_mb * (1 << 20)),
        part_bytes=max(MIN_PART_MB, settings.remote_part_mb) << 20,
    )


def replica_journal(storage: Storage) -> Journal:
    """The journal of a replica on ``storage`` (objects layout; see the module's docstring)."""
    return Journal(storage, layout="objects")
