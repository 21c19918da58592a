"""The grammar of every name smartckpt reads back from a store, a remote or a run directory: the
one place that decides whether a name may be used. Pure, no I/O.

A journal line's crc is public (anyone can recompute it), a manifest's hash is named by the
journal line, a bucket prefix may be writable by other teams: none of them proves that a name was
written by smartckpt. So every name that comes from outside this process — a journal line, a
manifest, a remote journal object, a part marker, a listing of a directory or a bucket, a status
file — is checked here against the format's grammar *before* it is used to build a path:

=====================  ===================================================  =====================
what                   grammar                                              example
=====================  ===================================================  =====================
blob id                32 lowercase hex (xxh3-128)                          ``9f0c…e1`` (32)
checkpoint id          12 lowercase hex                                     ``0123456789ab``
manifest               ``manifests/<12 digits>-<id>.json``                  of its own step and id
part manifest          ``manifests/<12 digits>-<id>-r<rank>.json``          of its own step and id
part marker            ``<12 digits>-<id>-r<rank>.json`` (under ``parts/``)
remote journal object  ``<12 digits>-<event>-<12 hex>.json`` (``journal/``)
store id               8 to 64 lowercase hex
RAM area (a tmpfs)     ``smartckpt-<run id>/rank<rank>/``                   ``…/rank0/``
RAM slot, record       ``slot0``, ``slot1``; ``ram.json`` (names the slot)
=====================  ===================================================  =====================

The RAM tier (``store/ramarea.py``) is not a store, but its record is read back by a restarted
process and by ``smartckpt run``'s flash persist: the slot it names, and every offset and length
in it, are checked here and against the slot's size before a byte is read.

Nothing that passes is absolute, holds ``..``, a separator where none belongs, a NUL or any
character outside ``[0-9a-z_./-]``. The storage backends refuse any path that resolves outside
their root as a second wall (``store/storage/local.py``, ``store/storage/objects.py``); :func:`check_rel`
is the generic rule they apply to every relative path they are given.

A failed check raises :class:`InvalidName`, one line naming the file, the field and the value.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MAX_RANKS",
    "MAX_STEP",
    "RAM_RECORD",
    "RAM_SLOTS",
    "TMP_MARK",
    "InvalidName",
    "JournalObject",
    "Part",
    "blob_rel",
    "check_blob_id",
    "check_checkpoint_id",
    "check_manifest_chunks",
    "check_ram_area",
    "check_ram_slot",
    "check_rel",
    "check_store_id",
    "commit_names",
    "is_blob_id",
    "is_manifest_file",
    "is_temporary",
    "journal_object",
    "lease_object",
    "manifest_rel",
    "marker",
    "parse_manifest_file",
    "parse_marker",
    "part_rel",
    "ram_area",
    "ram_rank_dir",
    "shown",
]

MAX_STEP = 10**12 - 1  # manifests carry the step in 12 digits
MAX_RANKS = 1 << 20
MAX_REL = 512  # no name the format makes is longer
TMP_MARK = ".tmp."  # temporary files of a write in flight: <final name>.tmp.<pid>.<n>

_BLOB = re.compile(r"[0-9a-f]{32}")
_CID = re.compile(r"[0-9a-f]{12}")
_STORE_ID = re.compile(r"[0-9a-f]{8,64}")
_MANIFEST = re.compile(r"manifests/([0-9]{12})-([0-9a-f]{12})\.json")
_PART = re.compile(r"manifests/([0-9]{12})-([0-9a-f]{12})-r(0|[1-9][0-9]{0,6})\.json")
_MARKER = re.compile(r"([0-9]{12})-([0-9a-f]{12})-r(0|[1-9][0-9]{0,6})\.json")
_LEASE = re.compile(r"(upload|prune)-([0-9a-f]{12})\.json")
_JOURNAL_OBJECT = re.compile(r"([0-9]{12})-([a-z][a-z_]{0,31})-([0-9a-f]{12})\.json")
_MANIFEST_FILE = re.compile(r"[0-9]{12}-[0-9a-f]{12}(-r(0|[1-9][0-9]{0,6}))?\.json")
_TEMPORARY = re.compile(r"[0-9a-z_.-]{1,200}\.tmp\.[0-9]{1,10}\.[0-9]{1,12}")
_REL_CHARS = re.compile(r"[0-9A-Za-z_.-]+")
_RAM_AREA = re.compile(r"smartckpt-[0-9A-Za-z_.-]{1,64}")
RAM_SLOTS = ("slot0", "slot1")
RAM_RECORD = "ram.json"


class InvalidName(ValueError):
    """A name read from a store, a remote or a run directory that the on-disk format does not
    allow; ``str(err)`` is the one line for the user (file, field, value)."""


def shown(value: Any) -> str:
    """``value`` as it may be printed: quoted, escaped (no control characters reach a terminal),
    cut to a readable length."""
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _fail(where: str, field: str, value: Any, what: str) -> InvalidName:
    return InvalidName(f"{where}: {field} {shown(value)} is not {what}")


def is_blob_id(value: Any) -> bool:
    return isinstance(value, str) and _BLOB.fullmatch(value) is not None


def check_blob_id(value: Any, where: str, field: str = "blob id") -> str:
    if not is_blob_id(value):
        raise _fail(where, field, value, "a blob id (32 lowercase hex digits)")
    return str(value)


def check_checkpoint_id(value: Any, where: str, field: str = "id") -> str:
    if not (isinstance(value, str) and _CID.fullmatch(value)):
        raise _fail(where, field, value, "a checkpoint id (12 lowercase hex digits)")
    return str(value)


def check_store_id(value: Any, where: str, field: str = "store_id") -> str:
    if not (isinstance(value, str) and _STORE_ID.fullmatch(value)):
        raise _fail(where, field, value, "a store id (8 to 64 lowercase hex digits)")
    return str(value)


def _check_step(value: Any, where: str, field: str = "step") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_STEP:
        raise _fail(where, field, value, f"a step (an integer from 0 to {MAX_STEP})")
    return value


def blob_rel(bid: str) -> str:
    """Where a blob lives, fanned out by its first two hex digits (restic's layout). Only a blob
    id has a place: anything else raises :class:`InvalidName`."""
    if not is_blob_id(bid):
        raise _fail("blob store", "blob id", bid, "a blob id (32 lowercase hex digits)")
    return f"blobs/{bid[:2]}/{bid}"


def manifest_rel(step: int, cid: str) -> str:
    return f"manifests/{step:012d}-{cid}.json"


def part_rel(step: int, cid: str, rank: int) -> str:
    return f"manifests/{step:012d}-{cid}-r{rank}.json"


def marker(step: int, cid: str, rank: int) -> str:
    return f"{step:012d}-{cid}-r{rank}.json"


def is_manifest_file(name: Any) -> bool:
    """Whether a file name found in ``manifests/`` is one the format makes (a checkpoint's
    manifest or a rank's part). Anything else there is not ours and is never removed."""
    return isinstance(name, str) and _MANIFEST_FILE.fullmatch(name) is not None


def parse_manifest_file(name: Any) -> tuple[int, str, int | None] | None:
    """(step, checkpoint id, rank or None) of a file name in ``manifests/`` the format makes;
    None for anything else."""
    if not isinstance(name, str):
        return None
    hit = _PART.fullmatch(f"manifests/{name}")
    if hit is not None:
        return int(hit.group(1)), hit.group(2), int(hit.group(3))
    hit = _MANIFEST.fullmatch(f"manifests/{name}")
    return (int(hit.group(1)), hit.group(2), None) if hit is not None else None


def is_temporary(name: Any, final: str | None = None) -> bool:
    """Whether a file name is a temporary file of a write in flight or of a dead writer
    (``<final name>.tmp.<pid>.<n>``); with ``final``, of that final name only."""
    if not (isinstance(name, str) and _TEMPORARY.fullmatch(name)):
        return False
    return final is None or name.split(TMP_MARK, 1)[0] == final


@dataclass(frozen=True)
class Part:
    """One rank's part of a multi-rank checkpoint as its commit line names it."""

    manifest: str
    manifest_hash: str
    dir_id: str | None  # the disk it was written to (compared, never used as a path)


def commit_names(event: dict[str, Any], where: str) -> tuple[int, str, str, str, tuple[Part, ...] | None]:
    """Check every name of a ``commit`` journal line (local or remote) and return (step, id,
    manifest, manifest hash, parts). The manifest must be the one the format gives this step and
    id — a line cannot name another checkpoint's manifest, let alone a file elsewhere. Raises
    :class:`InvalidName`."""
    step = _check_step(event.get("step"), where)
    cid = check_checkpoint_id(event.get("id"), where)
    mhash = check_blob_id(event.get("manifest_hash"), where, "manifest_hash")
    manifest = event.get("manifest")
    raw_parts = event.get("parts")
    if raw_parts is None:
        if manifest != manifest_rel(step, cid):
            raise _fail(
                where, "manifest", manifest, f"this checkpoint's manifest ({manifest_rel(step, cid)})"
            )
        world = event.get("world_size", 1)
        if world != 1:
            raise _fail(where, "world_size", world, "1 (the line names no parts)")
        return step, cid, manifest, mhash, None
    if not isinstance(raw_parts, list) or not 1 <= len(raw_parts) <= MAX_RANKS:
        raise _fail(where, "parts", raw_parts, f"a list of 1 to {MAX_RANKS} parts")
    world = event.get("world_size", len(raw_parts))
    if world != len(raw_parts):
        raise _fail(where, "world_size", world, f"the number of parts ({len(raw_parts)})")
    parts: list[Part] = []
    for rank, raw in enumerate(raw_parts):
        field = f"parts[{rank}]"
        if not isinstance(raw, list) or len(raw) not in (2, 3):
            raise _fail(where, field, raw, "[manifest, hash, dir id]")
        rel = raw[0]
        if rel != part_rel(step, cid, rank):
            raise _fail(where, f"{field} manifest", rel, f"rank {rank}'s part ({part_rel(step, cid, rank)})")
        phash = check_blob_id(raw[1], where, f"{field} hash")
        dir_id = raw[2] if len(raw) == 3 else None
        if dir_id is not None and not (
            isinstance(dir_id, str) and len(dir_id) <= 64 and _REL_CHARS.fullmatch(dir_id or "x")
        ):
            raise _fail(where, f"{field} dir id", dir_id, "a disk id (up to 64 letters, digits, . _ -)")
        parts.append(Part(rel, phash, dir_id))
    if manifest != parts[0].manifest or mhash != parts[0].manifest_hash:
        raise _fail(where, "manifest", manifest, f"rank 0's part ({parts[0].manifest} and its hash)")
    return step, cid, manifest, mhash, tuple(parts)


def check_manifest_chunks(manifest: dict[str, Any], where: str) -> None:
    """Every blob id a manifest's entries name (the only names in a manifest that become paths).
    Raises :class:`InvalidName` naming the entry and the chunk."""
    entries = manifest.get("entries")
    if not isinstance(entries, dict):
        raise InvalidName(f"{where}: entries {shown(entries)} is not a mapping")
    for key, entry in entries.items():
        if not isinstance(entry, dict):
            raise _fail(where, f"entry {shown(key)}", entry, "an entry (a mapping)")
        for stream_name in ("data", "patch"):
            stream = entry.get(stream_name)
            if stream is None:
                continue
            chunks = stream.get("chunks") if isinstance(stream, dict) else None
            if not isinstance(chunks, list):
                raise _fail(where, f"entry {shown(key)} {stream_name}", stream, "a stream with a chunk list")
            for n, chunk in enumerate(chunks):
                if not isinstance(chunk, list) or not chunk:
                    raise _fail(where, f"entry {shown(key)} {stream_name} chunk {n}", chunk, "a chunk")
                check_blob_id(chunk[0], where, f"entry {shown(key)} {stream_name} chunk {n} blob id")
        ref = entry.get("ref")
        if ref is not None and (
            isinstance(ref, bool) or not isinstance(ref, int) or not 0 <= ref < MAX_RANKS
        ):
            raise _fail(where, f"entry {shown(key)} ref", ref, "a rank")


@dataclass(frozen=True)
class JournalObject:
    """A remote journal object's name: ``<seq>-<event>-<tag>.json``."""

    seq: int
    event: str
    tag: str


def lease_object(name: Any) -> tuple[str, str] | None:
    """(kind, tag) of a lease object's name, ``locks/<upload|prune>-<12 hex>.json``
    (:mod:`.leases`); None for anything else under ``locks/`` (never read)."""
    if not isinstance(name, str):
        return None
    m = _LEASE.fullmatch(name)
    return None if m is None else (m.group(1), m.group(2))


def journal_object(name: Any) -> JournalObject | None:
    """The parts of a remote journal object's name; None for anything that is not one (an
    object of somebody else's under the prefix is skipped, never followed)."""
    if not isinstance(name, str):
        return None
    m = _JOURNAL_OBJECT.fullmatch(name)
    if m is None:
        return None
    return JournalObject(int(m.group(1)), m.group(2), m.group(3))


def parse_marker(name: Any) -> tuple[int, str, int] | None:
    """(step, checkpoint id, rank) of a part marker's or a part manifest's file name; None for
    any other name."""
    if not isinstance(name, str):
        return None
    m = _MARKER.fullmatch(name)
    if m is None:
        return None
    return int(m.group(1)), m.group(2), int(m.group(3))


def ram_area(run_id: str) -> str:
    """The RAM tier's folder of one ``smartckpt run`` in the RAM directory (``/dev/shm``)."""
    return check_ram_area(f"smartckpt-{run_id}")


def check_ram_area(name: Any) -> str:
    if not (isinstance(name, str) and _RAM_AREA.fullmatch(name)):
        raise InvalidName(f"RAM area {shown(name)} is not smartckpt-<run id>")
    return name


def ram_rank_dir(rank: int) -> str:
    """One rank's folder inside a RAM area: every rank keeps its own snapshot."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < MAX_RANKS:
        raise InvalidName(f"RAM area: rank {shown(rank)} is not a rank")
    return f"rank{rank}"


def check_ram_slot(value: Any, where: str) -> str:
    """The slot a RAM record names: one of :data:`RAM_SLOTS`, nothing else."""
    if value not in RAM_SLOTS:
        raise _fail(where, "slot", value, f"one of {', '.join(RAM_SLOTS)}")
    return str(value)


def check_rel(rel: Any, what: str = "path") -> str:
    """The rule every backend applies to a relative path before it touches anything: relative,
    made of non-empty components of ``[0-9A-Za-z_.-]`` other than ``.`` and ``..``, no longer
    than the format ever needs. Raises :class:`InvalidName`."""
    if not isinstance(rel, str) or not rel or len(rel) > MAX_REL:
        raise InvalidName(f"{what} {shown(rel)} is not a name inside the store")
    for part in rel.split("/"):
        if part in ("", ".", "..") or _REL_CHARS.fullmatch(part) is None:
            raise InvalidName(f"{what} {shown(rel)} is not a name inside the store")
    return rel
