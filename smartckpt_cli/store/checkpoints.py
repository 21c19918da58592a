"""Which committed checkpoints exist, newest first, and their manifests, verified. No torch.

Selection is pure (:func:`candidates`): newest means latest in the journal, never by clock.
:func:`read_manifest` reads one manifest and checks it against the hash its commit line recorded,
so ``inspect``, ``verify``, ``prune``, ``rollback`` and a restore all see the same checkpoint the
same way.
"""

from __future__ import annotations

from typing import Any

from smartckpt_cli.errors import CheckpointCorrupt
from smartckpt_cli.store import codec
from smartckpt_cli.store.journal import CheckpointRecord, decode_manifest
from smartckpt_cli.store.storage.base import Storage

__all__ = ["candidates", "read_manifest"]


def candidates(records: list[CheckpointRecord], *, include_unhealthy: bool = False) -> list[CheckpointRecord]:
    """Live checkpoints, newest first. Newest means latest in the journal, never by clock."""
    live = [r for r in records if r.live and (include_unhealthy or r.health == "ok")]
    return sorted(live, key=lambda r: r.position, reverse=True)


def read_manifest(storage: Storage, record: CheckpointRecord, store_id: str | None) -> dict[str, Any]:
    if record.invalid is not None:  # its names are not the format's: never opened
        raise CheckpointCorrupt(record.invalid, tier="L1")
    try:
        data = storage.read(record.manifest)
    except FileNotFoundError as err:
        raise CheckpointCorrupt(
            f"step {record.step}: manifest {record.manifest} is missing", tier="L1"
        ) from err
    except OSError as err:  # permissions changed since the save, a symlink out: skip it like damage
        raise CheckpointCorrupt(
            f"step {record.step}: manifest {record.manifest} is unreadable: {err.strerror or err}", tier="L1"
        ) from err
    if codec.blob_id(data) != record.manifest_hash:
        raise CheckpointCorrupt(f"step {record.step}: manifest {record.manifest} hash mismatch", tier="L1")
    try:
        manifest = decode_manifest(data, record.manifest)
    except ValueError as err:
        raise CheckpointCorrupt(f"step {record.step}: {err}", tier="L1") from err
    if store_id is not None and manifest.get("store_id") != store_id:
        raise CheckpointCorrupt(f"step {record.step}: manifest belongs to another store", tier="L1")
    return manifest
