"""The one garbage collection of a repository, on any backend: manifests first, then blobs.

What to keep is decided by the caller from its journal (pure): a store keeps every manifest a
live commit names and the evidence of a damaged journal (:mod:`.retention`); a replica keeps,
besides, the parts of steps another rank has not finished (:mod:`smartckpt_cli.remote.check`).
:func:`sweep` then does the same thing for both: it reads the blobs each kept manifest names —
a kept manifest that cannot be read stops it (treating it as naming nothing would delete a live
checkpoint's blobs) —, removes the manifests it is told to (before their blobs: a manifest never
names a missing blob), and every blob no kept manifest names. Only names of the format are ever
removed. The caller holds the lock that keeps writers out (``gc.lock``; a replica's
``remote.lock``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from smartckpt_cli.errors import JournalError
from smartckpt_cli.store.blobs import BlobStore
from smartckpt_cli.store.journal import decode_manifest
from smartckpt_cli.store.storage import Storage

__all__ = ["Swept", "manifest_blobs", "read_kept", "sweep"]


@dataclass
class Swept:
    blobs: list[str] = field(default_factory=list)  # removed
    freed: int = 0  # bytes, when sizes were asked for


def manifest_blobs(manifest: dict[str, Any]) -> set[str]:
    """Every blob a manifest names (data and patch chunks of every entry)."""
    out: set[str] = set()
    for entry in manifest.get("entries", {}).values():
        for stream in (entry.get("data"), entry.get("patch")):
            for chunk in (stream or {}).get("chunks", []):
                out.add(chunk[0])
    return out


def read_kept(storage: Storage, rel: str, cache: dict[str, dict[str, Any]] | None = None) -> set[str]:
    """The blobs kept manifest ``rel`` names; nothing when it is gone (nothing left to protect);
    JournalError when it cannot be read. ``cache`` keeps parsed manifests (they never change)."""
    if cache is not None and rel in cache:
        return manifest_blobs(cache[rel])
    try:
        manifest = decode_manifest(storage.read(rel), rel)
    except FileNotFoundError:
        return set()
    except (OSError, ValueError) as err:
        raise JournalError(f"garbage collection stopped: cannot read manifest {rel}: {err}") from err
    if cache is not None:
        cache[rel] = manifest
    return manifest_blobs(manifest)


def sweep(
    storage: Storage,
    keep: Iterable[str],
    remove: Iterable[str],
    blob_ids: Iterable[str],
    *,
    sizes: bool = False,
    cache: dict[str, dict[str, Any]] | None = None,
) -> Swept:
    """Remove the manifests ``remove`` (never one in ``keep``), then every blob of ``blob_ids``
    that no manifest of ``keep`` names. With ``sizes``, the bytes freed are counted (a stat per
    removed blob)."""
    kept = set(keep)
    referenced: set[str] = set()
    for rel in sorted(kept):
        referenced |= read_kept(storage, rel, cache)
    for rel in sorted(set(remove) - kept):
        storage.remove(rel)
        if cache is not None:
            cache.pop(rel, None)
    blobs = BlobStore(storage)
    out = Swept()
    for bid in sorted(set(blob_ids) - referenced):
        if sizes:
            try:
                out.freed += blobs.size(bid)
            except OSError:
                continue  # gone meanwhile
        blobs.remove(bid)
        out.blobs.append(bid)
    return out
