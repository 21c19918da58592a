"""Manifests that no journal line names: the leftover of an interrupted commit, or the only trace of
checkpoints a damaged journal lost. Which one is decided here, purely (:func:`judge`); :func:`survey`
reads what the decision needs.

A commit writes its manifest, then its journal line (store/journal.py): a crash between the two
leaves one manifest no line names, and garbage collection removes it. But a journal that was
emptied (truncated to 0 bytes, a backup restored without it), overwritten, or damaged in the middle
leaves manifests no line names too, and those are the checkpoints: evidence, not garbage.

==========================================  ==========================  ===============================
the journal                                 manifests no line names     a writer (a run, the API)
==========================================  ==========================  ===============================
cannot be read (not a smartckpt journal)    evidence                    refuses to start
missing or empty, manifests present         evidence                    refuses to start a journal
with damaged lines (not a torn last line)   evidence                    goes on (said once)
sound                                       of this store: leftovers    goes on; gc removes them
                                            of another store: evidence  goes on (said once)
==========================================  ==========================  ===============================

Evidence is never removed (garbage collection keeps it, ``store/retention.py``); ``smartckpt verify
--repair`` rebuilds the journal from the evidence that verifies (``ops/repair.py``). Each cause is
one line (:meth:`Finding.line`), said once per process (:func:`say_once`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from smartckpt_cli.errors import JournalError, JournalTooNewError
from smartckpt_cli.store.journal import Journal, JournalState
from smartckpt_cli.store.names import parse_manifest_file
from smartckpt_cli.store.storage.base import Storage

__all__ = ["Finding", "JournalLook", "Survey", "judge", "look_at", "repair_command", "say_once", "survey"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class JournalLook:
    """What the journal says, as far as manifests without a line are concerned."""

    path: str
    present: bool  # the file exists
    error: str | None  # why it cannot be read, the reader's own line (None: it reads)
    store_id: str | None  # from its init line (None: missing, empty, unreadable)
    damaged: tuple[str, ...]  # lines that do not read, or name what the format does not make
    named: frozenset[str]  # every manifest a commit line names, pruned checkpoints included
    too_new: bool = False  # written by a newer smartckpt: nothing here may rebuild it


@dataclass(frozen=True)
class Finding:
    """One cause, and the manifests it keeps."""

    cause: str  # what the journal (or the manifests) show, in words
    blocking: bool  # a writer must not go on: it would start a journal over the evidence
    manifests: tuple[str, ...]  # relative names, kept: never collected as garbage
    steps: tuple[int, ...]  # of those checkpoints, distinct and sorted
    foreign: bool = False  # manifests of another store (their store id is not the journal's)
    checkpoints: int = 0  # how many checkpoints those manifests are (a rank's part is one manifest)
    too_new: bool = False  # a journal of a newer smartckpt: upgrade, nothing to repair

    def line(self, store: str, repair: str) -> str:
        """The one line a user sees; ``repair``: the command that rebuilds the journal."""
        n = self.checkpoints
        what = f"{n} checkpoint{'s' if n != 1 else ''} ({_steps(self.steps)})"
        if self.foreign:
            return (
                f"checkpoint store {store}: manifests/ holds {what} of {self.cause} that no journal "
                "line names: kept, never loaded; move them to a directory of their own, or remove "
                "them by hand"
            )
        if not self.manifests:
            return f"checkpoint store {store}: {self.cause}; nothing is written over it" + (
                "" if self.too_new else ": move it away to start a new store here"
            )
        head = f"checkpoint store {store}: {self.cause}; manifests/ holds {what} no journal line names"
        if self.blocking:
            return (
                f"{head}: kept, and nothing is written over them; `{repair}` rebuilds the journal "
                "from those that verify"
            )
        return f"{head}: kept (never collected as garbage); `{repair}` puts {'it' if n == 1 else 'them'} back in the journal"


@dataclass(frozen=True)
class Survey:
    look: JournalLook
    state: JournalState | None  # the journal as read (None when it cannot be)
    orphans: tuple[str, ...]  # manifests no line names
    findings: tuple[Finding, ...]

    @property
    def blocking(self) -> Finding | None:
        return next((f for f in self.findings if f.blocking), None)

    @property
    def kept(self) -> frozenset[str]:
        return frozenset(m for f in self.findings for m in f.manifests)


def judge(look: JournalLook, on_disk: Iterable[str], store_ids: Mapping[str, str | None]) -> list[Finding]:
    """Pure: the findings for the manifests ``on_disk`` (relative names, ``manifests/…``), given
    what the journal says and the store id each manifest no line names carries (None: unreadable).
    Empty when every such manifest is the leftover of an interrupted commit (module docstring)."""
    orphans = sorted(m for m in on_disk if m not in look.named)
    if look.too_new:
        return [replace(_finding(str(look.error), True, []), too_new=True)]
    if look.error is not None:
        return [_finding(look.error, True, orphans)]
    if look.store_id is None:
        if not orphans:
            return []
        empty = (
            "is empty"
            if look.present
            else "is missing (if it is in another directory, give that as meta_dir)"
        )
        return [_finding(f"the journal {look.path} {empty}", True, orphans)]
    if look.damaged:
        if not orphans:
            return []
        verb = "is" if len(look.damaged) == 1 else "are"
        return [_finding(f"{_lines(look.damaged)} of the journal {verb} damaged", False, orphans)]
    foreign: dict[str, list[str]] = {}
    for rel in orphans:
        sid = store_ids.get(rel)
        if sid is not None and sid != look.store_id:
            foreign.setdefault(sid, []).append(rel)
    return [
        _finding(f"another store (id {sid[:12]}…)", False, rels, foreign=True)
        for sid, rels in sorted(foreign.items())
    ]


def _finding(cause: str, blocking: bool, rels: list[str], *, foreign: bool = False) -> Finding:
    parsed = [p for p in (parse_manifest_file(r.removeprefix("manifests/")) for r in rels) if p]
    steps = tuple(sorted({p[0] for p in parsed}))
    return Finding(cause, blocking, tuple(rels), steps, foreign, len({p[:2] for p in parsed}))


def _steps(steps: tuple[int, ...]) -> str:
    if not steps:
        return "no step"
    if len(steps) == 1:
        return f"step {steps[0]}"
    if len(steps) <= 4:
        return "steps " + ", ".join(map(str, steps))
    return f"steps {steps[0]}..{steps[-1]}"


def _lines(origins: tuple[str, ...]) -> str:
    """'line 4' / 'lines 4, 7' from origins like '<path> line 4'."""
    nums = [o.rsplit(" line ", 1)[-1] for o in origins]
    shown = ", ".join(nums[:5]) + (f" and {len(nums) - 5} more" if len(nums) > 5 else "")
    return f"line{'s' if len(nums) > 1 else ''} {shown}"


def look_at(journal: Journal) -> tuple[JournalLook, JournalState | None]:
    """Read the journal for :func:`judge` (and hand back its state when it reads)."""
    path = str(journal.path)
    present = journal.exists()
    try:
        state = journal.read()
    except JournalError as err:
        too_new = isinstance(err, JournalTooNewError)
        return JournalLook(path, present, str(err), None, (), frozenset(), too_new), None
    invalid = tuple(f"{path} line {r.position + 1}" for r in state.records if r.invalid is not None)
    named = frozenset(m for r in state.records for m in r.manifests())
    return JournalLook(path, present, None, state.store_id, state.damaged + invalid, named), state


def survey(storage: Storage, journal: Journal) -> Survey:
    """Everything :func:`judge` needs, read from the store (``storage``: its ``dir``)."""
    look, state = look_at(journal)
    on_disk = [f"manifests/{n}" for n in storage.list("manifests") if parse_manifest_file(n) is not None]
    orphans = [m for m in on_disk if m not in look.named]
    ids: dict[str, str | None] = {}
    if look.store_id is not None and not look.damaged:  # only then can an orphan be a leftover
        ids = {rel: _store_id(storage, rel) for rel in orphans}
    return Survey(look, state, tuple(orphans), tuple(judge(look, on_disk, ids)))


def _store_id(storage: Storage, rel: str) -> str | None:
    try:
        obj = json.loads(storage.read(rel))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    sid = obj.get("store_id") if isinstance(obj, dict) else None
    return sid if isinstance(sid, str) else None


def repair_command(root: object, meta_root: object) -> str:
    """The command that rebuilds the journal of the store in ``root`` (journal in ``meta_root``)."""
    meta = f" --meta-dir {meta_root}" if str(meta_root) != str(root) else ""
    return f"smartckpt verify --repair {root}{meta}"


_said: set[str] = set()


def say_once(line: str) -> None:
    """Log a finding's line once per process (a writer reads the journal after every commit)."""
    if line not in _said:
        _said.add(line)
        logger.warning("%s", line)
