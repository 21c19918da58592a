"""The backend for a URL: a directory (a path, ``file://``) or an object store (fsspec)."""

from __future__ import annotations

from smartckpt_cli.errors import ConfigError
from smartckpt_cli.redact import redact_url
from smartckpt_cli.store.storage.base import Storage
from smartckpt_cli.store.storage.limiter import Limiter
from smartckpt_cli.store.storage.local import LocalStorage

__all__ = ["is_url", "open_storage"]


def is_url(text: str) -> bool:
    """Whether a store argument names an object store or a ``file://`` URL (not a path)."""
    return "://" in text


def open_storage(
    url: str, *, what: str = "remote", limiter: Limiter | None = None, part_bytes: int = 8 << 20
) -> Storage:
    """A backend for ``url``; ConfigError (one line) when it cannot be used here. ``what`` names
    the setting in that line."""
    if not url or ("://" not in url and not url.startswith("/")):
        raise ConfigError(f"{what} must be a URL such as s3://bucket/prefix or file:///path, not {url!r}")
    if url.startswith(("file://", "/")):
        root = url[len("file://") :] if url.startswith("file://") else url
        return LocalStorage(root, url=url, limiter=limiter, part_bytes=part_bytes)
    scheme = url.split("://", 1)[0]
    shown = redact_url(url)
    try:
        import fsspec
    except ImportError:
        raise ConfigError(f"{what} {shown} needs fsspec: pip install 'smartckpt[remote]'") from None
    try:
        fsspec.get_filesystem_class(scheme)
    except (ImportError, ValueError) as err:
        raise ConfigError(f"{what} {shown}: no fsspec backend for '{scheme}://' ({err})") from None
    from smartckpt_cli.store.storage.objects import ObjectStorage

    try:
        return ObjectStorage(url, limiter=limiter, part_bytes=part_bytes)
    except (ImportError, ValueError, TypeError) as err:
        raise ConfigError(f"{what} {shown}: {err}") from None
