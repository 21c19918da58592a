"""Where a journal's lines live, on any backend: the two layouts of one journal.

- **lines** — ``journal.jsonl``, appended and fsynced under ``journal.lock``: a store's
  ``meta_dir`` (a file system appends; one writing process, plus the CLI and the supervisor).
- **objects** — ``journal/<seq>-<event>-<tag>.json``, one immutable object per event: an object
  store has no append, and a replica is written by several nodes, which must never overwrite one
  another (the tag: a checkpoint id or a random one) and list in order (the zero-padded seq).

Both hold the same lines (:mod:`.lines`, crc included) and are replayed by the same
:func:`~smartckpt_cli.store.journal.replay`, so a commit, a prune and a rollback mean the same on
either; a damaged object is skipped like a damaged line. Which layout a repository has is read
from what it holds (``journal.jsonl`` or journal objects), never guessed from its URL, so a
store of an earlier version reads as it was written. An object under ``journal/`` whose *name* is
not one (:func:`~smartckpt_cli.store.names.journal_object`) is somebody else's: never read.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Iterator
from typing import Any

from smartckpt_cli._faults import crash, fault_active
from smartckpt_cli.store.lines import decode_line
from smartckpt_cli.store.names import journal_object
from smartckpt_cli.store.storage import Storage

__all__ = ["JOURNAL", "JOURNAL_DIR", "JOURNAL_LOCK", "FileLog", "ObjectLog", "object_name"]

logger = logging.getLogger(__name__)

JOURNAL = "journal.jsonl"
JOURNAL_LOCK = "journal.lock"  # serialises appends across processes (a run, the CLI, the supervisor)
JOURNAL_DIR = "journal"

Decoded = list[tuple[str, dict[str, Any] | None]]


def object_name(seq: int, event: str, tag: str) -> str:
    return f"{seq:012d}-{event}-{tag}.json"


class FileLog:
    """``journal.jsonl``: lines appended to one file."""

    layout = "lines"
    torn_tail = True  # a last line without its newline is what a crash mid-append leaves

    def __init__(self, storage: Storage, where: str) -> None:
        self.storage, self.where = storage, where

    def exists(self) -> bool:
        return self.storage.exists(JOURNAL)

    def read(self, *, consistent: bool = False) -> Decoded:
        """Every line with its origin; raises FileNotFoundError when there is no journal. With
        ``consistent``, read under a shared ``journal.lock`` (when that lock file exists; nothing
        is created), so a line another process is appending now is never seen half written."""
        with self.storage.lock(JOURNAL_LOCK, shared=True, create=False) if consistent else _nothing():
            raw = self.storage.read(JOURNAL)
        lines = raw.split(b"\n")
        whole = lines[-1] == b""  # a complete file ends with a newline
        lines = lines[:-1] if whole else lines
        decoded: Decoded = [
            (f"{self.where} line {n}", decode_line(line)) for n, line in enumerate(lines, start=1)
        ]
        if not whole:
            # A line is appended with its newline in one write; a last line without it was cut
            # short (a crash, a short write on a full disk), even when its crc matches: it is a
            # torn line, not a commit, for every reader, and the next append cuts it off.
            decoded[-1] = (decoded[-1][0], None)
        return decoded

    def start(self, line: bytes) -> None:
        """The first line (``init``), appended without taking ``journal.lock``: whoever creates
        the journal holds it already, to decide that nobody else does."""
        self.storage.append(JOURNAL, line)

    def append(self, line: bytes, event: str, seq: int | None, tag: str | None) -> str:
        """Append one line durably. Appends hold ``journal.lock`` exclusively: the training run,
        ``smartckpt prune``/``rollback`` and the supervisor may append to the same journal, and
        cutting a torn tail must never cut another process's line being written at that moment."""
        with self.storage.lock(JOURNAL_LOCK):
            self._drop_torn_tail()
            if fault_active("journal.half_line"):
                self.storage.append(JOURNAL, line[: len(line) // 2])
                crash()
            self.storage.append(JOURNAL, line)
        return JOURNAL

    def _drop_torn_tail(self) -> None:
        """A writer that died mid-append (or a short write) leaves an unterminated last line. A
        line without its newline is never a commit for any reader, so the writing process cuts it
        off before appending: the next line starts on a line of its own, and nothing committed is
        ever cut. Left in place it would read as damage in the middle."""
        try:
            view = self.storage.read_view(JOURNAL)  # mapped: only the tail's pages are read
        except FileNotFoundError:
            return
        try:
            size = len(view)
            if not size or view[size - 1 : size] == b"\n":
                return
            cut = view.rfind(b"\n") + 1
        finally:
            if hasattr(view, "close"):
                view.close()
        self.storage.truncate(JOURNAL, cut)
        logger.warning(
            "journal: removed a torn last line (%d bytes) left by an interrupted write", size - cut
        )


class ObjectLog:
    """``journal/``: one immutable object per event, listed in sequence order."""

    layout = "objects"
    torn_tail = False  # an object is whole or absent: an unreadable one is damage

    def __init__(self, storage: Storage, where: str) -> None:
        self.storage, self.where = storage, where
        # Objects never change once written: each is fetched once, then only listed.
        self._cache: dict[str, dict[str, Any] | None] = {}
        self.next_seq = 0  # after the last read: one past the highest sequence number listed

    def _names(self) -> list[tuple[int, str]]:
        objs = ((journal_object(n), n) for n in self.storage.list(JOURNAL_DIR))
        return sorted((o.seq, n) for o, n in objs if o is not None)

    def exists(self) -> bool:
        return bool(self._names())

    def read(self, *, consistent: bool = False) -> Decoded:
        """Every object in sequence order; raises FileNotFoundError when there is none."""
        ordered = self._names()
        if not ordered:
            raise FileNotFoundError(f"{self.where}: no journal objects")
        decoded: Decoded = []
        for _, name in ordered:
            if name not in self._cache:
                try:
                    raw = self.storage.read(f"{JOURNAL_DIR}/{name}")
                except FileNotFoundError:
                    continue  # removed while listing
                self._cache[name] = decode_line(raw.strip())
            ev = self._cache[name]
            decoded.append((f"{self.where} object {name}", dict(ev) if ev is not None else None))
        self.next_seq = ordered[-1][0] + 1
        return decoded

    def start(self, line: bytes) -> None:
        """The first object (``init``), sequence number 0."""
        self.append(line, "init", 0, None)

    def append(self, line: bytes, event: str, seq: int | None, tag: str | None) -> str:
        """Write one event object; returns its name. For a ``commit`` this is the commit point.
        Without ``seq`` the next one after what is listed now (a single writer's case)."""
        if seq is None:
            names = self._names()
            seq = names[-1][0] + 1 if names else 0
        name = object_name(seq, event, tag or uuid.uuid4().hex[:12])
        self.storage.write(f"{JOURNAL_DIR}/{name}", line)
        return name


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield None
