"""Verify checkpoints without loading them anywhere: re-hash and decode every blob."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from smartckpt_cli.errors import CheckpointCorrupt
from smartckpt_cli.journal import CheckpointRecord
from smartckpt_cli.restore import load_checkpoint
from smartckpt_cli.store_dir import StoreDir

__all__ = ["VerifyResult", "verify_store"]


@dataclass
class VerifyResult:
    step: int
    id: str
    ok: bool
    problem: str | None = None


def verify_store(
    store: StoreDir,
    *,
    step: int | None = None,
    all_checkpoints: bool = False,
    progress: Callable[[CheckpointRecord], None] | None = None,
) -> tuple[list[VerifyResult], list[str]]:
    """Returns (one result per checked checkpoint, journal problems). By default only the newest
    live checkpoint is checked; ``step`` picks one, ``all_checkpoints`` checks every live one."""
    state = store.journal.read()
    live = sorted(state.live(), key=lambda r: r.position, reverse=True)
    if step is not None:
        live = [r for r in live if r.step == step]
    elif not all_checkpoints:
        live = live[:1]
    results = []
    for rec in live:
        if progress:
            progress(rec)
        try:
            load_checkpoint(store.storage, store.blobs, rec, state.store_id)
            results.append(VerifyResult(rec.step, rec.id, True))
        except CheckpointCorrupt as err:
            results.append(VerifyResult(rec.step, rec.id, False, str(err)))
    return results, state.problems
