"""``smartckpt verify --repair``: rebuild the journal from the manifests no line of it names.

When the journal lost lines (emptied, overwritten, damaged in the middle: store/unjournalled.py),
the manifests it no longer names are the only record of those checkpoints. Repair puts back the
ones that verify completely, and nothing else:

1. the store's writer lock (no run writes meanwhile) and ``journal.lock`` are taken;
2. the manifests no line names are grouped into checkpoints (one manifest, or every rank's part;
   a checkpoint with a part missing from this directory is not rebuilt);
3. each is verified like ``smartckpt verify`` does (its manifest decodes, belongs to the store,
   every blob re-hashed and decoded: ops/verify.py);
4. a new journal is written: its init line (the store id the journal had, or else the one the
   newest verified manifest carries), then the events that still read, in their order, with a
   ``commit`` line (``"repaired": true``) for each checkpoint that verified, placed among the
   other commits by the UTC time its manifest recorded — the only evidence of order left;
5. the old journal is kept beside it (``journal.jsonl.before-repair-<UTC>``) and the new one
   replaces it atomically (temporary file, fsync, rename).

Nothing is removed: a checkpoint that does not verify, or belongs to another store, stays on
disk as it is, and the report names it. Torch-free.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from smartckpt_cli.errors import StoreDamagedError
from smartckpt_cli.ops.verify import check
from smartckpt_cli.store import codec
from smartckpt_cli.store.commit import CommitLine
from smartckpt_cli.store.directory import StoreDir
from smartckpt_cli.store.journal import (
    JOURNAL,
    JOURNAL_FORMAT,
    JOURNAL_LOCK,
    JOURNAL_VERSION,
    CheckpointRecord,
    decode_line,
    decode_manifest,
    encode_line,
)
from smartckpt_cli.store.names import Part, manifest_rel, parse_manifest_file, part_rel

__all__ = ["RepairReport", "repair"]


@dataclass
class RepairReport:
    rebuilt: list[int] = field(default_factory=list)  # steps of the checkpoints put back
    refused: list[str] = field(default_factory=list)  # one line per checkpoint not put back, and why
    backup: str | None = None  # where the old journal was kept
    store_id: str | None = None
    nothing: bool = False  # no manifest without a journal line: nothing to do


@dataclass
class _Orphan:
    step: int
    cid: str
    parts: dict[int | None, bytes]  # rank (None: one process) -> manifest bytes
    manifest: dict[str, Any] | None = None  # rank 0's, decoded
    problem: str | None = None
    record: CheckpointRecord | None = None  # as verify checked it
    nbytes: int = 0  # encoded bytes it references

    @property
    def utc(self) -> str:
        meta = (self.manifest or {}).get("meta") or {}
        return str(meta.get("utc") or "")


def repair(
    store: StoreDir, *, workers: int = 0, progress: Callable[[int, int], None] | None = None
) -> RepairReport:
    """Rebuild the journal of ``store`` (module docstring). Raises StoreLockedError when a run
    writes the store, StoreDamagedError when its journal is of a newer smartckpt."""
    with store.writer_lock(), store.meta.lock(JOURNAL_LOCK):
        found = store.survey()
        if any(f.too_new for f in found.findings):
            raise StoreDamagedError(found.findings[0].line(str(store.root), store.repair_command()))
        foreign = {m for f in found.findings if f.foreign for m in f.manifests}
        candidates = [m for m in found.kept if m not in foreign]
        report = RepairReport()
        for f in found.findings:
            if f.foreign:
                report.refused.append(f"{f.checkpoints} checkpoint(s) of {f.cause}: left as they are")
        if not candidates:
            report.nothing = not foreign
            return report
        orphans = _group(store, candidates, report)
        journal_id = found.state.store_id if found.state is not None else None
        store_id = journal_id or _newest_store_id(orphans)
        if store_id is None:
            report.refused.append("no manifest names its store: nothing to rebuild the journal around")
            return report
        good = _verified(store, orphans, store_id, workers, progress, report)
        events = _surviving_events(store) if found.state is not None else []
        lines = _rebuilt(events, good, store_id, _utc_of(store, found.state))
        report.store_id = store_id
        report.backup = _keep_old(store)
        store.meta.write(JOURNAL, b"".join(encode_line(ev) for ev in lines))
        report.rebuilt = sorted(o.step for o in good)
        return report


def _group(store: StoreDir, rels: list[str], report: RepairReport) -> list[_Orphan]:
    """Manifests no line names, as checkpoints: (step, id) -> every rank's part found here."""
    found: dict[tuple[int, str], _Orphan] = {}
    for rel in sorted(rels):
        parsed = parse_manifest_file(rel.removeprefix("manifests/"))
        if parsed is None:
            continue
        step, cid, rank = parsed
        orphan = found.setdefault((step, cid), _Orphan(step, cid, {}))
        try:
            orphan.parts[rank] = store.storage.read(rel)
        except OSError as err:
            orphan.problem = f"manifest {rel} is unreadable: {err.strerror or err}"
    for orphan in found.values():
        first = orphan.parts.get(None, orphan.parts.get(0))
        if orphan.problem is None and first is not None:
            try:
                orphan.manifest = decode_manifest(first, manifest_rel(orphan.step, orphan.cid))
            except ValueError as err:
                orphan.problem = str(err)
        elif orphan.problem is None:
            orphan.problem = "rank 0's part is not in this directory"
        if orphan.problem is None and None not in orphan.parts:
            world = (orphan.manifest or {}).get("world_size")
            ranks = sorted(r for r in orphan.parts if r is not None)
            if not isinstance(world, int) or ranks != list(range(world)):
                orphan.problem = (
                    f"parts of ranks {', '.join(map(str, ranks))} are here, of a world size of {world}"
                )
        if orphan.problem is not None:
            report.refused.append(f"step {orphan.step} ({orphan.cid}): {orphan.problem}; left as it is")
    return [o for o in found.values() if o.problem is None]


