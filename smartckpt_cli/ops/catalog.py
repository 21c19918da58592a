"""What a store holds, for ``smartckpt inspect``: one row per checkpoint (one manifest in
detail: ``ops/detail.py``).

Everything comes from the journal (what exists, in which order, pruned or rolled back, last
verification) and the manifests (tiers, precision, chunk sizes); no blob is read. Bytes are the
encoded bytes on disk: a checkpoint's *unique* bytes are those no other checkpoint still on disk
references (what pruning it alone frees), the rest are *shared*.

A checkpoint written by several ranks: its world size comes from the journal's commit line, its
sharding from rank 0's part (the ``{"__dt": [key, global shape, placements]}`` nodes of the
object skeletons, read here without torch); the tiers, precision, bytes and the detail's tensors
are rank 0's part.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from smartckpt_cli.errors import CheckpointCorrupt, StoreDamagedError
from smartckpt_cli.store.checkpoints import candidates, read_manifest
from smartckpt_cli.store.directory import StoreDir
from smartckpt_cli.store.journal import CheckpointRecord
from smartckpt_cli.store.names import blob_rel
from smartckpt_cli.store.scrub import ScrubBook
from smartckpt_cli.store.storage import LocalStorage

__all__ = [
    "Catalog",
    "Lineage",
    "Row",
    "active_writer",
    "blob_sizes",
    "dtensor_nodes",
    "lineages",
    "list_checkpoints",
    "sharding_summary",
    "world_size",
]


@dataclass
class Row:
    step: int
    id: str
    state: str  # live | rolled back | pruned
    utc: str | None
    reason: str
    score: float | None
    health: str
    tiers: list[str]
    precision: str
    bytes_total: int  # encoded bytes it references
    bytes_unique: int  # ... that no other checkpoint on disk references
    bytes_shared: int
    bytes_written: int  # what its save wrote (journal)
    verified: str  # ok | corrupt | never
    verified_utc: str | None = None
    verified_problem: str | None = None
    restore_target: bool = False  # what a resume loads now (newest live healthy)
    manifest_problem: str | None = None
    world_size: int = 1  # ranks that wrote it (journal)
    sharded: int = 0  # DTensor entries sharded over them (rank 0's part: its skeletons)
    sharding: str = "-"  # e.g. "S0×12"; "-" for none, "?" when the manifest is unreadable
    # The least recently checked of its blobs: when a save's scrub or `verify` last re-hashed it
    # ("checked"), or, for one never re-hashed since, when it was written ("written").
    blobs_checked_utc: str | None = None
    blobs_checked_how: str | None = None
    lineage: str | None = None  # the training it continues (commit line; None: before lineages)
    line: str = "A"  # that lineage's letter, in the order lineages began in the journal

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "pruned": self.state == "pruned", "rolled_back": self.state == "rolled back"}


@dataclass
class Catalog:
    store_id: str | None
    rows: list[Row]  # newest first
    journal_problems: list[str]
    failures: list[dict[str, Any]] = field(default_factory=list)
    lineages: list[Lineage] = field(default_factory=list)  # oldest first
    resume_checks: list[dict[str, Any]] = field(default_factory=list)  # journal order
    # zero-code checkpointing that turned itself off ({"step", "why"}), journal order
    checkpointing_off: list[dict[str, Any]] = field(default_factory=list)
    # writes on the loop's path that failed and were not followed by one that worked ({"what", "error"})
    io_errors: list[dict[str, Any]] = field(default_factory=list)
    # checkpoints the journal lost: one line per cause (store/unjournalled.py)
    unjournalled: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "store_id": self.store_id,
            "checkpoints": [r.to_json() for r in self.rows],
            "lineages": [asdict(x) for x in self.lineages],
            "resume_checks": self.resume_checks,
            "journal_problems": self.journal_problems,
            "save_failures": self.failures,
            "checkpointing_off": self.checkpointing_off,
            "io_errors": self.io_errors,
            "unjournalled": self.unjournalled,
        }


@dataclass
class Lineage:
    """The checkpoints of one training: a run that restored continues the lineage it restored
    from; one that began at step 0 starts another (engine/manager.py). A restore never falls
    back from one lineage into another."""

    line: str  # A, B, ... in the order they began in the journal
    id: str | None
    checkpoints: int
    first_step: int
    last_step: int


def lineages(records: list[CheckpointRecord]) -> tuple[list[Lineage], dict[str, str]]:
    """Pure: the lineages of ``records`` (journal order) and each checkpoint id's letter."""
    letters: dict[str | None, str] = {}
    found: dict[str | None, Lineage] = {}
    by_id: dict[str, str] = {}
    for rec in sorted(records, key=lambda r: r.position):
        key = rec.event.get("lineage")
        if key not in letters:
            n = len(letters)
            letters[key] = chr(ord("A") + n) if n < 26 else f"L{n + 1}"
            found[key] = Lineage(letters[key], key, 0, rec.step, rec.step)
        got = found[key]
        got.checkpoints += 1
        got.last_step = rec.step
        by_id[rec.id] = letters[key]
    return list(found.values()), by_id


