"""The remote journal: one immutable object per event, ``journal/<seq>-<event>-<tag>.json``.

Object stores have no append, so each event is its own object, named so that listing returns
them in order (a zero-padded sequence number) and so that no two writers can ever overwrite
one another (the tag: a checkpoint id or a random one). The body is the local journal's line
format, crc included: a damaged object is skipped like a damaged line.

The commit rule is the local one: a checkpoint exists remotely only once its ``commit`` object
exists, and the replicator writes that object last, after every blob and the manifest. Replaying
the objects uses the local :func:`~smartckpt_cli.store.journal.replay`, so both sides agree on
what a commit, a prune and a rollback mean, and check every name a line carries the same way.
An object under ``journal/`` whose *name* is not one (:func:`~smartckpt_cli.store.names.journal_object`)
is somebody else's: it is never read.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any

from smartckpt_cli.remote.backend import Limiter, Remote, display_url
from smartckpt_cli.store.journal import (
    JOURNAL_FORMAT,
    JOURNAL_VERSION,
    CheckpointRecord,
    decode_line,
    encode_line,
    replay,
)
from smartckpt_cli.store.names import journal_object

__all__ = ["JOURNAL_DIR", "RemoteJournal", "RemoteState", "object_name", "parse_name"]

logger = logging.getLogger(__name__)

JOURNAL_DIR = "journal"
_NO_LIMIT = Limiter(0)


def object_name(seq: int, event: str, tag: str) -> str:
    return f"{seq:012d}-{event}-{tag}.json"


def parse_name(name: str) -> tuple[int, str] | None:
    """(seq, event) of a journal object name, None for anything else (store/names.py)."""
    obj = journal_object(name)
    return None if obj is None else (obj.seq, obj.event)


@dataclass
class RemoteState:
    store_id: str | None
    records: list[CheckpointRecord]
    problems: list[str]
    next_seq: int

    def live(self) -> list[CheckpointRecord]:
        return [r for r in self.records if r.live]

    def live_ids(self) -> set[str]:
        return {r.id for r in self.records if r.live}


class RemoteJournal:
    def __init__(self, remote: Remote) -> None:
        self.remote = remote
        # Objects never change once written: each is fetched once, then only listed.
        self._cache: dict[str, dict[str, Any] | None] = {}

    def read(self) -> RemoteState:
        """Replay every journal object in sequence order."""
        names = [(parse_name(n), n) for n in self.remote.list(JOURNAL_DIR)]
        ordered = sorted((p[0], n) for p, n in names if p is not None)
        decoded: list[tuple[str, dict[str, Any] | None]] = []
        for _, name in ordered:
            if name in self._cache:
                ev = self._cache[name]
            else:
                try:
                    raw = self.remote.get(f"{JOURNAL_DIR}/{name}")
                except FileNotFoundError:
                    continue  # removed while listing
                ev = self._cache[name] = decode_line(raw.strip())
            decoded.append((f"remote journal object {name}", dict(ev) if ev is not None else None))
        state, _ = replay(decoded, f"remote {display_url(self.remote.url)}: journal")
        next_seq = (ordered[-1][0] + 1) if ordered else 0
        return RemoteState(state.store_id, state.records, state.problems, next_seq)

    def write(self, seq: int, event: dict[str, Any], tag: str | None = None) -> str:
        """Write one event object; returns its name. For a ``commit`` this is the commit point."""
        name = object_name(seq, str(event["event"]), tag or uuid.uuid4().hex[:12])
        self.remote.put(f"{JOURNAL_DIR}/{name}", encode_line(event), part_bytes=1 << 30, limiter=_NO_LIMIT)
        return name

    def init(self, store_id: str) -> None:
        self.write(0, {"event": "init", "format": JOURNAL_FORMAT, "v": JOURNAL_VERSION, "store_id": store_id})