def _newest_store_id(orphans: list[_Orphan]) -> str | None:
    ids = [(o.utc, o.step, (o.manifest or {}).get("store_id")) for o in orphans]
    ids = [x for x in ids if isinstance(x[2], str)]
    return str(max(ids)[2]) if ids else None


def _record(store: StoreDir, o: _Orphan) -> CheckpointRecord:
    """A journal record for an orphan, as verify checks one (its manifest hash is its own)."""
    if None in o.parts:
        data = o.parts[None]
        return CheckpointRecord(o.step, o.cid, manifest_rel(o.step, o.cid), codec.blob_id(data), -1)
    here = store.dir_id()
    ranks = sorted(r for r in o.parts if r is not None)
    parts = tuple(Part(part_rel(o.step, o.cid, r), codec.blob_id(o.parts[r]), here) for r in ranks)
    return CheckpointRecord(o.step, o.cid, parts[0].manifest, parts[0].manifest_hash, -1, parts=parts)


def _verified(
    store: StoreDir,
    orphans: list[_Orphan],
    store_id: str,
    workers: int,
    progress: Callable[[int, int], None] | None,
    report: RepairReport,
) -> list[_Orphan]:
    records = [_record(store, o) for o in orphans]
    results, _, _ = check(store, records, store_id, workers=workers, progress=progress)
    good = []
    for o, rec, res in zip(orphans, records, results, strict=True):
        if res.problems:
            report.refused.append(
                f"step {o.step} ({o.cid}): does not verify ({'; '.join(sorted(res.problems)[:3])}); left as it is"
            )
            continue
        o.record, o.nbytes = rec, res.bytes
        good.append(o)
    return good


def _commit_line(o: _Orphan) -> dict[str, Any]:
    """The line the checkpoint's commit would have written (store/commit.py's fields), marked
    ``repaired``."""
    m, rec = o.manifest or {}, o.record
    assert rec is not None  # verified
    meta = m.get("meta") or {}
    return CommitLine(
        step=o.step,
        id=o.cid,
        manifest=rec.manifest,
        manifest_hash=rec.manifest_hash,
        health=str(m.get("health", "ok")),
        calm=bool(m.get("calm", True)),
        reason=str(meta.get("reason") or "repaired"),
        score=meta.get("score") if isinstance(meta.get("score"), int | float) else None,
        bytes_new=0,  # unknown: what its save wrote is not in the manifest
        bytes_total=o.nbytes,
        lineage=meta["lineage"] if isinstance(meta.get("lineage"), str) else None,
        world_size=len(rec.parts) if rec.parts else None,
        parts=tuple((p.manifest, p.manifest_hash, *([p.dir_id] if p.dir_id else [])) for p in rec.parts)
        if rec.parts
        else None,
        repaired=True,
    ).event()


def _surviving_events(store: StoreDir) -> list[dict[str, Any]]:
    """Every line of the journal that still reads, in order (the init line included)."""
    try:
        raw = store.meta.read(JOURNAL)
    except FileNotFoundError:
        return []
    lines = raw.split(b"\n")
    return [ev for ev in (decode_line(ln) for ln in lines if ln.strip()) if ev is not None]


def _utc_of(store: StoreDir, state: Any) -> dict[str, str]:
    """The UTC time each checkpoint the journal names recorded in its manifest (by id)."""
    out: dict[str, str] = {}
    for rec in state.records if state is not None else []:
        if rec.invalid is not None or rec.pruned:
            continue
        try:
            manifest = decode_manifest(store.storage.read(rec.manifest), rec.manifest)
        except (OSError, ValueError):
            continue
        out[rec.id] = str((manifest.get("meta") or {}).get("utc") or "")
    return out


def _rebuilt(
    events: list[dict[str, Any]], good: list[_Orphan], store_id: str, utc: dict[str, str]
) -> list[dict[str, Any]]:
    """The new journal's events: init, then the surviving events with each verified orphan's
    commit placed before the first surviving commit saved after it (manifest UTC, then step)."""
    pending = sorted(good, key=lambda o: (o.utc, o.step))
    out: list[dict[str, Any]] = [
        {"event": "init", "format": JOURNAL_FORMAT, "v": JOURNAL_VERSION, "store_id": store_id}
    ]
    for ev in events:
        if ev.get("event") == "init":
            continue
        saved = utc.get(str(ev.get("id"))) if ev.get("event") == "commit" else None
        if saved is not None:
            step = ev.get("step") if isinstance(ev.get("step"), int) else -1
            while pending and (pending[0].utc, pending[0].step) < (saved, step):
                out.append(_commit_line(pending.pop(0)))
        out.append(ev)
    out.extend(_commit_line(o) for o in pending)
    return out


def _keep_old(store: StoreDir) -> str | None:
    """Copy the journal as it is beside it, durably, before it is replaced."""
    try:
        old = store.meta.read(JOURNAL)
    except FileNotFoundError:
        return None
    name = f"{JOURNAL}.before-repair-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    store.meta.write(name, old)
    return name