def blob_sizes(manifest: dict[str, Any]) -> dict[str, int]:
    """Encoded size of every blob a manifest references, by blob id."""
    out: dict[str, int] = {}
    for entry in manifest.get("entries", {}).values():
        for stream in (entry.get("data"), entry.get("patch")):
            for chunk in (stream or {}).get("chunks", []):
                out[str(chunk[0])] = int(chunk[4])
    return out


def world_size(rec: CheckpointRecord) -> int:
    """How many ranks wrote ``rec`` (1 for a single-process checkpoint)."""
    return rec.world_size


def dtensor_nodes(manifest: dict[str, Any]) -> dict[str, tuple[list[int], list[str]]]:
    """``{key: (global shape, placements)}`` of every DTensor entry of a manifest (the
    ``{"__dt": [key, shape, placements]}`` nodes of its object skeletons)."""
    out: dict[str, tuple[list[int], list[str]]] = {}

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for v in node:
                walk(v)
        elif isinstance(node, dict):
            if len(node) == 1 and "__dt" in node:
                key, shape, placements = node["__dt"][:3]
                out[str(key)] = ([int(n) for n in shape], [str(p) for p in placements])
                return
            for v in node.values():
                walk(v)

    for obj in manifest.get("objects", {}).values():
        if isinstance(obj, dict):
            walk(obj.get("tree"))
    return out


def _is_sharded(placements: list[str]) -> bool:
    return any(p.startswith("S") for p in placements)


def sharding_summary(nodes: dict[str, tuple[list[int], list[str]]]) -> tuple[int, str]:
    """The sharded entries' count and their placements counted: ``(12, "S0×12")``, ``(0, "-")``;
    a 2-D mesh reads ``S0,R×4``."""
    counts: dict[str, int] = {}
    for _shape, placements in nodes.values():
        if _is_sharded(placements):
            name = ",".join(placements)
            counts[name] = counts.get(name, 0) + 1
    if not counts:
        return 0, "-"
    return sum(counts.values()), " ".join(f"{k}×{n}" for k, n in sorted(counts.items()))


def _precision(manifest: dict[str, Any]) -> str:
    kinds = {
        (e.get("transform") or {}).get("kind", "none")
        for e in manifest.get("entries", {}).values()
        if e.get("tier") == "L2"
    }
    kinds.discard("none")
    if not kinds:
        return "exact"
    return "+".join(sorted("fp16" if k == "sqrt_fp16" else k for k in kinds))


def _state(rec: CheckpointRecord) -> str:
    return "pruned" if rec.pruned else "rolled back" if rec.rolled_back else "live"


