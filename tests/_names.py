"""Journal events with names the on-disk format allows (store/names.py), for tests that build
journals by hand: a commit line's manifest is the one its step and id give."""

from __future__ import annotations

from typing import Any

from smartckpt_cli.store.names import manifest_rel, part_rel

HASH = "0" * 32


def cid(n: int | str) -> str:
    """A checkpoint id (12 hex digits) made from ``n``: ``cid(3) == '000000000003'``."""
    if isinstance(n, str):
        return n.encode().hex()[:12].rjust(12, "0")
    return f"{n:012x}"


def commit(step: int, ident: str | None = None, *, world: int = 1, **extra: Any) -> dict[str, Any]:
    """A ``commit`` event for ``step`` (id ``cid(step)`` unless given), single-process or with one
    part per rank."""
    c = ident or cid(step)
    ev: dict[str, Any] = {"event": "commit", "step": step, "id": c, "manifest": manifest_rel(step, c)}
    ev["manifest_hash"] = HASH
    if world > 1:
        parts = [[part_rel(step, c, r), HASH, "d" * 16] for r in range(world)]
        ev.update(manifest=parts[0][0], world_size=world, parts=parts)
    ev.update(extra)
    return ev
