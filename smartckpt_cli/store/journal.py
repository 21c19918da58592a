"""Manifests and the append-only journal: the commit point.

A checkpoint exists once, and only once, its ``commit`` line is durable in the journal
(``journal.jsonl``, fsynced; or its own object on an object store: :mod:`.log`).
Everything before that (blobs, the manifest) is invisible garbage if the process dies; everything
after it (pruning old checkpoints) only ever removes what a newer commit has replaced.

Each journal line is one JSON object with a ``crc`` field: the xxh3-64 of the line's canonical
JSON without that field. A line that does not parse or whose crc does not match is reported and
skipped: at the end of the file that is a torn write from a crash; elsewhere it is damage.
The first line declares the format and version; an unknown version is refused.

The crc proves a line whole, not that smartckpt wrote it (anyone can compute it). So replaying
(:func:`replay`, shared with the remote journal) checks every name a line carries against the
format's grammar (:mod:`.names`): a ``commit`` line naming a manifest that is not its own — an
absolute path, ``../``, another checkpoint's — becomes a damaged checkpoint (``invalid``: never
loaded, never pruned, its names never followed) and a journal problem, in one line that names the
file, the field and the value.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from smartckpt_cli._faults import fault_point
from smartckpt_cli.errors import JournalError, JournalTooNewError
from smartckpt_cli.store.lines import decode_line as decode_line
from smartckpt_cli.store.lines import encode_line as encode_line
from smartckpt_cli.store.log import JOURNAL as JOURNAL
from smartckpt_cli.store.log import JOURNAL_LOCK as JOURNAL_LOCK
from smartckpt_cli.store.log import FileLog, ObjectLog
from smartckpt_cli.store.manifest import check_manifest
from smartckpt_cli.store.names import (
    InvalidName,
    Part,
    check_store_id,
    commit_names,
    shown,
)
from smartckpt_cli.store.names import manifest_rel as manifest_rel
from smartckpt_cli.store.storage import Storage

__all__ = [
    "JOURNAL",
    "JOURNAL_LOCK",
    "MANIFEST_FORMAT",
    "MANIFEST_VERSION",
    "CheckpointRecord",
    "Journal",
    "JournalState",
    "fold",
    "manifest_rel",
    "record_manifests",
    "replay",
]

logger = logging.getLogger(__name__)

JOURNAL_FORMAT = "smartckpt-journal"
JOURNAL_VERSION = 1
MANIFEST_FORMAT = "smartckpt-manifest"
MANIFEST_VERSION = 1


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
    # Several ranks: each rank's part as the commit line names it (checked); None for one process.
    parts: tuple[Part, ...] | None = None
    # Why the commit line's names are not the format's (then ``manifest`` and ``parts`` are
    # empty: nothing it names is ever opened, removed or fetched); None for a sound line.
    invalid: str | None = None

    @property
    def live(self) -> bool:
        return not self.pruned and not self.rolled_back

    @property
    def world_size(self) -> int:
        return len(self.parts) if self.parts else 1

    def manifests(self) -> list[str]:
        """Every manifest this checkpoint consists of: its own, or each rank's part. Empty for
        an invalid line: its names are never followed."""
        if self.invalid is not None:
            return []
        if self.parts:
            return [p.manifest for p in self.parts]
        return [self.manifest]


@dataclass
class JournalState:
    store_id: str | None
    records: list[CheckpointRecord]
    problems: list[str]  # torn or damaged lines, for verify and for warnings
    failures: list[dict[str, Any]]  # save_failed events
    # Lines that do not read (not a torn last line): a commit among them would leave its
    # checkpoint's manifest without a line (store/unjournalled.py).
    damaged: tuple[str, ...] = ()
    # The objects layout (:mod:`.log`): one past the highest sequence number read.
    next_seq: int = 0

    def live(self) -> list[CheckpointRecord]:
        return [r for r in self.records if r.live]

    def live_ids(self) -> set[str]:
        return {r.id for r in self.records if r.live}


def _commit_record(ev: dict[str, Any], pos: int, where: str) -> CheckpointRecord:
    """A commit line as a record; a line whose names fail the grammar becomes an *invalid* record
    that keeps its step and id when they are sound (for inspect) and names nothing."""
    try:
        step, cid, manifest, mhash, parts = commit_names(ev, where)
    except InvalidName as err:
        raw_step, raw_id = ev.get("step"), ev.get("id")
        return CheckpointRecord(
            step=raw_step
            if isinstance(raw_step, int) and not isinstance(raw_step, bool) and raw_step >= 0
            else -1,
            id=raw_id
            if isinstance(raw_id, str) and 0 < len(raw_id) <= 64 and raw_id.isalnum()
            else f"?{pos}",
            manifest="",
            manifest_hash="",
            position=pos,
            event=ev,
            invalid=str(err),
        )
    score = ev.get("score")
    return CheckpointRecord(
        step=step,
        id=cid,
        manifest=manifest,
        manifest_hash=mhash,
        position=pos,
        health=str(ev.get("health", "ok")),
        reason=str(ev.get("reason", "")),
        score=float(score) if isinstance(score, int | float) and not isinstance(score, bool) else None,
        bytes_new=_int(ev.get("bytes_new")),
        calm=bool(ev.get("calm", True)),
        event=ev,
        parts=parts,
    )


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def fold(
    events: list[dict[str, Any]], where: list[str] | None = None, problems: list[str] | None = None
) -> tuple[str | None, list[CheckpointRecord], list[dict[str, Any]]]:
    """Pure: replay journal events into checkpoint records.

    ``rollback {to_step}`` marks every checkpoint committed before it with a larger step as rolled
    back; ``rollback {undo: true}`` reverses the newest rollback still in force. ``prune {ids}``
    marks checkpoints whose files were (or are being) removed. ``where`` names each event's
    origin (a journal line, a remote object) for the messages; a line whose fields do not fit the
    format is reported in ``problems`` and, for a commit, becomes an invalid record.
    """
    store_id: str | None = None
    records: list[CheckpointRecord] = []
    by_id: dict[str, CheckpointRecord] = {}
    rollbacks: list[list[CheckpointRecord]] = []
    failures: list[dict[str, Any]] = []
    found = problems if problems is not None else []
    for pos, ev in enumerate(events):
        origin = where[pos] if where is not None else f"journal event {pos}"
        kind = ev.get("event")
        if kind == "init":
            if store_id is None:
                try:
                    store_id = check_store_id(ev.get("store_id"), origin)
                except InvalidName as err:
                    found.append(str(err))
        elif kind == "commit":
            rec = _commit_record(ev, pos, origin)
            if rec.invalid is not None:
                found.append(rec.invalid)
            records.append(rec)
            if rec.invalid is None:
                by_id[rec.id] = rec
        elif kind == "rollback":
            if ev.get("undo") is True:
                if rollbacks:
                    for rec in rollbacks.pop():
                        rec.rolled_back = False
                continue
            to_step = ev.get("to_step")
            if isinstance(to_step, bool) or not isinstance(to_step, int):
                found.append(f"{origin}: rollback field to_step {shown(to_step)} is not a step; line ignored")
                continue
            hit = [r for r in records if r.step > to_step and not r.rolled_back]
            for rec in hit:
                rec.rolled_back = True
            rollbacks.append(hit)
        elif kind == "prune":
            ids = ev.get("ids", [])
            if not isinstance(ids, list):
                found.append(f"{origin}: prune field ids {shown(ids)} is not a list; line ignored")
                continue
            for cid in ids:
                if isinstance(cid, str) and cid in by_id:
                    by_id[cid].pruned = True
        elif kind == "save_failed":
            failures.append(ev)
    return store_id, records, failures


def replay(
    decoded: list[tuple[str, dict[str, Any] | None]], source: str, torn_tail: bool = False
) -> tuple[JournalState, list[dict[str, Any]]]:
    """The journal state from decoded lines: one home for the local journal and the remote one.
    ``decoded`` holds, in order, each line's origin (``journal.jsonl line 3``, a remote object's
    name) and its event (None: unreadable, or its crc does not match). With ``torn_tail`` an
    unreadable *last* line is what a crash mid-append leaves (a torn line); anywhere else it is
    damage. Refuses (JournalError) what is not a smartckpt journal or is of a newer version."""
    events: list[dict[str, Any]] = []
    where: list[str] = []
    problems: list[str] = []
    damaged: list[str] = []
    for n, (origin, ev) in enumerate(decoded, start=1):
        if ev is None:
            torn = torn_tail and n == len(decoded)
            problems.append(f"{origin}: {'torn last line' if torn else 'damaged line'}, skipped")
            if not torn:
                damaged.append(origin)
            continue
        events.append(ev)
        where.append(origin)
    if decoded and not events:
        raise JournalError(f"{source} is not a smartckpt journal (no readable line)")
    if events:
        head = events[0]
        if head.get("event") != "init" or head.get("format") != JOURNAL_FORMAT:
            raise JournalError(f"{source} is not a smartckpt journal (no init line)")
        version = head.get("v", 0)
        if isinstance(version, bool) or not isinstance(version, int) or version > JOURNAL_VERSION:
            raise JournalTooNewError(
                f"{source} has journal version {shown(version)}, newer than this smartckpt "
                f"understands ({JOURNAL_VERSION}); upgrade smartckpt"
            )
    store_id, records, failures = fold(events, where, problems)
    _warn_once(problems)
    return JournalState(store_id, records, problems, failures, tuple(damaged)), events


_warned: set[str] = set()


def _warn_once(problems: list[str]) -> None:
    # A process reads the journal after every commit: each problem is logged once, not each time.
    for p in problems:
        if p not in _warned:
            _warned.add(p)
            logger.warning("journal: %s", p)


class Journal:
    """A repository's journal, on any backend, in either layout (:mod:`.log`): ``journal.jsonl``
    where the backend appends, one object per event where it does not (an object store) or where
    several nodes write (a replica). The layout is read from what the repository holds, at first
    use (a remote that is down raises then, not here); a new journal takes ``layout`` (default:
    lines where the backend appends)."""

    def __init__(self, storage: Storage, meta_root: Path | None = None, *, layout: str | None = None) -> None:
        self.storage = storage
        root = str(meta_root) if meta_root is not None else storage.url
        self.path = Path(root) / JOURNAL  # for messages (and local tests): the lines layout's file
        self._lines = FileLog(storage, str(self.path))
        self._objects = ObjectLog(storage, f"{storage.url}: journal")  # the url holds no credentials
        self._default = layout or ("lines" if storage.appends else "objects")
        self._chosen: FileLog | ObjectLog | None = None

    @property
    def _log(self) -> FileLog | ObjectLog:
        if self._chosen is None:
            if self._lines.exists():
                self._chosen = self._lines
            elif self._objects.exists():
                self._chosen = self._objects
            else:  # nothing yet: decided again at the next use, until something is written
                return self._lines if self._default == "lines" else self._objects
        return self._chosen

    @property
    def where(self) -> str:
        return self._log.where

    @property
    def layout(self) -> str:
        return self._log.layout

    def exists(self) -> bool:
        return self._log.exists()

    def create(self, store_id: str | None = None) -> str:
        store_id = store_id or uuid.uuid4().hex
        init = {"event": "init", "format": JOURNAL_FORMAT, "v": JOURNAL_VERSION, "store_id": store_id}
        self._log.start(encode_line(init))  # the caller holds journal.lock (StoreDir.ensure_journal)
        return store_id

    def read(self) -> JournalState:
        return self.read_events()[0]

    def read_events(self, *, consistent: bool = False) -> tuple[JournalState, list[dict[str, Any]]]:
        """The folded state and every readable event, in journal order. With ``consistent``, a
        line another process is appending at this moment is never seen half written (lines
        layout: read under the shared ``journal.lock``)."""
        try:
            decoded = self._log.read(consistent=consistent)
        except FileNotFoundError:
            return JournalState(None, [], [], []), []
        except OSError as err:
            raise JournalError(f"cannot read journal {self.where}: {err.strerror or err}") from err
        state, events = replay(decoded, self.where, torn_tail=self._log.torn_tail)
        if isinstance(self._log, ObjectLog):
            state.next_seq = self._log.next_seq
        return state, events

    def append(self, event: dict[str, Any], *, seq: int | None = None, tag: str | None = None) -> str:
        """Append one event durably; returns where it went (the file, or the object's name). For
        a ``commit`` this line *is* the commit point. ``seq`` and ``tag`` name an object of the
        objects layout (a writer among several picks its own; the lines layout ignores them)."""
        name = self._log.append(encode_line(event), str(event["event"]), seq, tag)
        fault_point("journal.fsynced")
        return name


def encode_manifest(manifest: dict[str, Any]) -> bytes:
    return json.dumps(manifest, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def decode_manifest(data: bytes, where: str) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"manifest {where} is not valid JSON") from err
    if not isinstance(obj, dict) or obj.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{where} is not a smartckpt manifest")
    version = obj.get("version", 0)
    if not isinstance(version, int) or version > MANIFEST_VERSION:
        raise ValueError(
            f"manifest {where} has version {version!r:.20}, newer than this smartckpt "
            f"understands ({MANIFEST_VERSION})"
        )
    check_manifest(obj, f"manifest {where}")  # names and shape; InvalidName is a ValueError
    return obj


def record_manifests(record: CheckpointRecord) -> list[str]:
    """Every manifest a committed checkpoint consists of (checked names; none for an invalid
    line): :meth:`CheckpointRecord.manifests`."""
    return record.manifests()
