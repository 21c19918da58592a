"""Manifests and the append-only journal: the commit point.

A checkpoint exists once, and only once, its ``commit`` line is in ``journal.jsonl`` and fsynced.
Everything before that (blobs, the manifest) is invisible garbage if the process dies; everything
after it (pruning old checkpoints) only ever removes what a newer commit has replaced.

Each journal line is one JSON object with a ``crc`` field: the xxh3-64 of the line's canonical
JSON without that field. A line that does not parse or whose crc does not match is reported and
skipped: at the end of the file that is a torn write from a crash; elsewhere it is damage.
The first line declares the format and version; an unknown version is refused.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from smartckpt_cli._faults import crash, fault_active, fault_point
from smartckpt_cli.errors import JournalError
from smartckpt_cli.store.storage.base import Storage
from smartckpt_cli.store.storage.local import file_lock

__all__ = [
    "JOURNAL",
    "JOURNAL_LOCK",
    "MANIFEST_FORMAT",
    "MANIFEST_VERSION",
    "CheckpointRecord",
    "Journal",
    "JournalState",
    "fold",
    "record_manifests",
]

logger = logging.getLogger(__name__)

JOURNAL = "journal.jsonl"
JOURNAL_LOCK = "journal.lock"  # serialises appends across processes (a run, the CLI, the supervisor)
JOURNAL_FORMAT = "smartckpt-journal"
JOURNAL_VERSION = 1
MANIFEST_FORMAT = "smartckpt-manifest"
MANIFEST_VERSION = 1


def _canonical(obj: dict[str, Any]) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def encode_line(event: dict[str, Any]) -> bytes:
    body = {k: v for k, v in event.items() if k != "crc"}
    crc = xxhash.xxh3_64_hexdigest(_canonical(body).encode())
    return (_canonical({**body, "crc": crc}) + "\n").encode()


def decode_line(line: bytes) -> dict[str, Any] | None:
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(obj, dict) or "crc" not in obj:
        return None
    crc = obj.pop("crc")
    if xxhash.xxh3_64_hexdigest(_canonical(obj).encode()) != crc:
        return None
    return obj


@dataclass
class CheckpointRecord:
    """One committed checkpoint as the journal tells it (journal order = age order)."""

    step: int
    id: str
    manifest: str
    manifest_hash: str
    position: int
    health: str = "ok"
    reason: str = ""
    score: float | None = None
    bytes_new: int = 0
    calm: bool = True
    pruned: bool = False
    rolled_back: bool = False
    event: dict[str, Any] = field(default_factory=dict)

    @property
    def live(self) -> bool:
        return not self.pruned and not self.rolled_back


@dataclass
class JournalState:
    store_id: str | None
    records: list[CheckpointRecord]
    problems: list[str]  # torn or damaged lines, for verify and for warnings
    failures: list[dict[str, Any]]  # save_failed events

    def live(self) -> list[CheckpointRecord]:
        return [r for r in self.records if r.live]


def fold(events: list[dict[str, Any]]) -> tuple[str | None, list[CheckpointRecord], list[dict[str, Any]]]:
    """Pure: replay journal events into checkpoint records.

    ``rollback {to_step}`` marks every checkpoint committed before it with a larger step as rolled
    back; ``rollback {undo: true}`` reverses the newest rollback still in force. ``prune {ids}``
    marks checkpoints whose files were (or are being) removed.
    """
    store_id: str | None = None
    records: list[CheckpointRecord] = []
    by_id: dict[str, CheckpointRecord] = {}
    rollbacks: list[list[CheckpointRecord]] = []
    failures: list[dict[str, Any]] = []
    for pos, ev in enumerate(events):
        kind = ev.get("event")
        if kind == "init":
            store_id = ev.get("store_id")
        elif kind == "commit":
            rec = CheckpointRecord(
                step=int(ev["step"]),
                id=str(ev["id"]),
                manifest=str(ev["manifest"]),
                manifest_hash=str(ev["manifest_hash"]),
                position=pos,
                health=str(ev.get("health", "ok")),
                reason=str(ev.get("reason", "")),
                score=ev.get("score"),
                bytes_new=int(ev.get("bytes_new", 0)),
                calm=bool(ev.get("calm", True)),
                event=ev,
            )
            records.append(rec)
            by_id[rec.id] = rec
        elif kind == "rollback":
            if ev.get("undo"):
                if rollbacks:
                    for rec in rollbacks.pop():
                        rec.rolled_back = False
            else:
                hit = [r for r in records if r.step > int(ev["to_step"]) and not r.rolled_back]
                for rec in hit:
                    rec.rolled_back = True
                rollbacks.append(hit)
        elif kind == "prune":
            for cid in ev.get("ids", []):
                if cid in by_id:
                    by_id[cid].pruned = True
        elif kind == "save_failed":
            failures.append(ev)
    return store_id, records, failures


class Journal:
    """``journal.jsonl`` in ``meta_dir``. Appends are made by the single writing process."""

    def __init__(self, storage: Storage, meta_root: Path) -> None:
        self.storage = storage
        self.path = meta_root / JOURNAL

    def exists(self) -> bool:
        return self.path.exists()

    def create(self, store_id: str | None = None) -> str:
        store_id = store_id or uuid.uuid4().hex
        self.storage.append(
            JOURNAL,
            encode_line(
                {
                    "event": "init",
                    "format": JOURNAL_FORMAT,
                    "v": JOURNAL_VERSION,
                    "store_id": store_id,
                }
            ),
        )
        return store_id

    def read(self) -> JournalState:
        return self.read_events()[0]

    def read_events(self, *, consistent: bool = False) -> tuple[JournalState, list[dict[str, Any]]]:
        """The folded state and every readable event, in journal order. With ``consistent``,
        the file is read under a shared ``journal.lock`` (when that lock file exists; nothing is
        created), so a line another process is appending at this moment is never seen half
        written and reported as torn."""
        try:
            raw = self._read_bytes(consistent)
        except FileNotFoundError:
            return JournalState(None, [], [], []), []
        except OSError as err:
            raise JournalError(f"cannot read journal {self.path}: {err.strerror}") from err
        lines = raw.split(b"\n")
        if lines[-1] == b"":  # a complete file ends with a newline
            lines = lines[:-1]
        events: list[dict[str, Any]] = []
        problems: list[str] = []
        for n, line in enumerate(lines, start=1):
            ev = decode_line(line)
            if ev is None:
                # A bad final line is what a crash mid-append leaves; anywhere else it is damage.
                what = "torn last line" if n == len(lines) else "corrupt line"
                problems.append(f"{self.path}: {what} {n} skipped")
                continue
            events.append(ev)
        if raw and not events:
            raise JournalError(f"{self.path} is not a smartckpt journal (no readable line)")
        if events:
            head = events[0]
            if head.get("event") != "init" or head.get("format") != JOURNAL_FORMAT:
                raise JournalError(f"{self.path} is not a smartckpt journal (no init line)")
            if int(head.get("v", 0)) > JOURNAL_VERSION:
                raise JournalError(
                    f"{self.path} has journal version {head.get('v')}, newer than this smartckpt "
                    f"understands ({JOURNAL_VERSION}); upgrade smartckpt"
                )
        for p in problems:
            logger.warning("journal: %s", p)
        store_id, records, failures = fold(events)
        return JournalState(store_id, records, problems, failures), events

    def _read_bytes(self, consistent: bool) -> bytes:
        if not consistent:
            return self.path.read_bytes()
        try:
            fd = os.open(self.path.parent / JOURNAL_LOCK, os.O_RDONLY)
        except OSError:
            return self.path.read_bytes()
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            return self.path.read_bytes()
        finally:
            os.close(fd)

    def _drop_torn_tail(self) -> None:
        """A writer that died mid-append leaves an unterminated last line. It never committed
        anything (its crc cannot match), so the one writing process cuts it off before
        appending; left in place it would read as damage in the middle of the journal."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        if not size:
            return
        with open(self.path, "rb+") as f:
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return
            cut = _last_newline_end(f, size)
            f.truncate(cut)
            f.flush()
            os.fsync(f.fileno())
        logger.warning(
            "journal: removed a torn last line (%d bytes) left by an interrupted write", size - cut
        )

    def append(self, event: dict[str, Any]) -> None:
        """Append one event durably. For a ``commit`` this line *is* the commit point.

        Appends hold ``journal.lock`` exclusively: the training run, ``smartckpt prune`` /
        ``rollback`` and the supervisor may append to the same journal, and cutting a torn tail
        must never cut another process's line that is being written at that moment."""
        line = encode_line(event)
        with file_lock(self.path.parent / JOURNAL_LOCK):
            self._drop_torn_tail()
            if fault_active("journal.half_line"):
                self.storage.append(JOURNAL, line[: len(line) // 2])
                crash()
            self.storage.append(JOURNAL, line)
        fault_point("journal.fsynced")


def _last_newline_end(f: Any, size: int) -> int:
    """Offset just after the last newline in the open file (0 when there is none)."""
    pos = size
    while pos > 0:
        start = max(0, pos - 65536)
        f.seek(start)
        block = f.read(pos - start)
        i = block.rfind(b"\n")
        if i >= 0:
            return start + i + 1
        pos = start
    return 0


def manifest_rel(step: int, cid: str) -> str:
    return f"manifests/{step:012d}-{cid}.json"


def encode_manifest(manifest: dict[str, Any]) -> bytes:
    return json.dumps(manifest, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def decode_manifest(data: bytes, where: str) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"manifest {where} is not valid JSON") from err
    if not isinstance(obj, dict) or obj.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{where} is not a smartckpt manifest")
    if int(obj.get("version", 0)) > MANIFEST_VERSION:
        raise ValueError(
            f"manifest {where} has version {obj.get('version')}, newer than this smartckpt "
            f"understands ({MANIFEST_VERSION})"
        )
    return obj


def record_manifests(event: dict[str, Any], manifest: str) -> list[str]:
    """Every manifest a commit line names: its own and, for a multi-rank commit, each rank's part."""
    return [manifest] + [p[0] for p in event.get("parts", []) if p[0] != manifest]
