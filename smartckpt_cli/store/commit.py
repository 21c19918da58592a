"""The one way a checkpoint comes to exist: its manifest made durable, then its ``commit`` line.

Every writer of checkpoints goes through here: the training process's save
(``engine/writer.py``), the multi-rank commit on rank 0 (``engine/multirank.py``), the
supervisor's flash persist of a RAM snapshot (``supervise/flash.py``), a restore that adopts a
checkpoint from the remote tier (``remote/tier.py``), the remote tier's commit object
(``remote/plan.py``: the same line, in the remote's journal) and the journal's repair
(``ops/repair.py``, which writes the same lines into a rebuilt journal). So the commit line's
fields are written in one place, and the order is kept in one place:

1. every blob durable (the caller: blobs are written as they are encoded, by whoever encodes);
2. :func:`write_manifest`: the manifest written, fsynced and renamed, its directory fsynced;
3. :func:`commit`: the journal's ``commit`` line appended and fsynced — **the commit point**.

Before 3 nothing exists: a crash leaves garbage that garbage collection removes. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from smartckpt_cli.store import codec
from smartckpt_cli.store.journal import Journal, encode_manifest
from smartckpt_cli.store.storage.base import Storage

__all__ = ["CommitLine", "adopt", "commit", "replicated", "write_manifest"]


@dataclass(frozen=True)
class CommitLine:
    """A ``commit`` line's fields (the journal's grammar, store/names.py, checks their names)."""

    step: int
    id: str
    manifest: str  # rank 0's part when several ranks wrote one each
    manifest_hash: str
    health: str = "ok"
    calm: bool = True
    reason: str | None = None
    score: float | None = None
    bytes_new: int = 0  # encoded bytes this checkpoint wrote
    bytes_total: int = 0  # encoded bytes it references (shared ones included)
    lineage: str | None = None  # the training it continues (engine/manager.py)
    world_size: int | None = None  # several ranks: how many, and each rank's part
    parts: tuple[tuple[str, ...], ...] | None = None  # (manifest, its hash[, the disk's id])
    repaired: bool = False  # put back by `smartckpt verify --repair` (ops/repair.py)

    def event(self) -> dict[str, Any]:
        line: dict[str, Any] = {
            "event": "commit",
            "step": self.step,
            "id": self.id,
            "manifest": self.manifest,
            "manifest_hash": self.manifest_hash,
            "health": self.health,
            "calm": self.calm,
            "reason": self.reason,
            "score": self.score,
            "bytes_new": self.bytes_new,
            "bytes_total": self.bytes_total,
        }
        if self.lineage:
            line["lineage"] = self.lineage
        if self.world_size is not None:
            line["world_size"] = self.world_size
            line["parts"] = [list(p) for p in self.parts or ()]
        if self.repaired:
            line["repaired"] = True
        return line

    @classmethod
    def of(cls, event: dict[str, Any]) -> CommitLine:
        """The line of a commit event read elsewhere (another journal); KeyError/ValueError when
        it is not one."""
        if event.get("event") != "commit":
            raise ValueError("not a commit line")
        parts = event.get("parts")
        return cls(
            step=int(event["step"]),
            id=str(event["id"]),
            manifest=str(event["manifest"]),
            manifest_hash=str(event["manifest_hash"]),
            health=str(event.get("health", "ok")),
            calm=bool(event.get("calm", True)),
            reason=event.get("reason"),
            score=event.get("score"),
            bytes_new=int(event.get("bytes_new") or 0),
            bytes_total=int(event.get("bytes_total") or 0),
            lineage=event.get("lineage"),
            world_size=int(event["world_size"]) if event.get("world_size") is not None else None,
            parts=tuple(tuple(str(x) for x in p) for p in parts) if parts is not None else None,
            repaired=bool(event.get("repaired", False)),
        )


def write_manifest(storage: Storage, rel: str, manifest: dict[str, Any]) -> tuple[bytes, str]:
    """Step 2: ``manifest`` durable at ``rel``; (its bytes, its hash for the commit line)."""
    data = encode_manifest(manifest)
    storage.write(rel, data)
    return data, codec.blob_id(data)


def commit(journal: Journal, line: CommitLine) -> dict[str, Any]:
    """Step 3, the commit point: the line appended and fsynced. Only after every blob and the
    manifest(s) it names are durable. Returns the event as written."""
    event = line.event()
    journal.append(event)
    return event


def adopt(journal: Journal, event: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint committed in another journal of the same store (the remote tier's), whose
    manifest and blobs this store now holds durably: committed here with the same line, as it
    is (checked to be a commit line first: fields a newer writer added are kept)."""
    CommitLine.of(event)
    journal.append(event)
    return event


def replicated(event: dict[str, Any]) -> dict[str, Any]:
    """The line a replica's journal commits for ``event`` (the remote tier's commit object,
    remote/plan.py): the same line, checked to be a commit line."""
    CommitLine.of(event)
    return dict(event)