def _verifications(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for ev in events:
        if ev.get("event") == "verified" and isinstance(ev.get("id"), str):
            out[ev["id"]] = ev
    return out


def list_checkpoints(store: StoreDir) -> Catalog:
    lost = _lost(store)
    state, events = store.journal.read_events(consistent=True)
    checked = _verifications(events)
    records = sorted(state.records, key=lambda r: r.position, reverse=True)
    lines, line_of = lineages(state.records)
    manifests, problems = _read_manifests(store, records, state.store_id)
    sizes = {cid: blob_sizes(m) for cid, m in manifests.items()}
    # After the manifests: a checkpoint the restore target passes over adds its problem here.
    target_id = _restore_target(store, state.records, problems, sizes, checked)
    blob_checks = _BlobChecks(store)
    users: dict[str, int] = {}
    for blobs in sizes.values():
        for bid in blobs:
            users[bid] = users.get(bid, 0) + 1
    rows = [
        _row(
            rec,
            manifests.get(rec.id, {}),
            sizes.get(rec.id, {}),
            users,
            checked.get(rec.id),
            blob_checks,
            restore_target=rec.id == target_id,
            problem=problems.get(rec.id),
            line=line_of.get(rec.id, "A"),
        )
        for rec in records
    ]
    checks = _events(events, "resume_check")
    return Catalog(
        state.store_id,
        rows,
        state.problems,
        state.failures,
        lines,
        checks,
        _events(events, "checkpointing_off"),
        _open_io_errors(events),
        lost,
    )


def _lost(store: StoreDir) -> list[str]:
    """One line per cause of checkpoints the journal lost; a journal that cannot be read at all
    raises instead, since there is then nothing to list and that one line is the answer."""
    found = store.survey()
    blocking = found.blocking
    if blocking is not None:
        raise StoreDamagedError(blocking.line(store.where, store.repair_command()))
    return [f.line(store.where, store.repair_command()) for f in found.findings]


def _read_manifests(
    store: StoreDir, records: list[CheckpointRecord], store_id: str | None
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """The manifests of the unpruned ``records`` by checkpoint id, and why each of the others
    does not read (a damaged checkpoint is listed with its problem, not left out)."""
    manifests: dict[str, dict[str, Any]] = {}
    problems: dict[str, str] = {}
    for rec in records:
        if rec.pruned:
            continue
        try:
            manifests[rec.id] = read_manifest(store.storage, rec, store_id)
        except CheckpointCorrupt as err:
            problems[rec.id] = str(err).removeprefix(f"step {rec.step}: ")
        except OSError as err:
            problems[rec.id] = f"manifest {rec.manifest} is unreadable: {err.strerror}"
    return manifests, problems


def _row(
    rec: CheckpointRecord,
    m: dict[str, Any],
    blobs: dict[str, int],
    users: dict[str, int],
    ver: dict[str, Any] | None,
    blob_checks: _BlobChecks,
    *,
    restore_target: bool,
    problem: str | None,
    line: str,
) -> Row:
    """One checkpoint's row from its manifest ``m`` (empty when it does not read), its blobs'
    sizes, how many checkpoints use each blob, and its last verification ``ver``."""
    total = sum(blobs.values())
    unique = sum(n for bid, n in blobs.items() if users[bid] == 1)
    meta = m.get("meta", {})
    n_sharded, sharding = sharding_summary(dtensor_nodes(m)) if m else (0, "?")
    checked_utc, checked_how = blob_checks.oldest(list(blobs)) if blobs else (None, None)
    return Row(
        step=rec.step,
        id=rec.id,
        state=_state(rec),
        utc=meta.get("utc"),
        reason=rec.reason,
        score=rec.score,
        health=rec.health,
        tiers=sorted({str(e.get("tier")) for e in m.get("entries", {}).values()}),
        precision=_precision(m) if m else "",
        bytes_total=total,
        bytes_unique=unique,
        bytes_shared=total - unique,
        bytes_written=rec.bytes_new,
        verified="never" if ver is None else "ok" if ver.get("ok") else "corrupt",
        verified_utc=None if ver is None else ver.get("utc"),
        verified_problem=None if ver is None else ver.get("problem"),
        restore_target=restore_target,
        manifest_problem=problem,
        world_size=world_size(rec),
        sharded=n_sharded,
        sharding=sharding,
        blobs_checked_utc=checked_utc,
        blobs_checked_how=checked_how,
        lineage=rec.event.get("lineage"),
        line=line,
    )


def _restore_target(
    store: StoreDir,
    records: list[CheckpointRecord],
    problems: dict[str, str],
    sizes: dict[str, dict[str, int]],
    checked: dict[str, dict[str, Any]],
) -> str | None:
    """What a resume loads: the newest live healthy checkpoint that is not known to be damaged.
    A restore re-hashes every blob and falls back past a damaged one; without reading blobs,
    damage shows here as a manifest that does not read, a blob missing or of the wrong size
    (one stat each), or a last verification that found it corrupt (noted in ``problems``)."""
    for rec in candidates(records):
        if rec.id not in problems and checked.get(rec.id, {}).get("ok") is False:
            problems[rec.id] = f"its last verification failed: {checked[rec.id].get('problem', '?')}"
        if rec.id not in problems:
            bad = _missing_blob(store, sizes.get(rec.id, {}))
            if bad is None:
                return rec.id
            problems[rec.id] = bad
    return None


def _blob_stat(store: StoreDir, bid: str) -> tuple[int, float | None]:
    """A blob's size and, in a directory, when it was written (an object store: size alone)."""
    if isinstance(store.storage, LocalStorage):
        st = os.stat(store.storage.path(blob_rel(bid)))
        return st.st_size, st.st_mtime
    return store.storage.size(blob_rel(bid)), None


def _missing_blob(store: StoreDir, blobs: dict[str, int]) -> str | None:
    for bid, size in blobs.items():
        try:
            got = _blob_stat(store, bid)[0]
        except (OSError, ValueError):
            return f"blob {bid} is missing"
        if got != size:
            return f"blob {bid} is {got:,} bytes, not {size:,}"
    return None


def _events(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [{k: v for k, v in ev.items() if k != "crc"} for ev in events if ev.get("event") == kind]


def _open_io_errors(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The newest ``io_error`` of each thing written (``what``) that no ``io_ok`` followed."""
    open_: dict[str, dict[str, Any]] = {}
    for ev in events:
        what = ev.get("what")
        if ev.get("event") == "io_error" and isinstance(what, str):
            open_[what] = {k: v for k, v in ev.items() if k != "crc"}
        elif ev.get("event") == "io_ok" and isinstance(what, str):
            open_.pop(what, None)
    return list(open_.values())


class _BlobChecks:
    """When each blob was last re-hashed (the scrub book), else when it was written (its file's
    modification time)."""

    def __init__(self, store: StoreDir) -> None:
        self.store = store
        self.book = ScrubBook(store.meta)
        self._written: dict[str, float | None] = {}

    def _when(self, bid: str) -> tuple[float, str] | None:
        checked = self.book.checked.get(bid)
        if checked is not None:
            return checked, "checked"
        if bid not in self._written:
            try:
                self._written[bid] = _blob_stat(self.store, bid)[1]
            except (OSError, ValueError):
                self._written[bid] = None
        written = self._written[bid]
        return None if written is None else (written, "written")

    def oldest(self, bids: list[str]) -> tuple[str | None, str | None]:
        found = [w for w in (self._when(b) for b in bids) if w is not None]
        if not found:
            return None, None
        when, how = min(found)
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(when)), how


def active_writer(store: StoreDir) -> str | None:
    """Who holds the store's writer lock right now ("pid 123 on host"), or None. Read from
    /proc/locks (Linux) without touching the lock: probing it could make a run that starts at
    this moment fail to get it."""
    if store.url is not None:
        return None  # a URL's writer is a replicator, which holds no lock there
    path = store.meta_root / "writer.lock"
    try:
        st = path.stat()
        with open("/proc/locks") as f:
            locks = f.read().splitlines()
    except OSError:
        return None
    for line in locks:
        parts = line.split()
        if len(parts) < 6 or parts[1] != "FLOCK" or "->" in parts:
            continue
        try:
            inode = int(parts[5].rsplit(":", 1)[1])
        except (IndexError, ValueError):
            continue
        if inode == st.st_ino:
            try:
                return path.read_text(errors="replace").strip() or f"pid {parts[4]}"
            except OSError:
                return f"pid {parts[4]}"
    return None
